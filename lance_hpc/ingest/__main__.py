"""``python -m lance_hpc.ingest``: the same as ``lance-hpc ingest`` (see :mod:`lance_hpc.cli.ingest`).

USR1 (a profiler trace, asked of a SLURM job with ``scancel --signal=USR1``, which signals every
process of the job) is not for an ingest: it is ignored from the first line, before the imports
below take seconds, instead of ending the process as it would by default."""

import sys

if __name__ == "__main__":
    from lance_hpc.cli import ignore_profile_requests

    ignore_profile_requests()

    from lance_hpc.cli.ingest import main

    sys.exit(main())
