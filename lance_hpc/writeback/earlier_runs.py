"""The earlier runs of a write-back job, made by other code: their uncommitted fragments discarded.

A run's key holds what produces its values (:mod:`lance_hpc.writeback.identity`), so a rerun after
the function or the checkpoint changed is a new run, in a folder of its own. The job's earlier runs
(each records the job's key and its code in ``job.json``; a run from before that record is the
folder named by the job's key alone) that never committed hold fragments of the old code: rank 0
discards them at the new run's first start, in one line that says what changed, so no column mixes
the values of two versions of a function and no stale folder is left to delete by hand. A run that
committed is left as it is: its record says what the dataset holds.
"""

from __future__ import annotations

from typing import Mapping

import pyarrow.fs as pafs

from lance_hpc.ingest.target import filesystem
from lance_hpc.writeback.new_columns import Records

JOB_RECORD = "job.json"
WHAT = {"function": "infer.function's source", "checkpoint": "the checkpoint"}


def claim(root: str, job: str, run: str, produced_by: Mapping[str, str], options: Mapping[str, str]) -> None:
    """Rank 0 before a run's first pin: the job's other runs that did not commit (other code) are
    discarded, said in one line each; the run is recorded as the job's, with its code."""
    records = Records(run, options)
    if records.pinned() is not None:
        return
    store, path = filesystem(root, options)
    for info in store.get_file_info(pafs.FileSelector(path, allow_not_found=True)):
        if info.type != pafs.FileType.Directory or info.base_name == run.rpartition("/")[2]:
            continue
        other = Records(f"{root}/{info.base_name}", options)
        recorded = other.read_json(JOB_RECORD)
        ours = info.base_name == job or (isinstance(recorded, dict) and recorded.get("job") == job)
        if not ours or other.committed() is not None:
            continue
        then = recorded.get("code") if isinstance(recorded, dict) else None
        then = then if isinstance(then, dict) else {}  # a record of another shape says nothing of the code
        changed = [WHAT[part] for part in WHAT if part in produced_by and then.get(part) != produced_by[part]]
        written, pinned = len(other.finished()), other.pinned()
        other.clear()
        print(
            f"starting over: {' and '.join(changed) or 'the code'} changed since an earlier run of this job wrote "
            f"{written} fragment(s)" + (f" of version {pinned}" if pinned is not None else "") + "; they are discarded",
            flush=True,
        )
    records.write_json(JOB_RECORD, {"job": job, "code": dict(produced_by)})
