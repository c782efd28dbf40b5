"""A rank of a standby step: the next attempt of a job inside its allocation, started ahead by
the restart supervisor (:mod:`lance_hpc.launch.restarts`) beside the running one. It imports what
the job will and waits for the supervisor's go file, so a restart on the same nodes skips Python's
start-up; the go file either brings what the rank needs to know of the failure before it, or says
that the step is not needed.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import signal
import time
from pathlib import Path

from lance_hpc.kinds import job_kind
from lance_hpc.runtime import preemption
from lance_hpc.runtime.restart_variables import STANDBY_VARIABLE
from lance_hpc.spec import load_spec_text
from lance_hpc.spec.load import read_own_text
from lance_hpc.storage.shared_files import read_own

# How often a waiting standby rank looks for its go file: the delay it adds to a restart, and the
# metadata reads it costs a shared file system while it waits (one per rank per interval).
STANDBY_POLL_S = 0.2
GO_LIMIT = 16 * 1024 * 1024  # bytes read of the go file: the variables of the attempt's ranks
# A waiting standby rank ends quietly on these (srun passes SIGTERM on; submitit's task would ignore it).
QUIT_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def wait_if_standby(spec_file: str, environ: dict[str, str] | os._Environ = os.environ) -> None:
    """In a rank of a standby step: import what the job will (:func:`warm_up`), then wait until
    the supervisor's go file says go, take the variables it brings and run; or that this step is
    not needed, then end."""
    go = environ.get(STANDBY_VARIABLE)
    if not go:
        return
    # USR2 and USR1 reach every step of the job: while it waits, a standby rank must not act on them
    # (submitit's own USR2 handler would requeue the job from here, before the running ranks save)
    previous = {signum: signal.getsignal(signum) for signum in (*preemption.HELD_SIGNALS, *QUIT_SIGNALS)}
    preemption.hold()
    for signum in QUIT_SIGNALS:  # the supervisor cancels a standby step that never read its go file so
        signal.signal(signum, lambda signum, frame: os._exit(0))
    warm_up(spec_file)
    rank = environ.get("SLURM_PROCID") or environ.get("RANK") or "0"
    with contextlib.suppress(OSError):  # the supervisor counts these to say the standby is ready
        Path(f"{go}.ready-{rank}").touch()
    while True:
        try:
            message = json.loads(read_own(go, GO_LIMIT))
            break
        except (OSError, ValueError):  # not written yet (it is renamed into place whole)
            time.sleep(STANDBY_POLL_S)
    if message.get("cancel"):
        os._exit(0)
    for signum, handler in previous.items():
        signal.signal(signum, handler)
    environ.update(message.get("environ", {}))
    environ.pop(STANDBY_VARIABLE, None)


# What a rank imports only on first use, after its start: a standby rank imports them ahead.
WARM_MODULES = ("lance", "lance.dataset", "pyarrow.dataset", "torch.utils.tensorboard", "lance_hpc.runtime.trainer")


def warm_up(spec_file: str) -> None:
    """Import the job's own code (its task, entry and kind, as the rank loads them) and what the
    run imports on first use; nothing that opens files of the job or talks to other ranks. A
    failure here is left for the run itself to report."""
    deterministic = False
    with contextlib.suppress(Exception):
        spec = load_spec_text(read_own_text(spec_file), spec_file).spec
        job_kind(spec.job)
        deterministic = spec.train.deterministic
    # torch.use_deterministic_algorithms imports torch._inductor.config: seconds of imports
    for module in [*WARM_MODULES, *(["torch._inductor.config"] if deterministic else [])]:
        with contextlib.suppress(Exception):
            importlib.import_module(module)
