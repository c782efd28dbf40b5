"""``python -m lance_hpc.bench ...``: the same as ``lance-hpc bench ...`` (see :mod:`lance_hpc.cli.bench`).

The command line stands above the package it measures with, so this entry imports none of it: it
runs the package's own ``python -m lance_hpc`` by name, with ``bench`` in front of the arguments,
as the console script names its function."""

import runpy
import sys

if __name__ == "__main__":
    sys.argv.insert(1, "bench")
    runpy.run_module("lance_hpc", run_name="__main__", alter_sys=True)
