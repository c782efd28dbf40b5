"""The ``data`` section of a job spec: the dataset, its loading strategy and mix, the node-local
cache, and the source an ingest writes it from."""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator, model_validator

from lance_hpc.limits import DEFAULT_RECORD_MB, MAX_PIXELS, MAX_RECORD_MB, MAX_SEQUENCE_LENGTH
from lance_hpc.spec.choices import EVAL_MODES, INGEST_COLUMNS, ON_CORRUPT, SAMPLERS, STYLES, UNEVEN_MODES
from lance_hpc.spec.predicates import check_predicate
from lance_hpc.spec.section import MAX_INT, MAX_SEED, Section, choice
from lance_hpc.storage.options import is_remote

# The largest weight of a mix over its smallest: a source below 2**-62 of the largest would not be
# drawn once in the largest epoch (mix_epoch_rows <= 2**62), and its share would underflow.
MAX_WEIGHT_RATIO = 2.0**62
# A node-local cache's size in GiB: 2**20 GiB (1 PiB) is past any node's local disk.
MAX_CACHE_GB = float(2**20)


class IngestSpec(Section):
    source: str = Field(
        ...,
        description="What to ingest when data.uri does not exist yet: sklearn-digits, skimage-photos, "
        "torchvision:<Name>:<root>; or, by shards: imagefolder:<dir>, text:<glob>, python-stdlib, parquet:, jsonl:, "
        "webdataset:, hf:; or a format of one's own by import path: path/to/formats.py:MyFormat:<location>.",
    )
    val_fraction: float = Field(0.2, ge=0.0, lt=1.0, description="Share of rows written to data.val_uri.")
    rows_per_fragment: int = Field(1024, ge=1, le=MAX_INT, description="Rows per Lance fragment.")
    seed: int = Field(
        0,
        ge=0,
        le=MAX_SEED,
        description="sklearn-digits, skimage-photos, torchvision: seed of the split and row order (sharded sources split "
        "by a hash of each row's key).",
    )
    sequence_length: int = Field(256, ge=2, le=MAX_SEQUENCE_LENGTH, description="Text sources: tokens per training sequence.")
    tokenizer: str = Field(
        "bytes",
        description="Text sources: bytes (UTF-8, nothing to download), hf:<tokenizer.json> (e.g. one trained by "
        "lance-hpc tokenizer train) or pkg.mod:factory.",
    )
    vocab_size: int = Field(
        8192,
        ge=300,
        le=MAX_INT,
        description="tokenizer: hf:<file> that does not exist yet: the job trains a byte-level BPE of this many tokens "
        "there first, on the source's training documents (as lance-hpc tokenizer train does).",
    )
    tokenize: bool | None = Field(
        None,
        description="Pack the source's text into token sequences for a language model: by default yes for text: and "
        "python-stdlib (no: one row per document), no for other sources (yes: tokenise their text column).",
    )
    files_per_shard: int = Field(
        1000, ge=1, le=MAX_INT, description="imagefolder: and text: sources: files per shard (a worker's unit of work)."
    )
    overwrite: bool = Field(
        False,
        description=(
            "Write over Lance datasets already at data.uri / data.val_uri as new versions (other files are never touched); "
            "a job's start still skips a complete one."
        ),
    )
    columns: dict[str, str] = Field(
        default_factory=dict,
        description="parquet:, jsonl:, webdataset:, hf: sources: which field is image, label, text or key, e.g. {image: png}; "
        "'' for none; other fields are kept as columns.",
    )
    append: bool = Field(
        False, description="parquet:, jsonl:, webdataset:, hf: sources: add the rows to the dataset at data.uri as a new version."
    )
    on_corrupt: str = Field(
        "skip",
        description="An image that cannot be read, or a sample past max_record_mb or the field limit, at ingest: skip "
        "(counted in the summary) or fail the ingest.",
    )
    max_pixels: int = Field(
        MAX_PIXELS,
        ge=1,
        le=MAX_PIXELS,
        description="Images with more pixels are skipped at ingest (at most what training decodes, the default).",
    )
    max_record_mb: int = Field(
        DEFAULT_RECORD_MB,
        ge=1,
        le=MAX_RECORD_MB,
        description="webdataset:, imagefolder:, text: sources: a member or file larger than this many MiB is skipped "
        "(counted) or fails the ingest, as on_corrupt says.",
    )

    check_on_corrupt = field_validator("on_corrupt")(choice(lambda: ON_CORRUPT))

    @field_validator("columns")
    @classmethod
    def check_columns(cls, columns: dict[str, str]) -> dict[str, str]:
        unknown = sorted(set(columns) - set(INGEST_COLUMNS))
        if unknown:
            raise ValueError(f"{', '.join(unknown)}: the columns a field can map to are {', '.join(INGEST_COLUMNS)}")
        return columns


