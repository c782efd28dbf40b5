"""Which rows of which dataset version a training job reads: ``data.version`` or ``data.tag``
resolved to one version, and ``data.filter`` resolved to the row offsets it selects.

Both are pinned at a job's first start (the checkpoint keeps them, see
:func:`pinned_data`), so a requeued or resized job reads the same
rows although the tag moved or rows were added since. The strategies plan over the selected rows
as if they were a dataset of their own (a :class:`FragmentTable` of the rows each fragment keeps),
and the planner maps each planned row to its dataset row offset (:class:`EpochPlanner` ``rows``):
every guarantee of an unfiltered dataset (equal steps, exactly once, resume on any world size)
holds for a filtered one.
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from lance_hpc.errors import UserError, listing
from lance_hpc.loading.mix import pinned_mix
from lance_hpc.loading.sampling import FragmentTable, fragment_table
from lance_hpc.spec import DataSpec
from lance_hpc.storage.datasets import Dataset, open_dataset
from lance_hpc.storage.retry import retrying

if TYPE_CHECKING:
    from lance_hpc.checkpoint.resuming import Checkpoint

log = logging.getLogger("lance_hpc.data")

# Lance's own columns, which its error messages list among the valid fields.
META_COLUMNS = ("_rowid", "_rowaddr", "_rowoffset", "_row_last_updated_at_version", "_row_created_at_version")


def tag_version(dataset: Dataset, uri: str, tag: str, where: str) -> int:
    """The version ``tag`` names in the dataset at ``uri``; a clear error for a missing tag."""
    tags = dataset.tags.list()  # type: ignore[attr-defined]
    if tag not in tags:
        known = ", ".join(sorted(tags)) or "none"
        raise UserError(
            f"{where}: {uri} has no tag {tag!r} (its tags: {known})\n"
            f"  fix: name one of its tags, tag a version with lance's dataset.tags.create({tag!r}, VERSION), or use a version"
        )
    return int(tags[tag]["version"])


def open_pinned(
    uri: str, options: dict[str, str], version: int | None, tag: str | None, where: str, timeout_s: float = 120.0
) -> Dataset:
    """The dataset at ``version``, at the version ``tag`` names, or at its latest."""
    dataset = open_dataset(uri, version, options, timeout_s=timeout_s)
    if tag is not None and version is None:
        pinned = tag_version(dataset, uri, tag, where)
        if pinned != int(dataset.version):
            dataset = open_dataset(uri, pinned, options, timeout_s=timeout_s)
    return dataset


def filter_problem(error: Exception, dataset: Dataset, where: str, predicate: str) -> UserError:
    """A user's filter that Lance refused, said without Lance's source paths and internal columns."""
    message = str(error)
    message = re.sub(r",\s*/\S+\.rs:\d+:\d+\s*$", "", message.strip())
    message = message.replace("Invalid user input: ", "")
    message = re.sub(r"\s*Valid fields are [^.]*\.+", "", message)
    columns = [name for name in dataset.schema.names if name not in META_COLUMNS]
    return UserError(
        f"{where}: Lance cannot apply the filter {predicate!r}: {message}\n"
        f"  fix: write a SQL predicate over the dataset's columns, e.g. label < 5 AND quality > 0.8; its columns:"
        f"{listing(columns, '    ')}"
    )


@dataclass(frozen=True)
class Selection:
    """A dataset version's rows a job reads: ``table`` counts them per fragment; ``offsets`` holds
    their dataset row offsets in order (None: every row, in which case ``table`` is the dataset's)."""

    uri: str
    version: int
    filter: str | None
    table: FragmentTable
    offsets: np.ndarray | None
    dataset_rows: int
    bytes_per_row: float

    @property
    def rows(self) -> int:
        return self.table.total_rows

    def run_rows(self, block_kb: int) -> int:
        """Rows of one ``sampler: block`` read: enough neighbouring rows for ``block_kb`` KiB."""
        return max(1, math.ceil(block_kb * 1024 / max(self.bytes_per_row, 1.0)))

    def describe(self) -> str:
        if self.filter is None:
            return f"{self.rows:,} rows"
        share = self.rows / self.dataset_rows if self.dataset_rows else 0.0
        return f"{self.rows:,} of {self.dataset_rows:,} rows ({share:.1%}) selected by filter {self.filter!r}"


def bytes_per_row(dataset: Dataset, rows: int) -> float:
    """Stored bytes per row from the manifest's data file sizes (no data file read)."""
    size = 0
    for fragment in dataset.get_fragments():
        for data_file in fragment.metadata.files:
            size += int(getattr(data_file, "file_size_bytes", 0) or 0)
    return size / rows if rows and size else 1024.0


def select(
    dataset: Dataset,
    uri: str,
    predicate: str | None,
    where: str = "data.filter",
    options: dict[str, str] | None = None,
    timeout_s: float = 120.0,
) -> Selection:
    """The rows of ``dataset`` that ``predicate`` selects (all without one), planned from the
    manifest and one scan of the row offsets that match: the predicate runs in Lance, over the
    columns it names only."""
    whole = fragment_table(dataset)
    per_row = bytes_per_row(dataset, whole.total_rows)
    if predicate is None:
        return Selection(uri, int(dataset.version), None, whole, None, whole.total_rows, per_row)
    table = retrying(
        lambda: dataset.to_table(columns=["_rowoffset"], filter=predicate),  # type: ignore[call-arg]
        what=f"the filter scan of {uri}",
        uri=uri,
        options=options or {},
        timeout_s=timeout_s,
        on_retry=lambda: None,
        explain=lambda error: filter_problem(error, dataset, where, predicate) if isinstance(error, ValueError) else error,
    )
    offsets = np.sort(np.asarray(table.column(0).to_numpy(), dtype=np.int64))
    if len(offsets) == 0:
        raise UserError(
            f"{where}: the filter {predicate!r} selects no rows of {uri} version {dataset.version} "
            f"({whole.total_rows:,} rows)\n  fix: loosen the filter, or check it against the data with lance-hpc plan"
        )
    bounds = np.searchsorted(offsets, np.append(whole.starts, whole.total_rows))
    kept = np.diff(bounds)
    selected = FragmentTable.from_rows([int(count) for count in kept], whole.ids)
    return Selection(uri, int(dataset.version), predicate, selected, offsets, whole.total_rows, per_row)


def select_training_rows(
    uri: str,
    options: dict[str, str],
    version: int | None,
    tag: str | None,
    predicate: str | None,
    where: str = "data",
    timeout_s: float = 120.0,
) -> tuple[Dataset, Selection]:
    """Open a training source pinned by version or tag and select its rows."""
    dataset = open_pinned(uri, options, version, tag, f"{where}.tag", timeout_s)
    return dataset, select(dataset, uri, predicate, f"{where}.filter", options, timeout_s)


def pinned_data(data_spec: DataSpec, resumed: Checkpoint | None) -> DataSpec:
    """A resumed job reads the rows its checkpoint was trained on: the same dataset version (the
    one its tag named at the first start), the same filter, the same mix sources' versions."""
    if resumed is None:
        return data_spec
    version = resumed.state["dataset_version"]
    pinned = resumed.state.get("data_pinned") or {}
    start_over = "start over with checkpoint.resume: false and a new checkpoint.dir"
    if data_spec.version is not None and data_spec.version != version:
        raise UserError(
            f"data.version is {data_spec.version} but the checkpoint was trained on version {version}\n"
            f"  fix: remove data.version to resume, or {start_over}"
        )
    if "filter" in pinned and pinned["filter"] != data_spec.filter:
        raise UserError(
            f"data.filter is {data_spec.filter!r} but the checkpoint was trained on the rows of {pinned['filter']!r}\n"
            f"  fix: set data.filter back to resume, or {start_over}"
        )
    if pinned.get("sources"):
        return data_spec.model_copy(update={"mix": pinned_mix(data_spec, pinned["sources"], start_over)})
    if version is None:
        return data_spec
    if data_spec.tag is not None:
        log.info(
            "resuming on version %s of %s, which data.tag %r named at the first start", version, data_spec.uri, data_spec.tag
        )
    return data_spec.model_copy(update={"version": version, "tag": None})
