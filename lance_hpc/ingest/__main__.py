"""``python -m lance_hpc.ingest``: see :mod:`lance_hpc.ingest.dataset`.

``lance-hpc ingest --nproc N`` starts its workers this way. USR1 (a profiler trace, asked of a
SLURM job with ``scancel --signal=USR1``, which signals every process of the job) is not theirs:
it is ignored from the first line, before the imports below take seconds, instead of ending the
process as it would by default."""

import signal
import sys

if __name__ == "__main__":
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)

    from lance_hpc.ingest.dataset import main

    sys.exit(main())
