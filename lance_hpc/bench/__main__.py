"""``python -m lance_hpc.bench``: the same as ``lance-hpc bench`` (see :mod:`lance_hpc.cli.bench`)."""

import sys

from lance_hpc.cli.bench import main

sys.exit(main())
