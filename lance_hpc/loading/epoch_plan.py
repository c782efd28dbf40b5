"""One epoch of a training job for every rank, from fragment metadata alone (:class:`DataPlan`):
what ``lance-hpc plan`` and the dry run print (:mod:`lance_hpc.loading.plan`), and what a loader
plans its steps by."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from lance_hpc.loading.sampling import FragmentTable, rank_share, strategy_function

if TYPE_CHECKING:
    from lance_hpc.spec import DataSpec


@dataclass(frozen=True)
class DataPlan:
    """One epoch of a training job, for every rank: computed from fragment metadata only."""

    style: str
    sampler: str
    rows: int
    fragments: int
    min_fragment_rows: int
    max_fragment_rows: int
    world_size: int
    batch_size: int
    uneven: str
    rows_per_rank: int
    steps_per_rank: int
    last_batch_rows: int
    dropped: int
    padded: int
    uri: str = ""
    version: int | None = None
    selected: str = ""  # the rows a filter selects, when data.filter is set
    sources: tuple[str, ...] = ()  # data.mix: a line per source

    @property
    def batches(self) -> int:
        """Batches per epoch over all ranks."""
        return self.steps_per_rank * self.world_size

    def __str__(self) -> str:
        every = self.sampler == "full_scan"
        lines = [
            ("dataset", f"{self.uri}" + (f" (version {self.version})" if self.version is not None else "")),
            ("strategy", f"{self.style} / {self.sampler}" + ("" if every else f", uneven: {self.uneven}")),
            (
                "rows",
                f"{self.rows:,} in {self.fragments:,} fragments"
                + (f" ({self.min_fragment_rows:,}..{self.max_fragment_rows:,} rows each)" if self.fragments else ""),
            ),
            ("selected", self.selected),
            ("world size", f"{self.world_size:,} ranks x batch {self.batch_size:,}"),
            ("rows per rank", f"{self.rows_per_rank:,}" + (" (every rank reads every row)" if every else "")),
            (
                "steps per rank",
                f"{self.steps_per_rank:,}, the same on every rank"
                + (f" (last batch {self.last_batch_rows:,} rows)" if self.last_batch_rows not in (0, self.batch_size) else ""),
            ),
            ("batches", f"{self.batches:,} per epoch over all ranks"),
            ("dropped", f"{self.dropped:,} rows per epoch"),
            ("padded", f"{self.padded:,} rows per epoch (repeated)"),
        ]
        if self.sources:  # a mix: its sources, then what a job epoch draws
            lines[0] = ("dataset", f"a mix of {len(self.sources)} sources")
            lines[2] = ("rows", f"{self.rows:,} drawn per epoch over all ranks")
            lines[1:1] = [("source", line) for line in self.sources]
        lines = [(name, value) for name, value in lines if value or name not in ("dataset", "selected")]
        width = max(len(name) for name, _ in lines)
        return "\n".join(f"  {name:<{width}}  {value}" for name, value in lines)


def plan_from_table(
    table: FragmentTable,
    world_size: int,
    batch_size: int,
    *,
    style: str = "map",
    sampler: str = "distributed",
    uneven: str = "drop",
    uri: str = "",
    version: int | None = None,
    selected: str = "",
) -> DataPlan:
    """The DataPlan of a strategy on a fragment table; O(fragments), whatever the row count."""
    strategy_function(sampler)
    rows = table.total_rows
    share = rank_share(rows, world_size, batch_size, uneven, every_rank_all_rows=sampler == "full_scan")
    return DataPlan(
        style=style,
        sampler=sampler,
        rows=rows,
        fragments=len(table.rows),
        min_fragment_rows=min(table.rows, default=0),
        max_fragment_rows=max(table.rows, default=0),
        world_size=world_size,
        batch_size=batch_size,
        uneven=uneven,
        rows_per_rank=share.rows_per_rank,
        steps_per_rank=share.steps,
        last_batch_rows=share.last_batch_rows,
        dropped=share.dropped,
        padded=share.padded,
        uri=uri,
        version=version,
        selected=selected,
    )


def spec_plan(
    data: DataSpec, table: FragmentTable, world_size: int, *, uri: str, version: int | None = None, selected: str = ""
) -> DataPlan:
    """The DataPlan of ``data``'s layout (style, sampler, uneven, batch size) over ``table``."""
    return plan_from_table(
        table,
        world_size,
        data.batch_size,
        style=data.style,
        sampler=data.sampler,
        uneven=data.uneven,
        uri=uri,
        version=version,
        selected=selected,
    )
