"""``python -m lance_hpc.launch.job_check SPEC NPROC MESSAGE_FILE``: a local run's check of its job,
once before its ranks start (:func:`lance_hpc.launch.local.check_job`), in a process of its own
forked with torch and Lance imported (:mod:`lance_hpc.launch.warm_ranks`): the kind's check prints
what it says; its error goes to ``MESSAGE_FILE`` (exit 2) for the launcher to raise, and Ctrl-C
ends it with exit 130, which the launcher reports.
"""

from __future__ import annotations

import sys
from pathlib import Path

from lance_hpc.errors import ExitCode, UserError
from lance_hpc.kinds import job_kind
from lance_hpc.spec import JobSpec, load_spec


def check_lines(spec: JobSpec, nproc: int) -> list[str]:
    """What the job's kind says of it, run here with ``nproc`` ranks."""
    return job_kind(spec.job).check(spec, nproc)


def main(argv: list[str]) -> int:
    spec_file, nproc, message_file = argv
    try:
        for line in check_lines(load_spec(spec_file).spec, int(nproc)):
            print(line, flush=True)
    except UserError as error:
        Path(message_file).write_text(str(error))
        return ExitCode.USER_ERROR
    except KeyboardInterrupt:
        return ExitCode.INTERRUPTED
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
