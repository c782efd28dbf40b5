"""A write-back whose dataset moved on before its commit: what its next run continues from.

The commit is refused when the dataset is no longer at the version the run pinned: the new columns
were computed for that version's rows, and are never mixed into another's. Left pinned there, every
rerun would be refused again. So rank 0, refusing, moves the run on: when the dataset kept the
pinned version's schema and every one of its fragments as it was (rows appended: another ingest,
LanceDB's ``add``), the run is pinned to the new version, and the fragments already written are
kept, since their rows did not change (a fragment keeps its position in the list, its id and its
files); the next run computes only the fragments it does not hold as they were (the appended ones,
and any rewritten, e.g. by a compaction), and commits. Rows deleted anywhere, or a changed schema,
clear the run: the next one starts over on the version the dataset is at, with its checks.
"""

from __future__ import annotations

from typing import Any

from lance_hpc.errors import UserError
from lance_hpc.storage.datasets import open_dataset
from lance_hpc.writeback.new_columns import ColumnPlan, Records


def unchanged(pinned: Any, latest: Any) -> list[int] | None:
    """The positions of the fragments ``latest`` holds as ``pinned`` had them (same position, id
    and metadata); None when the schema changed or a fragment has deleted rows (a run cannot go on)."""
    # pyarrow compares field metadata as maps; Lance's serialised schema lists a map's keys in an
    # order of its own each time, so its bytes differ for the same schema
    if not pinned.schema.equals(latest.schema, check_metadata=True):
        return None
    now = latest.get_fragments()
    if any(fragment.metadata.deletion_file is not None for fragment in now):
        return None
    then = pinned.get_fragments()
    return [
        position
        for position, fragment in enumerate(then[: len(now)])
        if fragment.fragment_id == now[position].fragment_id and fragment.metadata.to_json() == now[position].metadata.to_json()
    ]


def refuse_if_moved(plan: ColumnPlan, records: Records) -> None:
    """Rank 0 before its commit: nothing when the dataset is still at the pinned version; else the
    run moved on (see the module) and a UserError that says what happened and what the next run does."""
    latest = open_dataset(plan.uri, None, plan.options)
    if int(latest.version) == plan.version:
        return
    pinned = plan.dataset()
    kept = unchanged(pinned, latest)
    what = f"it read version {plan.version}, the dataset is at version {latest.version} now"
    if kept is None:
        records.clear()
        raise UserError(
            f"{plan.uri} changed while this job ran ({what}, with other columns or deleted rows), so the new columns "
            f"were not committed and the fragments written are discarded\n"
            f"  fix: run the same job again: it starts over on version {latest.version}"
        )
    finished = records.finished()
    valid = set(kept)
    for index in finished:
        if index not in valid:
            records.forget(index)
    records.pin(int(latest.version))  # after the forgetting: a crash in between leaves the old pin, fewer records
    written = len([index for index in finished if index in valid])
    appended = len(latest.get_fragments()) - len(pinned.get_fragments())
    happened = (
        f"rows were appended to {plan.uri} while this job ran ({what}: {appended} new fragment(s))"
        if len(kept) == len(pinned.get_fragments())
        else f"{plan.uri} changed while this job ran ({what})"
    )
    raise UserError(
        f"{happened}, so the new columns (computed for version {plan.version}'s rows) were not committed; "
        f"the next run continues from version {latest.version}, keeping the {written} fragment(s) written\n"
        "  fix: run the same job again: it computes the new fragments only, then commits"
    )
