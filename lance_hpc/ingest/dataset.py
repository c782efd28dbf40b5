"""Ingest: write an image classification dataset, or the token sequences of a text corpus, to Lance.

Schema: ``image`` (encoded bytes, stored as given), ``label`` (int64), and the class names as JSON
in the schema metadata. Rows are written in a seeded random order, so contiguous reads (the
iterable strategies) still see mixed classes.

What is already there is safe: ingest writes only where nothing is (or an empty directory, or on an
object store the files of a Lance create that never committed) or where a Lance dataset is. Anything
else is refused before a row is read, naming what is there; nothing is ever deleted. A Lance dataset
already there is kept, unless asked to overwrite it: then the rows become a new version of it.

Atomic and race-free: a new dataset is one Lance commit that fails when another writer created the
dataset first, and the loser uses the winner's dataset (sweep runs that start together each ingest).
A local dataset is written to a hidden sibling directory and renamed into place, which never replaces
a non-empty directory, so an interrupted write leaves nothing at the path; on an object store the
commit has no retries, since a retried create would land on top of the winner's as its next version.
Validation is written before training, and the training set marks that an ingest finished.
A killed ingest leaves only its hidden directory, which the next ingest of that path names (it is
not deleted: the ingest that made it may still be running on another node). A symlinked local path
is written through: the dataset lands in the directory the link points to.

Sources (``data.ingest.source`` or the first argument of ``lance-hpc ingest``) written here, by one
process: ``sklearn-digits``, ``skimage-photos[:count=N,size=S,seed=K,min_side=A,max_side=B,quality=Q]``
and ``torchvision:<Name>:<root>`` (a torchvision dataset already on disk, opened with
``download=False``: Food101, CIFAR10/100, ...; its official test split becomes the validation set).
Every other source (``imagefolder:``, ``text:``, ``python-stdlib``, ``parquet:``, ``jsonl:``,
``webdataset:``, ``hf:``, or a format of one's own by import path: :mod:`lance_hpc.ingest.formats`)
is split into shards and written by one or many workers: see :mod:`lance_hpc.ingest.plan` and the
modules it names.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import pyarrow as pa

from lance_hpc.errors import UserError
from lance_hpc.ingest import sources
from lance_hpc.ingest.formats import is_shard_source
from lance_hpc.ingest.image_check import ENCODED_BYTES
from lance_hpc.ingest.local import ingest_here
from lance_hpc.ingest.sources import ImageSource
from lance_hpc.ingest.target import (
    COMMAND_LINE_NAMES,
    SPEC_NAMES,
    Ingested,
    Target,
    TargetNames,
    existing_dataset,
    find_datasets,
    keeps,
    targets,
    write_lance,
)
from lance_hpc.storage.datasets import dataset_exists
from lance_hpc.storage.options import storage_options
from lance_hpc.tasks.formats import CLASS_NAMES_KEY

WRITE_CHUNK_ROWS = 256
log = logging.getLogger("lance_hpc.data")


def _parse_options(text: str) -> dict[str, Any]:
    options: dict[str, Any] = {}
    for pair in filter(None, text.split(",")):
        key, sep, value = pair.partition("=")
        if not sep or not value.strip().lstrip("-").isdigit():
            raise UserError(f"source option {pair!r} is not KEY=INTEGER, e.g. skimage-photos:count=8000,size=64")
        options[key.strip()] = int(value)
    return options


def torchvision_items(dataset: Any, name: str) -> ImageSource:
    """ImageSource of a torchvision dataset object: file bytes when it keeps paths, else re-encoded pixels."""
    classes = tuple(str(c) for c in getattr(dataset, "classes", ()))
    if hasattr(dataset, "_image_files") and hasattr(dataset, "_labels"):  # Food101, Flowers102, ...
        paths, labels = list(dataset._image_files), [int(label) for label in dataset._labels]
        read = lambda index: (Path(paths[index]).read_bytes(), labels[index])  # noqa: E731
    elif hasattr(dataset, "samples"):  # ImageFolder / DatasetFolder
        samples = list(dataset.samples)
        read = lambda index: (Path(samples[index][0]).read_bytes(), int(samples[index][1]))  # noqa: E731
    elif hasattr(dataset, "data") and hasattr(dataset, "targets"):  # CIFAR10/100, MNIST, ...
        pixels, targets = np.asarray(dataset.data), [int(t) for t in dataset.targets]
        read = lambda index: (sources.encode_image(pixels[index], "jpeg", 95), targets[index])  # noqa: E731
    else:
        read = lambda index: (sources.encode_image(dataset[index][0], "jpeg", 95), int(dataset[index][1]))  # noqa: E731
    if not classes:
        raise UserError(f"torchvision dataset {name} has no .classes attribute to name the labels")
    return ImageSource(name, classes, len(dataset), read)


def open_torchvision(name: str, root: str) -> tuple[ImageSource, ImageSource | None]:
    """Train and (official) test split of ``torchvision.datasets.<name>`` at ``root``, no download."""
    import inspect

    import torchvision.datasets

    cls = getattr(torchvision.datasets, name, None)
    if not isinstance(cls, type):
        raise UserError(f"torchvision.datasets has no dataset {name!r}: e.g. Food101, CIFAR10, CIFAR100")
    parameters = inspect.signature(cls).parameters
    splits: list[dict[str, Any]]
    if "split" in parameters:
        splits = [{"split": "train"}, {"split": "test"}]
    elif "train" in parameters:
        splits = [{"train": True}, {"train": False}]
    else:
        splits = [{}]
    opened = []
    for arguments in splits:
        if "download" in parameters:
            arguments["download"] = False
        try:
            opened.append(cls(root, **arguments))
        except (RuntimeError, OSError, ValueError) as error:
            raise UserError(
                f"cannot open torchvision {name} at {root} ({error}): put the dataset there first (lance-hpc never downloads it)"
            ) from None
    items = [torchvision_items(dataset, f"torchvision:{name}") for dataset in opened]
    return items[0], (items[1] if len(items) > 1 else None)


def resolve_source(text: str) -> tuple[ImageSource, ImageSource | None]:
    """(train items, official validation items or None) for a source string."""
    kind, _, rest = text.partition(":")
    if kind == "sklearn-digits":
        return sources.sklearn_digits(**_parse_options(rest)), None
    if kind == "skimage-photos":
        options = {"count": 2000, **_parse_options(rest)}
        return sources.skimage_photo_crops(**options), None
    if kind == "torchvision" and ":" in rest:
        name, _, root = rest.partition(":")
        return open_torchvision(name, root)
    raise UserError(
        f"unknown ingest source {text!r}: use sklearn-digits, skimage-photos[:count=N,size=S], imagefolder:<dir> or "
        "torchvision:<Name>:<root> for images; text:<glob> or python-stdlib[:max_mb=N] for text; parquet:, jsonl:, "
        "webdataset: or hf: for any rows; path/to/formats.py:MyFormat:<location> for a format of your own"
    )


def split_rows(count: int, val_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train indices, validation indices), each in a seeded random order."""
    order = np.random.default_rng(seed).permutation(count)
    val_count = int(round(count * val_fraction))
    return order[val_count:], order[:val_count]


