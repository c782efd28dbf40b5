"""The pipelines the benchmark measures, by name: the peers a user would otherwise pick, and
lance_hpc's own strategies. Each builder returns an iterable of batches; :func:`batch_images`
finds the uint8 or float image tensor in whatever a pipeline yields.

The peers are written the way their documentation shows them (the reference map-style and
iterable pipelines of the lance-distributed-training example, torchvision's ImageFolder), with
the same batch size, output size and worker count as lance_hpc, so the ratios compare loaders,
not settings.
"""

from __future__ import annotations

import io
from typing import Any, Callable, Iterable, cast

from torch.utils.data import IterableDataset

from lance_hpc.bench.configs import Measurement
from lance_hpc.bench.pipeline import fresh_directory, lance_hpc_loader

Builder = Callable[[Measurement], Iterable[Any]]


def pil_transform(image_size: int) -> Any:
    """The peers' per-image transform: resize to a square, then to a float tensor."""
    from torchvision import transforms

    return transforms.Compose([transforms.Resize((image_size, image_size)), transforms.ToTensor()])


class PilCollate:
    """Collate for SafeLanceDataset rows (dicts): PIL open, convert, resize, to tensor, stack.

    A class rather than a closure so DataLoader workers in other processes can unpickle it."""

    def __init__(self, image_size: int) -> None:
        self.image_size = image_size
        self._transform: Any = None

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        import torch
        from PIL import Image

        if self._transform is None:
            self._transform = pil_transform(self.image_size)
        images = [self._transform(Image.open(io.BytesIO(row["image"])).convert("RGB")) for row in rows]
        return {"image": torch.stack(images), "label": torch.tensor([row["label"] for row in rows], dtype=torch.long)}


class PilToTensor:
    """``to_tensor_fn`` for pylance's LanceDataset: the same PIL path over an Arrow record batch."""

    def __init__(self, image_size: int) -> None:
        self.collate = PilCollate(image_size)

    def __call__(self, batch: Any, **_: Any) -> dict[str, Any]:
        return self.collate(batch.to_pylist())


def reference_map_style(config: Measurement) -> Iterable[Any]:
    """pylance SafeLanceDataset + DistributedSampler + get_safe_loader + PIL collate."""
    import torch
    from lance.torch.data import SafeLanceDataset, get_safe_loader
    from torch.utils.data.distributed import DistributedSampler

    dataset = SafeLanceDataset(config.lance_uri)
    sampler: Any = DistributedSampler(dataset, num_replicas=config.world_size, rank=config.rank, shuffle=True, seed=0)
    return get_safe_loader(
        dataset,
        batch_size=config.batch_size,
        sampler=sampler,
        num_workers=config.num_workers,
        collate_fn=PilCollate(config.image_size),
        pin_memory=torch.cuda.is_available(),
        persistent_workers=config.num_workers > 0,
    )


def reference_iterable(config: Measurement) -> Iterable[Any]:
    """pylance LanceDataset + ShardedBatchSampler + PIL to_tensor_fn, no workers."""
    from lance.sampler import ShardedBatchSampler
    from lance.torch.data import LanceDataset
    from torch.utils.data import DataLoader

    dataset = LanceDataset(
        config.lance_uri,
        batch_size=config.batch_size,
        to_tensor_fn=PilToTensor(config.image_size),
        sampler=ShardedBatchSampler(config.rank, config.world_size, randomize=True, seed=0),
    )
    return DataLoader(dataset, batch_size=None, num_workers=0)


def image_folder(config: Measurement) -> Iterable[Any]:
    """torchvision ImageFolder + DataLoader over the JPEG files (the default fork workers)."""
    import torch
    from torch.utils.data import DataLoader
    from torchvision.datasets import ImageFolder

    dataset = ImageFolder(config.folder, transform=pil_transform(config.image_size))
    return DataLoader(
        dataset,
        batch_size=config.batch_size,
        shuffle=True,
        num_workers=config.num_workers,
        pin_memory=torch.cuda.is_available(),
        persistent_workers=config.num_workers > 0,
    )


# The best peer loaders, each fed the same JPEG bytes. ``config.data`` says where their copy is and
# how to decode: {"uri": local path or s3:// URI, "storage_options": Lance-style options for the
# S3 server ({} locally), "cache_dir": where a peer that downloads keeps what it fetched (emptied
# here, so every measurement reads cold), "decode": "peer" (its documented decode) or "lance_hpc"}.


