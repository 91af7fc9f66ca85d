"""``python -m embbench``: the ``embbench`` command."""

from embbench.cli import exit_process, main

exit_process(main())