def schema_for(class_names: Sequence[str], source: str) -> pa.Schema:
    return pa.schema(
        [pa.field("image", pa.binary(), metadata=ENCODED_BYTES), pa.field("label", pa.int64())],
        metadata={CLASS_NAMES_KEY: json.dumps(list(class_names)).encode(), b"source": source.encode()},
    )


def _batches(items: ImageSource, indices: np.ndarray, schema: pa.Schema, progress: Any) -> Iterator[pa.RecordBatch]:
    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
        for start in range(0, len(indices), WRITE_CHUNK_ROWS):
            chunk = [int(index) for index in indices[start : start + WRITE_CHUNK_ROWS]]
            rows = list(pool.map(items.__getitem__, chunk))
            progress.update(len(rows))
            yield pa.record_batch(
                [pa.array([data for data, _ in rows], pa.binary()), pa.array([label for _, label in rows], pa.int64())],
                schema=schema,
            )


def write_split(
    items: ImageSource, indices: np.ndarray, target: Target, *, rows_per_fragment: int, replace: bool = False
) -> bool:
    """Write ``items[indices]`` to ``target`` as one Lance commit; False when another ingest
    created the dataset first."""
    from lance_hpc.output import progress_bar

    schema = schema_for(items.class_names, items.name)
    with progress_bar(len(indices), f"ingest {target.uri}", unit="img", stream=sys.stderr) as progress:
        reader = pa.RecordBatchReader.from_batches(schema, _batches(items, indices, schema, progress))
        return write_lance(reader, target, rows_per_fragment=rows_per_fragment, replace=replace)