class LanceHpcDecode:
    """Encoded bytes -> uint8 [3, S, S]: lance_hpc's image task's decode and resize, one image at a
    time, for peers that hand the transform one sample."""

    def __init__(self, image_size: int) -> None:
        self.image_size = image_size

    def __call__(self, data: Any) -> Any:
        import numpy as np

        from lance_hpc.tasks.image_decode import Transform, decode_pixels

        # augment "none" is the benchmark's resize-only setting; it draws nothing from the generator.
        return Transform(self.image_size, augment="none")(decode_pixels(data), np.random.default_rng(0))


class PilDecode:
    """Encoded bytes or an opened PIL image -> float [3, S, S]: the peers' documented PIL path."""

    def __init__(self, image_size: int) -> None:
        self.image_size = image_size
        self._transform: Any = None

    def __call__(self, image: Any) -> Any:
        from PIL import Image

        if self._transform is None:
            self._transform = pil_transform(self.image_size)
        if isinstance(image, (bytes, bytearray, memoryview)):
            image = Image.open(io.BytesIO(image))
        return self._transform(image.convert("RGB"))


class TensorResize:
    """LitData's documented path after its own decode (a uint8 [3, H, W] tensor from torchvision's
    decode_jpeg): torchvision Resize, then to float like ToTensor."""

    def __init__(self, image_size: int) -> None:
        self.image_size = image_size
        self._transform: Any = None

    def __call__(self, image: Any) -> Any:
        import torch
        from torchvision import transforms

        if self._transform is None:
            self._transform = transforms.Compose(
                [transforms.Resize((self.image_size, self.image_size)), transforms.ConvertImageDtype(torch.float32)]
            )
        return self._transform(image)


class SampleImage:
    """Applies an image function to the ``"image"`` field of a sample dict."""

    def __init__(self, function: Callable[[Any], Any]) -> None:
        self.function = function

    def __call__(self, sample: dict[str, Any]) -> dict[str, Any]:
        return {"image": self.function(sample["image"]), "label": sample["label"]}


class RecordBatchRows:
    """LanceDB StreamingDataset's transform: an Arrow record batch -> one sample dict per row."""

    def __init__(self, function: Callable[[Any], Any]) -> None:
        self.function = function

    def __call__(self, batch: Any) -> list[dict[str, Any]]:
        images, labels = batch.column("image"), batch.column("label").to_pylist()
        return [{"image": self.function(images[index].as_py()), "label": label} for index, label in enumerate(labels)]


class ArrowBatchDecode:
    """collate_fn for a LanceDB Permutation in Arrow format: lance_hpc's ImageDecoder over the whole
    record batch, into one preallocated batch (what lance_hpc's own workers do)."""

    def __init__(self, image_size: int) -> None:
        self.image_size = image_size

    def __call__(self, batch: Any) -> dict[str, Any]:
        import numpy as np
        import pyarrow as pa
        import torch

        from lance_hpc.tasks.image import ImageDecoder
        from lance_hpc.tasks.image_decode import Transform

        decoder = ImageDecoder("image", "label", Transform(self.image_size, augment="none"))
        out = {name: torch.empty((batch.num_rows, *spec.shape), dtype=spec.dtype) for name, spec in decoder.fields().items()}
        bad = decoder.decode(pa.Table.from_batches([batch]), out, np.random.default_rng(0))
        if bad:
            raise ValueError(f"undecodable rows in the batch: {bad}")
        return out


class MappedIterable(IterableDataset):
    """An iterable dataset with a function applied to each sample: the documented way to put a
    transform on MosaicML streaming's dataset (its __getitem__ overridden; here around __iter__, so
    its own partitioning across workers is untouched)."""

    def __init__(self, dataset: Any, function: Callable[[Any], Any]) -> None:
        super().__init__()
        self.dataset, self.function = dataset, function

    def __iter__(self):
        return map(self.function, self.dataset)


def _peer_image_function(config: Measurement, peer_default: Callable[[int], Callable[[Any], Any]]) -> Callable:
    decode = config.data.get("decode", "peer")
    if decode not in ("peer", "lance_hpc"):
        raise ValueError(f"unknown decode {decode!r}: use peer or lance_hpc")
    return LanceHpcDecode(config.image_size) if decode == "lance_hpc" else peer_default(config.image_size)


