"""``python -m lance_hpc COMMAND ...``: the same as the ``lance-hpc`` console script."""

import sys

from lance_hpc.cli import main

sys.exit(main())
