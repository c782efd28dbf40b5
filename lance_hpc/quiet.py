"""Warnings a user cannot act on, silenced where lance_hpc knows they do not apply.

Every warning lance_hpc prints itself says what to do; these come from its dependencies:

- Lance warns "lance is not fork-safe" on every ``fork`` of a process that imported it. The
  processes lance_hpc starts (ranks, ingest workers, benchmark measurements) are forked and exec'd
  at once (``subprocess``), which runs nothing of Lance in the child, and its DataLoader workers
  and local ranks fork from servers that imported Lance but never used it: :func:`exec_children`
  and those servers silence the warning around those starts only, so a user's own fork of a
  Lance process still warns.
- torch 2.14 imports warn that ``isinstance(treespec, LeafSpec)`` is deprecated (its own code).
- torch's distributed checkpoint warns that it assumes a load in one process when no process group
  is formed: lance_hpc reads shards in one process only where it means to (``checkpoint export``
  asks for exactly that), and a job's ranks load with their process group formed.
- TensorBoard logs "Detected out of order event.step likely caused by a TensorFlow restart" when
  it reads the events of a resumed run: the run asked for that purge itself (``purge_step``, so a
  requeued job draws one curve), so ``lance-hpc status`` reading them has nothing to report.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import warnings
from contextlib import contextmanager
from typing import Iterator

FORK_WARNING = r"lance is not fork-safe"
NOT_ACTIONABLE = (
    (r"`isinstance\(treespec, LeafSpec\)` is deprecated", FutureWarning),
    (
        r"torch\.distributed is (disabled, )?unavailable or uninitialized, assuming the intent is to load in a single process",
        UserWarning,
    ),
)
# TensorBoard's log lines (logger, how the line starts) that are not warnings to a user.
NOT_ACTIONABLE_LOGS = (("tensorboard", "Detected out of order event.step likely caused by a TensorFlow restart"),)


class _Dropped(logging.Filter):
    """Drops the warnings of a logger that start with ``start``, and nothing else."""

    def __init__(self, start: str):
        super().__init__()
        self.start = start

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno == logging.WARNING and record.getMessage().startswith(self.start))


def quiet_dependencies() -> None:
    """Install the filters for the dependencies' warnings listed in the module doc."""
    for message, category in NOT_ACTIONABLE:
        warnings.filterwarnings("ignore", message=message, category=category)
    for name, start in NOT_ACTIONABLE_LOGS:
        # the logger TensorBoard logs through, made here without importing TensorBoard
        logging.getLogger(name).addFilter(_Dropped(start))


@contextmanager
def exec_children() -> Iterator[None]:
    """Around starting a subprocess (fork + exec): no Lance fork warning, which cannot apply."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=FORK_WARNING, category=UserWarning)
        yield


def fork_unread() -> int:
    """``os.fork()`` of a process that imported Lance but never read through it (the servers that
    DataLoader workers and local ranks fork from): no Lance fork warning, which cannot apply, and
    the output flushed first, or the child would write what this process's buffers hold again."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    with exec_children():  # the same filter, left in both processes
        return os.fork()