def _lancedb_table(config: Measurement) -> Any:
    import lancedb

    uri, table = config.data["uri"].rsplit("/", 1)
    return lancedb.connect(uri, storage_options=config.data.get("storage_options") or None).open_table(table)


def lancedb_streaming(config: Measurement) -> Iterable[Any]:
    """LanceDB StreamingDataset (a thread pool of reads with io_queue_depth batches in flight per
    split, then a transform pool) under its StreamingDataLoader. One split per DataLoader worker and
    one transform thread per worker: the same two cores as every other row."""
    from lancedb.streaming import StreamingDataLoader, StreamingDataset

    workers = max(1, config.num_workers)
    dataset = StreamingDataset(
        _lancedb_table(config),
        num_splits=workers * config.world_size,
        shuffle_seed=0,
        rank=config.rank,
        world_size=config.world_size,
        columns=["image", "label"],
        transform=RecordBatchRows(_peer_image_function(config, PilDecode)),
        transform_parallelism=1,
    )
    return StreamingDataLoader(
        dataset,
        batch_size=config.batch_size,
        num_workers=config.num_workers,
        multiprocessing_context="spawn" if config.num_workers else None,
    )


def lancedb_permutation(config: Measurement) -> Iterable[Any]:
    """LanceDB Permutation as a map-style dataset under torch's DataLoader (shuffled, spawn workers,
    as its documentation shows); batches of Python rows decoded by PIL, or Arrow batches decoded by
    lance_hpc's ImageDecoder."""
    import torch
    from lancedb.permutation import Permutation
    from torch.utils.data import DataLoader

    permutation = Permutation.identity(_lancedb_table(config)).select_columns(["image", "label"])
    collate: Any
    if config.data.get("decode", "peer") == "lance_hpc":
        permutation, collate = permutation.with_format("arrow"), ArrowBatchDecode(config.image_size)
    else:
        collate = PilCollate(config.image_size)
    return DataLoader(
        cast(Any, permutation),
        batch_size=config.batch_size,
        shuffle=True,
        num_workers=config.num_workers,
        collate_fn=collate,
        multiprocessing_context="spawn" if config.num_workers else None,
        persistent_workers=config.num_workers > 0,
        pin_memory=torch.cuda.is_available(),
        generator=torch.Generator().manual_seed(0),
    )


def mosaic_streaming(config: Measurement) -> Iterable[Any]:
    """MosaicML streaming: MDS shards read by its StreamingDataset (shuffled; from s3:// through its
    own boto3 client into a local cache) under torch's DataLoader. Decoded by MDS's ``jpeg`` type to
    a PIL image, then torchvision transforms; or its ``bytes`` copy through lance_hpc's decode."""
    import os

    import torch
    from streaming import StreamingDataset
    from streaming.base.util import clean_stale_shared_memory
    from torch.utils.data import DataLoader

    clean_stale_shared_memory()  # a measurement killed mid-run leaves MDS's shared memory behind
    uri = config.data["uri"]
    if uri.startswith("s3://"):
        options = config.data["storage_options"]
        os.environ.update(
            {
                "S3_ENDPOINT_URL": options["endpoint"],
                "AWS_ACCESS_KEY_ID": options["access_key_id"],
                "AWS_SECRET_ACCESS_KEY": options["secret_access_key"],
                "AWS_DEFAULT_REGION": options.get("region", "us-east-1"),
            }
        )
        locations = {"remote": uri, "local": fresh_directory(config.data["cache_dir"])}
    else:
        locations = {"local": uri}
    dataset = StreamingDataset(**locations, shuffle=True, shuffle_seed=0, batch_size=config.batch_size)
    if "remote" in locations:
        # This process fetched index.json through each stream's boto3 client, which keeps the
        # connection open; forked workers would inherit that one socket and read each other's
        # answers off it (shards cached with another shard's bytes in them). Dropped here, so each
        # worker opens its own.
        for stream in dataset.streams:
            stream._downloader.clean_up()
    function = SampleImage(_peer_image_function(config, PilDecode))
    return DataLoader(
        MappedIterable(dataset, function),
        batch_size=config.batch_size,
        num_workers=config.num_workers,
        pin_memory=torch.cuda.is_available(),
        persistent_workers=config.num_workers > 0,
    )


