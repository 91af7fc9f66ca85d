"""``python -m embbench``: the ``embbench`` command."""

import sys

from embbench.cli import main

sys.exit(main())
