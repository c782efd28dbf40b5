"""One read of a shard: the bounds its records are held to, which fields' contents it needs, and
what it left out.

A source is data someone else wrote: a tar of a few KB can declare a member of a terabyte or a
sample of thirty thousand fields. A record past a bound is skipped and counted by reason (or, with
``on_corrupt: fail``, fails the ingest naming it), so memory stays bounded whatever the source holds.
A plan reads the first shard for its schema and its size, which need no image: those reads name the
fields they need (``bodies``), and the contents of the others are passed over, not held.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lance_hpc.errors import UserError
from lance_hpc.limits import MAX_SAMPLE_FIELDS

# Rows per record batch a shard is read in: bounded memory whatever the shard's size.
BATCH_ROWS = 256
# A batch of records read one by one (files, samples) holds at most this many bytes, or one record.
BATCH_BYTES = 16 << 20
# Fields whose contents shape a WebDataset sample's columns (JSON fields, a class number, a caption):
# always read, so that a read for the schema sees the same columns and types as the ingest.
SHAPING_FIELDS = frozenset({"json", "cls", "txt"})


@dataclass
class Reading:
    """How one read of a shard goes: ``on_corrupt`` for a record past a bound, the fields whose
    contents are read (``None``: all; the others stand as empty values of their type), and what it
    left out (``skipped`` by reason, ``unread`` bytes passed over)."""

    on_corrupt: str = "fail"
    bodies: frozenset[str] | None = None
    max_fields: int = MAX_SAMPLE_FIELDS
    skipped: dict[str, int] = field(default_factory=dict)
    unread: int = 0

    def wants(self, name: str) -> bool:
        """Whether the contents of field ``name`` are read."""
        return self.bodies is None or name in self.bodies or name in SHAPING_FIELDS

    def skip(self, reason: str, what: str, fix: str) -> None:
        """A record left out: counted under ``reason``, or one error with ``on_corrupt: fail``."""
        if self.on_corrupt == "fail":
            raise UserError(f"{what}\n  fix: {fix}")
        self.skipped[reason] = self.skipped.get(reason, 0) + 1


# The fix of a record over max_record_mb.
TOO_BIG_FIX = (
    "raise data.ingest.max_record_mb (--max-record-mb) if such records are wanted, or ingest with on_corrupt: skip "
    "to leave them out (counted)"
)
