"""``python -m tests.support.crash POINT -- INGEST ARGS``: the real ``lance-hpc ingest`` command,
killed (``os._exit``, as a node failure would: nothing after runs, no cleanup) at POINT:

- ``before-commit:N``: as the Nth Lance commit is about to be made;
- ``after-commit:N``: as soon as the Nth Lance commit has landed, before anything is recorded;
- ``before-record``: as the ingest's ``committed.json`` is about to be written.

It exits with :data:`CRASHED`, so a test can tell the crash from the command's own exit.
"""

from __future__ import annotations

import os
import sys
from typing import Any

CRASHED = 97


def crash_at(point: str) -> None:
    import lance

    from lance_hpc.ingest.units import UnitRecords

    where, _, nth = point.partition(":")
    made = [0]
    real_commit = lance.LanceDataset.commit
    real_write = UnitRecords.write_json

    def commit(*args: Any, **kwargs: Any) -> Any:
        made[0] += 1
        if where == "before-commit" and made[0] == int(nth):
            os._exit(CRASHED)
        dataset = real_commit(*args, **kwargs)
        if where == "after-commit" and made[0] == int(nth):
            os._exit(CRASHED)
        return dataset

    def write_json(self: Any, name: str, payload: Any) -> None:
        if where == "before-record" and name == "committed.json":
            os._exit(CRASHED)
        real_write(self, name, payload)

    lance.LanceDataset.commit = staticmethod(commit)  # type: ignore[method-assign,assignment]
    UnitRecords.write_json = write_json  # type: ignore[method-assign]


if __name__ == "__main__":
    crash_at(sys.argv[1])
    from lance_hpc.cli.ingest import main

    sys.exit(main(sys.argv[sys.argv.index("--") + 1 :]))