def ingest(
    source: str,
    uri: str,
    val_uri: str | None = None,
    *,
    val_fraction: float = 0.2,
    rows_per_fragment: int = 1024,
    seed: int = 0,
    options: dict[str, str] | None = None,
    val_options: dict[str, str] | None = None,
    overwrite: bool = False,
    names: TargetNames = COMMAND_LINE_NAMES,
) -> Ingested:
    """Write the training (and validation) split of ``source``. A URI holding anything but a Lance
    dataset fails it before a row is read. A training dataset already at ``uri`` means the ingest
    is done, unless ``overwrite``: then both splits are written as new versions."""
    if rows_per_fragment < 1:
        raise UserError("rows_per_fragment must be >= 1")
    train, val = targets(uri, val_uri, options, val_options, names)
    train_found, val_found = find_datasets(train, val)
    if train_found is not None and not overwrite:
        return Ingested(kept=(uri,))
    train_items, official_val = resolve_source(source)
    if official_val is not None:
        train_indices = np.random.default_rng(seed).permutation(len(train_items))
        val_items, val_indices = official_val, np.random.default_rng(seed + 1).permutation(len(official_val))
    else:
        train_indices, val_indices = split_rows(len(train_items), val_fraction if val_uri else 0.0, seed)
        val_items = train_items
    written, kept = {"train": 0, "val": 0}, []
    if val is not None and len(val_indices):
        if keeps(val_found, val, val_items.name, overwrite=overwrite, names=names) or not write_split(
            val_items, val_indices, val, rows_per_fragment=rows_per_fragment, replace=val_found is not None
        ):
            kept.append(val.uri)
        else:
            written["val"] = len(val_indices)
    if write_split(train_items, train_indices, train, rows_per_fragment=rows_per_fragment, replace=train_found is not None):
        written["train"] = len(train_indices)
    else:
        kept.append(train.uri)
    return Ingested(written["train"], written["val"], tuple(kept))


def ensure_dataset(data: Any, *, overwrite: bool = False) -> Ingested:
    """Ingest ``data.ingest.source`` unless a dataset is already at ``data.uri`` (with ``overwrite``,
    even then, as new versions: a job start never asks for that, so a requeued job reads what it
    read before). Call it once per job (rank 0, then a barrier) before ranks open the data."""
    options = storage_options(data.uri, data.storage_options)
    if data.ingest is None:
        if dataset_exists(data.uri, options):
            return Ingested(kept=(data.uri,))
        raise UserError(f"{data.uri}: no Lance dataset there and data.ingest is not set: fix data.uri or add data.ingest")
    spec = data.ingest
    common: dict[str, Any] = dict(
        val_fraction=spec.val_fraction,
        rows_per_fragment=spec.rows_per_fragment,
        seed=spec.seed,
        options=options,
        val_options=storage_options(data.val_uri, data.storage_options) if data.val_uri else None,
        overwrite=overwrite or spec.overwrite,
        names=SPEC_NAMES,
    )
    if not overwrite and existing_dataset(Target(data.uri, options, SPEC_NAMES.train)) is not None:
        return Ingested(kept=(data.uri,))
    if is_shard_source(spec.source):
        train_rows, val_rows = ingest_here(data, overwrite=overwrite)
        return Ingested(train=train_rows, val=val_rows)
    return ingest(spec.source, data.uri, data.val_uri, **common)
