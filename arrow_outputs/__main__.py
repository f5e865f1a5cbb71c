"""``python -m arrow_outputs``: the ``arrow-outputs`` command line."""

import sys

from .cli import main

sys.exit(main())
