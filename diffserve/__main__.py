"""``python -m diffserve`` = the ``diffserve`` command."""

import sys

from diffserve.entrypoints.cli import main

sys.exit(main())
