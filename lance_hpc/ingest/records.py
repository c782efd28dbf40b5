"""What an ingest run records beside its training dataset, in ``.<name>.ingest/<run id>/``: one
small file per finished shard (the fragments it wrote, its rows, what it skipped and why), and once
every split is committed, their versions. A rerun redoes only the shards without a record; before a
run writes anything, records that name what the datasets no longer hold make it start over
(:mod:`lance_hpc.ingest.rerun`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Mapping

from lance_hpc.ingest.rerun import (
    COMMITTED_FILE,
    stale_records,
    start_over,
)
from lance_hpc.ingest.units import UnitRecords

if TYPE_CHECKING:
    from lance_hpc.ingest.plan import Plan


@dataclass
class ShardRecord:
    """What one worker wrote for one shard: the fragments of each split (Lance's JSON), rows, skips."""

    shard: str
    fragments: dict[str, list[str]]
    rows: dict[str, int]
    skipped: dict[str, int] = field(default_factory=dict)
    bytes: int = 0
    seconds: float = 0.0
    # token sequences: per split, the documents, their UTF-8 bytes and their tokens (EOD included)
    documents: dict[str, int] = field(default_factory=dict)
    utf8_bytes: dict[str, int] = field(default_factory=dict)
    tokens: dict[str, int] = field(default_factory=dict)


class Records(UnitRecords[ShardRecord]):
    """The finished shards of one plan, one small JSON file each, beside the training dataset."""

    def __init__(self, uri: str, options: Mapping[str, str]) -> None:
        super().__init__(uri, options, "shard", ShardRecord)

    @classmethod
    def of(cls, plan: Plan) -> Records:
        return cls(plan.records, plan.train.options)

    def committed(self) -> dict[str, int] | None:
        """The versions recorded once every split was committed, as recorded (not checked against
        the datasets: :func:`resume_lines` does that before a run writes anything)."""
        found = self.read_json(COMMITTED_FILE)
        return dict(found) if found is not None else None

    def mark_committed(self, versions: dict[str, int]) -> None:
        self.write_json(COMMITTED_FILE, versions)


def stale_parts(plan: Plan) -> list[str]:
    """What this run's records name that the datasets no longer hold (none: every record counts)."""
    records = Records.of(plan)
    finished = records.finished()  # before the files are listed: a record is written after its files
    fragments = {
        split: [text for record in finished.values() for text in record.fragments.get(split, [])] for split in plan.targets()
    }
    return stale_records(records, plan.targets(), plan.run_id, fragments)


def resume_lines(plan: Plan) -> list[str]:
    """Before a run writes anything, in the one process that starts it: records naming what the
    datasets no longer hold are discarded (the run starts over, the splits still committed kept),
    and a line says so, or says which commits of an earlier run of this ingest were found."""
    records = Records.of(plan)
    stale = stale_parts(plan)
    if stale:
        dropped = start_over(records, keep=plan.landed)
        return [
            f"starting over: an earlier run of this ingest recorded {'; '.join(stale)} (deleted or rewritten since); "
            f"its {dropped} shard record(s) are discarded and every shard is written again"
        ]
    if not plan.landed or records.committed() == plan.landed:
        return []
    order = sorted(plan.targets(), key=lambda name: name != "val")  # the order of the commits
    found = ", ".join(
        f"{split} ({plan.targets()[split].uri} version {plan.landed[split]})" for split in order if split in plan.landed
    )
    left = [split for split in order if split not in plan.landed]
    rest = f"committing {', '.join(left)}" if left else "recording the ingest as committed"
    return [f"found the commits of an earlier run of this ingest that stopped before the rest: {found}; {rest}"]


def records_root(train_uri: str) -> str:
    parent, _, name = train_uri.rstrip("/").rpartition("/")
    return f"{parent}/.{name}.ingest" if parent else f".{name}.ingest"
