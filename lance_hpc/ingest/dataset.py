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
``webdataset:``, ``hf:``) is split into shards and written by one or many workers: see
:mod:`lance_hpc.ingest.plan` and the modules it names.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import pyarrow as pa

from lance_hpc.errors import ExitCode, UserError
from lance_hpc.ingest import sources
from lance_hpc.ingest.image_check import ENCODED_BYTES
from lance_hpc.ingest.local import ingest_here, ingest_shards_command
from lance_hpc.ingest.shards import is_shard_source
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
from lance_hpc.limits import DEFAULT_RECORD_MB, MAX_PIXELS, MAX_SAMPLE_FIELDS
from lance_hpc.spec import IngestSpec, load_spec
from lance_hpc.spec.problems import option_problems
from lance_hpc.storage.datasets import dataset_exists
from lance_hpc.storage.options import storage_options
from lance_hpc.tasks.formats import CLASS_NAMES_KEY

WRITE_CHUNK_ROWS = 256
# Options that are fields of data.ingest too: held to the same bounds.
BOUNDED_OPTIONS = ("val_fraction", "rows_per_fragment", "sequence_length", "files_per_shard", "max_pixels", "max_record_mb")
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
        "webdataset: or hf: for any rows"
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


def check_options(args: argparse.Namespace) -> None:
    """The command line's numbers held to the bounds of data.ingest's fields of the same names."""
    problems = option_problems(IngestSpec, {name: getattr(args, name) for name in BOUNDED_OPTIONS}, source="-")
    if problems:
        raise UserError("\n".join(problems))


def report(done: Ingested, uri: str, val_uri: str | None, overwrite_fix: str) -> str:
    """What an ingest did, for the command line."""
    lines = []
    if done.train or done.val:
        lines.append(
            f"wrote {done.train:,} training rows to {uri}"
            + (f" and {done.val:,} validation rows to {val_uri}" if done.val else "")
        )
    for kept in done.kept:
        lines.append(f"kept the Lance dataset already at {kept}; to write the source over it as a new version, {overwrite_fix}")
    return "\n".join(lines) or f"nothing to write to {uri}"


def main(argv: Sequence[str] | None = None) -> int:
    """``lance-hpc ingest SOURCE URI`` or ``lance-hpc ingest --spec job.yaml``."""
    parser = argparse.ArgumentParser(prog="lance-hpc ingest", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "source",
        nargs="?",
        help="images: sklearn-digits | skimage-photos[:count=N] | imagefolder:<dir> | torchvision:<Name>:<root>; "
        "text: text:<glob> | python-stdlib[:max_mb=N]; any rows, by many workers: parquet:<glob> | jsonl:<glob> "
        "(.jsonl, .gz, .zst) | webdataset:<glob of .tar> | hf:<dir saved by save_to_disk>, local or s3://",
    )
    parser.add_argument("uri", nargs="?", help="training dataset to create (path or s3://bucket/x.lance)")
    parser.add_argument("--spec", help="job spec: ingest its data.ingest source to data.uri / data.val_uri")
    parser.add_argument("--val-uri", help="validation dataset to create")
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="write the source over Lance datasets already at the URIs, as a new version of each (without it they "
        "are kept); a path holding anything but a Lance dataset is refused either way, and nothing is deleted",
    )
    parser.add_argument(
        "--val-fraction", type=float, default=0.2, help="share of rows (text: of documents) for validation (default 0.2)"
    )
    parser.add_argument("--rows-per-fragment", type=int, default=1024, help="rows per Lance fragment (default 1024)")
    parser.add_argument(
        "--seed", type=int, default=0, help="sklearn-digits, skimage-photos, torchvision: seed of the split and row order"
    )
    parser.add_argument(
        "--storage-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="object-store option (endpoint, region, allow_http); credentials come from AWS_* variables",
    )
    shards = parser.add_argument_group(
        "imagefolder:, text:, python-stdlib, parquet:, jsonl:, webdataset: and hf: sources (written by N workers, one "
        "commit at the end, resumable; the validation split by a hash of each row's key)"
    )
    shards.add_argument("--nproc", type=int, default=1, help="workers on this machine (default 1)")
    shards.add_argument("--files-per-shard", type=int, default=1000, help="imagefolder: and text: files per shard (default 1000)")
    shards.add_argument(
        "--tokenize",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="pack the text into token sequences for a language model (default: yes for text: and python-stdlib, "
        "no for others; --no-tokenize keeps one row per document)",
    )
    shards.add_argument("--sequence-length", type=int, default=256, help="tokens per training sequence (default 256)")
    shards.add_argument(
        "--tokenizer",
        default="bytes",
        help="bytes (UTF-8, the default), hf:<tokenizer.json> (see lance-hpc tokenizer train) or an import path "
        "package.module:factory",
    )
    shards.add_argument(
        "--column",
        action="append",
        default=[],
        metavar="NAME=FIELD",
        help="which source field is image, label, text or key, e.g. --column image=png --column label=class_id "
        "(FIELD empty: the source has none); other fields are kept as columns",
    )
    shards.add_argument("--append", action="store_true", help="add the rows to the Lance dataset at URI as a new version")
    shards.add_argument(
        "--on-corrupt",
        choices=("skip", "fail"),
        default="skip",
        help=f"an unreadable image, or a sample past --max-record-mb or {MAX_SAMPLE_FIELDS} fields: skip and count it "
        "(default), or fail",
    )
    shards.add_argument(
        "--max-pixels", type=int, default=MAX_PIXELS, help=f"larger images are skipped (default and most {MAX_PIXELS:,})"
    )
    shards.add_argument(
        "--max-record-mb",
        type=int,
        default=DEFAULT_RECORD_MB,
        help=f"a tar member or file over this many MiB is skipped, as --on-corrupt says (default {DEFAULT_RECORD_MB})",
    )
    shards.add_argument("--dry-run", action="store_true", help="list the shards and each worker's share; write nothing")
    shards.add_argument("--worker", help=argparse.SUPPRESS)  # RANK/WORLD: one worker process of a local run
    args = parser.parse_args(argv)
    try:
        check_options(args)
        if args.source and is_shard_source(args.source):
            if not args.uri:
                parser.error("give SOURCE and URI")
            return ingest_shards_command(args, list(sys.argv[1:] if argv is None else argv))
        if args.spec:
            data = load_spec(args.spec).spec.data
            if data.ingest is None:
                raise UserError(f"{args.spec}: data.ingest is not set, so there is nothing to ingest")
            done = ensure_dataset(data, overwrite=args.overwrite or data.ingest.overwrite)
            print(report(done, data.uri, data.val_uri, SPEC_NAMES.overwrite))
            print(f"dataset ready at {data.uri}")
            return 0
        if not args.source or not args.uri:
            parser.error("give SOURCE and URI, or --spec job.yaml")
        spec_options = dict(option.split("=", 1) for option in args.storage_option if "=" in option)
        common: dict[str, Any] = dict(
            val_fraction=args.val_fraction,
            rows_per_fragment=args.rows_per_fragment,
            seed=args.seed,
            options=storage_options(args.uri, spec_options),
            val_options=storage_options(args.val_uri, spec_options) if args.val_uri else None,
            overwrite=args.overwrite,
        )
        done = ingest(args.source, args.uri, args.val_uri, **common)
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        return ExitCode.USER_ERROR
    print(report(done, args.uri, args.val_uri, COMMAND_LINE_NAMES.overwrite))
    return 0
