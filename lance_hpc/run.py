"""``python -m lance_hpc.run SPEC_FILE``: the command every rank runs (see :mod:`lance_hpc.cli.run`).

It holds SLURM's preemption warning from its first line, while the imports below take seconds."""

from __future__ import annotations

if __name__ == "__main__":
    from lance_hpc.runtime import preemption

    preemption.hold()

    from lance_hpc.cli.run import rank_main

    code = rank_main()  # forks the DataLoader workers' server first, before it reads through Lance
    from lance_hpc.kinds.rank import exit_process

    exit_process(code)
