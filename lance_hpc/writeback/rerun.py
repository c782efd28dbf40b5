"""What a rerun of a write-back job recognises: its earlier commit, while the dataset still holds it.

A run's record of its commit (``committed.json``) counts only while the dataset, at its latest
version, is at least that version and holds the columns that commit wrote, which their provenance
names (:mod:`lance_hpc.lineage.provenance`); for a refresh, while no row lacks them. Otherwise rank
0 clears the run's records and the job starts over. The other ranks wait until the record they
read is no longer there as they read it: gone, or another commit (each is unique), which rank 0
may have made before they look again (:mod:`lance_hpc.writeback.waits`).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from lance_hpc.backfill import missing
from lance_hpc.lineage.provenance import provenance_of, runs_of
from lance_hpc.storage.datasets import open_dataset
from lance_hpc.writeback import waits
from lance_hpc.writeback.new_columns import Records, run_name


def stale_commit(
    dataset: Any, outputs: Mapping[str, str], version: int, run: str, *, refresh: bool = False, filtered: bool = False
) -> str | None:
    """Why a record that this run committed ``version`` no longer holds (None when it does): the
    dataset, at its latest version, must be at least that version and hold the columns that commit
    wrote, which their provenance says (a column dropped and added again, by hand or by another job,
    names another run or none; Lance may give it the same field id). A column committed before
    lance_hpc recorded provenance is taken on its name. For a refresh, which runs whenever rows lack
    the columns, no row may lack them (``filtered``: a fragment of nulls only is the filter's doing)."""
    if int(dataset.version) < version:
        return f"the dataset is at version {dataset.version} now (recreated?)"
    absent = [name for name in outputs if name not in dataset.schema.names]
    if absent:
        return f"its latest version (version {dataset.version}) has no column {', '.join(absent)}"
    if refresh:
        gaps = missing.gaps(dataset, outputs, all_null=not filtered)
        return f"rows were added since: {missing.describe(dataset, gaps, outputs)}" if gaps else None
    try:
        then = dataset.checkout_version(version).schema
    except (ValueError, OSError):  # cleaned up since: the columns must have provenance to be told apart
        then = None
    others = []
    for name in outputs:
        document = provenance_of(dataset.schema, name)
        if document is None and then is not None and provenance_of(then, name) is None:
            continue  # committed before provenance was recorded
        if document is None or run not in runs_of(document):
            others.append(name)
    if others:
        return f"{', '.join(others)} in its latest version (version {dataset.version}) are not the columns it committed"
    return None


def earlier_commit(
    records: Records,
    uri: str,
    options: dict[str, str],
    outputs: Mapping[str, str],
    *,
    main: bool,
    stopped: Callable[[], bool],
    refresh: bool = False,
    filtered: bool = False,
) -> int | None:
    """The version an earlier run of this job committed, while the dataset still has it; else None,
    after rank 0 has cleared that run's records (saying so in one line): the job starts over. The
    other ranks wait for rank 0 (or for ``stopped()``: :class:`~lance_hpc.writeback.waits.Stopped`)."""
    seen = records.commit_record()  # read before the dataset: a commit made after it is another record
    if seen is None:
        return None
    version = int(seen["version"])

    def stale(version: int) -> str | None:
        dataset = open_dataset(uri, None, options)
        return stale_commit(dataset, outputs, version, run_name(records.path), refresh=refresh, filtered=filtered)

    reason = stale(version)
    if reason is None:
        return version
    if main:
        print(f"starting over: an earlier run of this job committed version {version} of {uri}, but {reason}", flush=True)
        records.clear()
        return None

    def moved_on() -> tuple[dict[str, Any] | None] | None:
        now = records.commit_record()
        return None if now == seen else (now,)

    (now,) = waits.wait_for(moved_on, stopped, f"clear the stale records of {uri}")
    # cleared: the run starts over (its pin, which stays, is what this rank waits for next); or rank
    # 0 has started over and committed already: that commit, while it holds
    return int(now["version"]) if now is not None and stale(int(now["version"])) is None else None
