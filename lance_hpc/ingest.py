"""``python -m lance_hpc.ingest``: see :mod:`lance_hpc.data.ingest`."""

import sys

from lance_hpc.data.ingest import main

if __name__ == "__main__":
    sys.exit(main())
