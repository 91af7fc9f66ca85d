"""``python -m embbench.cli``: the ``embbench`` command."""

from embbench.cli import exit_process, main

exit_process(main())
