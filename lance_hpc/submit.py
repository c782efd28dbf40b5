"""``python -m lance_hpc.submit JOB.yaml``: the same as ``lance-hpc submit`` (see :mod:`lance_hpc.cli.submit`)."""

from __future__ import annotations

import sys

if __name__ == "__main__":
    from lance_hpc.cli.submit import main

    sys.exit(main(prog="python -m lance_hpc.submit"))
