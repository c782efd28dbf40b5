"""``python -m lance_hpc.ingest ...``: the same as ``lance-hpc ingest ...`` (see :mod:`lance_hpc.cli.ingest`).

The command line stands above the package it writes with, so this entry imports none of it: it
runs the package's own ``python -m lance_hpc`` by name, with ``ingest`` in front of the arguments,
as the console script names its function. That command ignores USR1 (a profiler trace, which
``scancel --signal=USR1`` asks of every process of a SLURM job) before it imports the ingest,
which takes seconds, instead of ending the process as USR1 would by default."""

import runpy
import sys

if __name__ == "__main__":
    sys.argv.insert(1, "ingest")
    runpy.run_module("lance_hpc", run_name="__main__", alter_sys=True)