class CacheSpec(Section):
    dir: str = Field(
        ...,
        min_length=1,
        description="Node-local directory for cached data files, shared by every rank and worker on the node; $VARS expand there.",
    )
    max_gb: float = Field(
        ..., gt=0, le=MAX_CACHE_GB, description="Size limit in GiB; beyond it the least recently used files are deleted."
    )

    @field_validator("dir")
    @classmethod
    def check_dir(cls, directory: str) -> str:
        if "://" in directory or not directory.startswith(("/", "$", "~")):
            raise ValueError(
                f"{directory!r} is not an absolute local path\n"
                "  fix: name a directory on each node's local disk, e.g. /local/nvme/lance-cache or $TMPDIR/lance-cache"
            )
        return directory


class MixSource(Section):
    uri: str = Field(..., description="One dataset of the mix: local path or s3://bucket/path.lance.")
    weight: float = Field(..., gt=0, description="Its share of every step's rows, relative to the other sources' weights.")
    filter: str | None = Field(None, min_length=1, description="Lance SQL predicate choosing the source's rows.")
    version: int | None = Field(None, ge=1, le=MAX_INT, description="Pinned version of the source.")
    tag: str | None = Field(None, min_length=1, description="Pinned by tag name instead of version.")
    storage_options: dict[str, str] | None = Field(None, description="Object-store options of this source [default: data's].")
    val_uri: str | None = Field(None, description="This source's own validation set, reported as val/<source>/* beside val/*.")

    @model_validator(mode="after")
    def one_pin(self) -> MixSource:
        if self.version is not None and self.tag is not None:
            raise ValueError("set version or tag, not both")
        return self

    check_filter = field_validator("filter")(check_predicate)


