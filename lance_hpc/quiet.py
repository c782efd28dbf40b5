"""Warnings a user cannot act on, silenced where lance_hpc knows they do not apply.

Every warning lance_hpc prints itself says what to do; these come from its dependencies:

- Lance warns "lance is not fork-safe" on every ``fork`` of a process that imported it. The
  processes lance_hpc starts (ranks, ingest workers, benchmark measurements) are forked and exec'd
  at once (``subprocess``), which runs nothing of Lance in the child, and its DataLoader workers
  come from a forkserver that never imported Lance: :func:`exec_children` silences the warning
  around those starts only, so a user's own fork of a Lance process still warns.
- torch 2.14 imports warn that ``isinstance(treespec, LeafSpec)`` is deprecated (its own code).
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from typing import Iterator

FORK_WARNING = r"lance is not fork-safe"
NOT_ACTIONABLE = ((r"`isinstance\(treespec, LeafSpec\)` is deprecated", FutureWarning),)


def quiet_dependencies() -> None:
    """Install the filters for the dependencies' warnings listed in the module doc."""
    for message, category in NOT_ACTIONABLE:
        warnings.filterwarnings("ignore", message=message, category=category)


@contextmanager
def exec_children() -> Iterator[None]:
    """Around starting a subprocess (fork + exec): no Lance fork warning, which cannot apply."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=FORK_WARNING, category=UserWarning)
        yield
