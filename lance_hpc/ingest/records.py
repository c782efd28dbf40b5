"""What an ingest run records beside its training dataset, in ``.<name>.ingest/<run id>/``: one
small file per finished shard (the fragments it wrote, its rows, what it skipped and why), and once
every split is committed, their versions. A rerun redoes only the shards without a record; before a
run writes anything, records that name what the datasets no longer hold make it start over
(:mod:`lance_hpc.ingest.rerun`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from lance_hpc.ingest.rerun import COMMITTED_FILE
from lance_hpc.ingest.units import UnitRecords


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

    def committed(self) -> dict[str, int] | None:
        """The versions recorded once every split was committed, as recorded (not checked against
        the datasets: :func:`lance_hpc.ingest.plan.resume_lines` does that before a run writes anything)."""
        found = self.read_json(COMMITTED_FILE)
        return dict(found) if found is not None else None

    def mark_committed(self, versions: dict[str, int]) -> None:
        self.write_json(COMMITTED_FILE, versions)


def records_root(train_uri: str) -> str:
    parent, _, name = train_uri.rstrip("/").rpartition("/")
    return f"{parent}/.{name}.ingest" if parent else f".{name}.ingest"
