"""What one measurement is: the configuration a fresh worker process receives as JSON, and the
result it writes back."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class Measurement:
    """One configuration, measured in a fresh process (``python -m lance_hpc.bench._worker``)."""

    label: str  # the row in the table, e.g. "lance_hpc map/distributed"
    kind: str  # "decode_limit" or a name in pipelines.PIPELINES
    dataset: str  # which data set: "photos", "small", or "job"
    result_path: str = ""
    lance_uri: str = ""
    folder: str = ""  # the ImageFolder copy of the same images
    image_size: int = 224
    image_column: str = "image"  # the image task's columns, for lance_hpc pipelines and the decode limit
    label_column: str = "label"
    augment: str = "none"  # lance_hpc pipelines' training augmentation: resize only, like the peers
    batch_size: int = 64
    num_workers: int = 2
    seconds: float = 4.0  # measuring window after the first batch
    full_epoch: bool = False  # read the whole epoch, however long it takes
    warmup_epochs: int = 0  # lance_hpc pipelines: whole epochs read before the measured one (to fill data.cache)
    fingerprint: bool = False  # return a fingerprint of every image read (exactly-once check)
    data: dict[str, Any] = field(default_factory=dict)  # DataSpec fields only, for lance_hpc pipelines
    rank: int = 0
    world_size: int = 1  # processes started (a gloo group when > 1)
    data_world_size: int | None = None  # ranks the loader shards for; None: world_size
    cores: int = 1  # the decode limit is one core's rate times this
    store_counters: bool = False  # read the S3 benchmark server's counters at data.storage_options.endpoint
    train_model: str = ""  # a torchvision model trained one step per batch (the GPU section); "" trains nothing
    device: str = "cuda"  # where train_model trains (the tests use "cpu")

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Measurement:
        return cls(**json.loads(text))


@dataclass
class Result:
    """What a worker measured. ``images_per_s`` is the steady rate after the first batch."""

    label: str
    dataset: str
    images_per_s: float
    first_batch_s: float
    images: int
    batches: int
    seconds: float
    main_rss_mib: float
    worker_rss_mib: float
    worker_growth_mib: float
    cpu_ms_per_image: float = 0.0  # main process and workers, over the window
    main_cpu_ms_per_image: float = 0.0  # the main process's share
    rank: int = 0
    world_size: int = 1
    epoch_done: bool = False
    fingerprints: list[str] = field(default_factory=list)
    worker_rss_timeline: list[tuple[float, float]] = field(default_factory=list)  # (s after first batch, MiB)
    store: dict[str, float] = field(default_factory=dict)  # the S3 server's counters over the window (s3_server)
    data_wait_share: float = 0.0  # with train_model: the window's share spent waiting for the next batch
    device_name: str = ""  # with train_model: the device it trained on (torch's name of the GPU)
    bytes_written: int = 0  # what a measurement that writes (an inference job, a rewrite) added on disk
    error: str = ""

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> Result:
        return cls(**values)