class DataSpec(Section):
    uri: str = Field(
        ..., description="Training dataset: local path or s3://bucket/path.lance [default with mix: the first source]."
    )
    val_uri: str | None = Field(None, description="Validation dataset; null skips evaluation.")
    version: int | None = Field(None, ge=1, le=MAX_INT, description="Pinned dataset version; null: latest at start.")
    tag: str | None = Field(
        None, min_length=1, description="Pinned by tag name (a version the dataset's owner named) instead of data.version."
    )
    filter: str | None = Field(
        None,
        min_length=1,
        description="Train on the rows matching this Lance SQL predicate (e.g. quality > 0.8 AND lang = 'en'), pinned at first start.",
    )
    mix: list[MixSource] | None = Field(
        None,
        min_length=1,
        description="Several datasets drawn by weight in every step, each with its own epoch (docs: data-loading.md#mixes).",
    )
    mix_epoch_rows: int | None = Field(
        None,
        ge=1,
        le=2**62,
        description="Rows an epoch of a mix draws over all ranks [default: the sources' selected rows together].",
    )
    block_kb: int = Field(
        2048,
        ge=1,
        le=2**20,
        description="sampler: block: KiB of neighbouring rows read as one run (a worker holds 2 windows of block_window runs).",
    )
    block_window: int = Field(
        32, ge=1, le=2**16, description="sampler: block: runs whose rows are shuffled together (each worker holds one window)."
    )
    storage_options: dict[str, str] = Field(
        default_factory=dict,
        description="Object-store options (endpoint, region, allow_http); credentials come from env.",
    )
    style: str = Field("map", description="Dataset style: map | iterable.")
    sampler: str = Field(
        "distributed",
        description=(
            "Sampler: distributed or block (map), sharded_batch | sharded_fragment | block (iterable) "
            "[default: block for a dataset on object storage (s3://, gs://, az://), else distributed]."
        ),
    )
    val_sampler: str = Field("sharded", description="Evaluation split: sharded across ranks, or full_scan on every rank.")
    uneven: str = Field("drop", description="How ranks get equal steps: drop the surplus rows or pad by repeating rows.")
    batch_size: int = Field(64, ge=1, le=MAX_INT, description="Samples per rank per step.")
    num_workers: int = Field(4, ge=0, le=MAX_INT, description="DataLoader worker processes per rank.")
    prefetch_factor: int = Field(2, ge=1, le=MAX_INT, description="Batches each worker keeps ready.")
    io_depth: int = Field(
        4,
        ge=0,
        le=64,
        description=(
            "Batches each worker reads ahead from the store while it decodes (hides object-storage latency; "
            "each costs one batch of encoded bytes in memory); 0: read on demand."
        ),
    )
    shuffle: bool = Field(True, description="Reshuffle every epoch from seed + epoch.")
    seed: int = Field(0, ge=0, le=MAX_SEED, description="Seed of the data order and of augmentation.")
    on_corrupt: str = Field("skip", description="A row the task cannot decode: skip (counted in logs) or fail naming it.")
    ingest: IngestSpec | None = Field(None, description="Create the dataset on first use from a source.")
    io_timeout_s: float | None = Field(
        None,
        gt=0,
        le=MAX_INT,
        description=(
            "Seconds a read keeps retrying a failing store before the job stops; at most train.collective_timeout_s - 30 "
            "[default: that, up to 120]."
        ),
    )
    cache: CacheSpec | None = Field(None, description="Node-local cache of fetched data files; null reads the store every epoch.")

    @model_validator(mode="before")
    @classmethod
    def defaults_of_uri(cls, values: Any) -> Any:
        """With a mix, data.uri is the first source's (where a dataset's files and checks are named).
        An unset sampler over object storage is block: runs of block_kb per request instead of about
        one request per sample (see docs/data-loading.md, "Shuffled reads that stay cheap")."""
        if not isinstance(values, dict):
            return values
        if "uri" not in values and isinstance(values.get("mix"), list) and values["mix"]:
            first = values["mix"][0]
            uri = first.get("uri") if isinstance(first, dict) else getattr(first, "uri", None)
            if isinstance(uri, str):
                values = {**values, "uri": uri}
        if "sampler" not in values and isinstance(values.get("uri"), str) and is_remote(values["uri"]):
            values = {**values, "sampler": "block"}
        return values

    @model_validator(mode="after")
    def one_selection(self) -> DataSpec:
        if self.version is not None and self.tag is not None:
            raise ValueError("set data.version or data.tag, not both")
        if self.mix is not None and (self.filter or self.version is not None or self.tag):
            raise ValueError("with data.mix, set filter, version and tag on each source, not on data")
        if self.mix is not None and self.uri != self.mix[0].uri:
            raise ValueError("with data.mix, leave data.uri out: it is the first source's uri")
        return self

    check_style = field_validator("style")(choice(lambda: STYLES))
    check_sampler = field_validator("sampler")(choice(lambda: SAMPLERS))
    check_val_sampler = field_validator("val_sampler")(choice(lambda: EVAL_MODES))
    check_uneven = field_validator("uneven")(choice(lambda: UNEVEN_MODES))
    check_on_corrupt = field_validator("on_corrupt")(choice(lambda: ON_CORRUPT))
    check_filter = field_validator("filter")(check_predicate)

    @field_validator("mix")
    @classmethod
    def check_weights(cls, mix: list[MixSource] | None) -> list[MixSource] | None:
        weights = [source.weight for source in mix or ()]
        if weights and max(weights) > MAX_WEIGHT_RATIO * min(weights):
            raise ValueError(
                f"the weights {min(weights):g} and {max(weights):g} are more than 2**62 apart: the lighter source "
                "would never be drawn\n  fix: remove that source, or give the weights as shares of a few units (0.9, 0.1)"
            )
        return mix
