"""``python -m embbench.cli``: the ``embbench`` command."""

import sys

from embbench.cli import main

sys.exit(main())