class RawJpegSerializer:
    """Stands in for LitData's ``jpeg`` serializer at read time (LitData looks serializers up by the
    name in its index and calls these methods): hands over the stored bytes undecoded."""

    def serialize(self, item: Any) -> tuple[bytes, None]:
        raise NotImplementedError("read-only: the chunks are written by LitData's own jpeg serializer")

    def deserialize(self, data: bytes) -> bytes:
        return bytes(data)

    def can_serialize(self, item: Any) -> bool:
        return False

    def setup(self, metadata: Any) -> None:
        pass


def litdata_without_obstore(_worker_id: int = 0) -> None:
    """LitData's obstore path sets client options without allow_http, so it refuses the benchmark
    server's plain-http endpoint (a real https store is fine): this process reads through LitData's
    boto3 path instead. Runs in the main process and, as worker_init_fn, in every worker."""
    import litdata.streaming.downloader

    litdata.streaming.downloader._OBSTORE_AVAILABLE = False


def litdata_loader(config: Measurement) -> Iterable[Any]:
    """LitData: optimized chunks read by its StreamingDataset (shuffled; from s3:// through boto3
    with a local chunk cache) under its StreamingDataLoader. Out of the box its jpeg serializer
    decodes with torchvision's decode_jpeg and a torchvision Resize follows; with lance_hpc's decode
    the serializer hands the bytes over undecoded."""
    import torch
    from litdata import StreamingDataLoader, StreamingDataset

    uri, options = config.data["uri"], config.data.get("storage_options") or {}
    extra: dict[str, Any] = {}
    loader_options: dict[str, Any] = {}
    if uri.startswith("s3://"):
        litdata_without_obstore()
        extra["cache_dir"] = fresh_directory(config.data["cache_dir"])
        loader_options["worker_init_fn"] = litdata_without_obstore
        extra["storage_options"] = {
            "endpoint_url": options["endpoint"],
            "aws_access_key_id": options["access_key_id"],
            "aws_secret_access_key": options["secret_access_key"],
            "region_name": options.get("region", "us-east-1"),
        }
    if config.data.get("decode", "peer") == "lance_hpc":
        extra["serializers"] = {"jpeg": RawJpegSerializer()}
    function = SampleImage(_peer_image_function(config, TensorResize))
    dataset = StreamingDataset(uri, shuffle=True, seed=0, transform=function, **extra)
    return StreamingDataLoader(
        dataset,
        batch_size=config.batch_size,
        num_workers=config.num_workers,
        pin_memory=torch.cuda.is_available(),
        **loader_options,
    )


def synthetic(config: Measurement) -> Iterable[Any]:
    """The same batch again and again, already on the training device (the GPU section's baseline)."""
    from benchmarks.gpu import synthetic_batches

    return synthetic_batches(config)


PIPELINES: dict[str, Builder] = {
    "synthetic": synthetic,
    "reference_map": reference_map_style,
    "reference_iterable": reference_iterable,
    "image_folder": image_folder,
    "lance_hpc": lance_hpc_loader,
    "lancedb_streaming": lancedb_streaming,
    "lancedb_permutation": lancedb_permutation,
    "mosaic_streaming": mosaic_streaming,
    "litdata": litdata_loader,
}
# The package each peer loader comes from (pip name, import name): a missing one skips its rows.
PEER_PACKAGES = {
    "lancedb_streaming": ("lancedb", "lancedb"),
    "lancedb_permutation": ("lancedb", "lancedb"),
    "mosaic_streaming": ("mosaicml-streaming", "streaming"),
    "litdata": ("litdata", "litdata"),
}


def import_modules(config: Measurement) -> None:
    """Import what the pipeline needs before the clock starts: a training script has torch,
    torchvision and its data library loaded long before it asks for the first batch."""
    import lance  # noqa: F401
    import torch  # noqa: F401
    import torchvision  # noqa: F401

    if config.kind == "lance_hpc":
        import lance_hpc.loading  # noqa: F401
    elif config.kind in PEER_PACKAGES:
        import importlib

        importlib.import_module(PEER_PACKAGES[config.kind][1])
        import lance_hpc.tasks.image_decode  # noqa: F401
    else:
        import lance.torch.data  # noqa: F401


def build_pipeline(config: Measurement) -> Iterable[Any]:
    """The pipeline named by ``config.kind``; an unknown name lists the valid ones."""
    try:
        builder = PIPELINES[config.kind]
    except KeyError:
        raise ValueError(f"unknown pipeline {config.kind!r}: valid names are {', '.join(sorted(PIPELINES))}") from None
    return builder(config)
