"""The names a spec may choose from where the code behind them lives in another layer.

The spec is the contract of the job file, so the names are written here, and the spec checks a job
against them without importing the layers that implement them. Each of those layers keys its
registry by these names and checks, when it is imported, that it implements every one of them and
nothing else (:func:`check_registry`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

# data.sampler: how the rows of an epoch are split between ranks (lance_hpc.loading.sampling.STRATEGIES)
SAMPLERS = ("distributed", "block", "sharded_batch", "sharded_fragment", "full_scan")
# data.style, and the samplers each style runs; full_scan gives every rank every row (evaluation only)
STYLES: dict[str, tuple[str, ...]] = {
    "map": ("distributed", "block"),
    "iterable": ("block", "sharded_batch", "sharded_fragment", "full_scan"),
}
# data.uneven: what a rank does with the rows left over when they do not split evenly
UNEVEN_MODES = ("drop", "pad")
# data.val_sampler
EVAL_MODES = ("sharded", "full_scan")
# data.on_corrupt: a row that cannot be decoded (lance_hpc.loading.reader)
ON_CORRUPT = ("skip", "fail")
# infer.outputs: the Arrow value type of a new column (a vector output becomes a fixed-size list of it)
OUTPUT_TYPES = ("float16", "float32", "float64", "int32", "int64")
# infer.refresh: which rows a write-back job computes (lance_hpc.backfill)
REFRESH_MODES = ("missing",)
# infer.on_error: what a write-back job does with a row its model or function raises on (lance_hpc.writeback.row_errors)
ON_ERROR_MODES = ("fail", "skip")
# data.ingest.source formats a job: ingest splits into shards (lance_hpc.ingest.formats.FORMATS), each
# written <format>:<path or glob>; python-stdlib[:max_mb=N] is a text: corpus of this interpreter's library
# and takes no path (BARE_FORMATS). A format of one's own is an import path instead (FORMAT_PATH).
SHARD_FORMATS = ("parquet", "jsonl", "webdataset", "hf", "imagefolder", "text", "python-stdlib")
BARE_FORMATS = ("python-stdlib",)
# <module or file.py>:<Class>:<location>, a format of one's own and where its rows are
FORMAT_PATH = re.compile(r"(?P<module>[^:]+\.py|[A-Za-z_][\w.]*):(?P<name>[A-Za-z_][\w.]*):(?P<location>.*)", re.DOTALL)
# Prefixes of that form that name a source lance_hpc.ingest.dataset writes, not a format
NOT_FORMATS = ("torchvision",)
# data.ingest.columns: the columns a source's fields map to (lance_hpc.ingest.shard_batches.COLUMN_TYPES)
INGEST_COLUMNS = ("image", "label", "text", "key")
# slurm.container.runtime (lance_hpc.launch.container.RUNTIMES)
CONTAINER_RUNTIMES = ("apptainer", "pyxis")


def check_registry(registry: Iterable[str], names: Iterable[str], what: str) -> None:
    """Raise unless ``registry`` implements exactly ``names``: a name the spec accepts must run."""
    implemented, accepted = set(registry), set(names)
    if implemented != accepted:
        raise RuntimeError(f"{what}: the spec accepts {sorted(accepted)} but {sorted(implemented)} are implemented")


def source_format(text: str) -> tuple[str, str] | None:
    """``(format, location)`` of a shard source, the format a registered name or an import path
    (``my_formats.py:CsvRows:/data/*.csv`` gives ``("my_formats.py:CsvRows", "/data/*.csv")``);
    None for any other source."""
    name, sep, location = text.partition(":")
    if name in SHARD_FORMATS and (sep or name in BARE_FORMATS):
        return name, location
    found = FORMAT_PATH.fullmatch(text)
    if found is None or found["module"] in NOT_FORMATS:
        return None
    return f"{found['module']}:{found['name']}", found["location"]
