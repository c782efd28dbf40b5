"""Sources as shards: the unit of work of an ingest job.

A source names files: ``parquet:<glob>``, ``jsonl:<glob>`` (``.jsonl``, ``.jsonl.gz``, ``.jsonl.zst``),
``webdataset:<glob of .tar>`` (LAION/DataComp style: the files of one sample share a key, e.g.
``0001.jpg``, ``0001.cls``, ``0001.json``), ``hf:<dir>`` (one split of a Hugging Face dataset saved
with ``save_to_disk``), ``imagefolder:<dir>`` (one sub-directory per class, each file one image) or
``text:<glob>`` (each file one document; ``python-stdlib[:max_mb=N]`` is this interpreter's standard
library), each local or on an object store (``s3://...``). A shard is one file (an Arrow file of a
Hugging Face dataset), one row group of a Parquet file with several, or a run of
``files_per_shard`` files of an image folder or a text corpus, listed in a stable order. Reading a
shard as batches of the dataset's columns is :mod:`lance_hpc.ingest.shard_batches`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sysconfig
from dataclasses import dataclass, field
from typing import Any, Mapping

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from lance_hpc.errors import UserError
from lance_hpc.limits import DEFAULT_RECORD_MB
from lance_hpc.spec.choices import SHARD_FORMATS, STDLIB_SOURCE, check_registry
from lance_hpc.storage.options import filesystem_arguments

FORMATS = ("parquet", "jsonl", "webdataset", "hf", "imagefolder", "text")
check_registry(FORMATS, SHARD_FORMATS, "data.ingest.source formats")
# Formats whose shards are runs of small files (one row each) rather than one file each.
FILE_RUN_FORMATS = ("imagefolder", "text")
FILES_PER_SHARD = 1000
# Extensions of a WebDataset sample's image file, in the order one is picked when a sample has several.
IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp", "bmp", "tif", "tiff")


@dataclass(frozen=True)
class Shard:
    """One unit of ingest work: a file, or one row group of a Parquet file."""

    id: str  # stable and unique within the source: the path, with #row-group for a part of a Parquet file
    path: str  # as the file system reads it (no scheme); a run of files: the first one
    format: str
    bytes: int
    row_group: int | None = None
    files: tuple[str, ...] = ()  # a run of files: each one a row (an image, a document)


@dataclass
class Source:
    """A parsed source: its format, the file system, and the files its glob matches."""

    format: str
    pattern: str
    filesystem: pafs.FileSystem = field(repr=False)
    scheme: str = ""  # "s3://" for an object store, "" locally
    files_per_shard: int = FILES_PER_SHARD
    max_bytes: int | None = None  # python-stdlib: whole files while their total stays within this
    classes: tuple[str, ...] = ()  # an image folder's class directories, sorted, once listed
    max_record_bytes: int = DEFAULT_RECORD_MB << 20  # a larger member or file is skipped, or fails the read

    def uri(self, path: str) -> str:
        return f"{self.scheme}{path}"

    @property
    def base(self) -> str:
        """The directory the glob starts from: a file's key is its path under it."""
        if self.format == "imagefolder":
            return self.pattern.rstrip("/")
        static = self.pattern.split("*", 1)[0].split("?", 1)[0].split("[", 1)[0]
        if static == self.pattern:  # one file, or python-stdlib's directory
            return static.rstrip("/") if self.max_bytes is not None else static.rsplit("/", 1)[0] if "/" in static else "."
        return static.rsplit("/", 1)[0] if "/" in static else "."


# Hash buckets of the validation split: a row is validation when its key's bucket is below the fraction's share.
SPLIT_BUCKETS = 1_000_000


def split_of(key: str, val_fraction: float) -> str:
    """``val`` or ``train`` for a row's key: the same whatever the number of workers or the order."""
    digest = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")
    return "val" if digest % SPLIT_BUCKETS < val_fraction * SPLIT_BUCKETS else "train"


def is_shard_source(text: str) -> bool:
    return (text.split(":", 1)[0] in FORMATS and ":" in text) or text.partition(":")[0] == STDLIB


STDLIB = STDLIB_SOURCE
STDLIB_MAX_MB = 8.0
# Tests and their data (some deliberately invalid Python), the IDE, the deprecated lib2to3, demos and
# installed packages: not the library's own code.
STDLIB_SKIPPED_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idle_test", "idlelib", "lib2to3", "turtledemo", "__pycache__"}
)


def parse_source(
    text: str,
    options: Mapping[str, str] | None = None,
    *,
    files_per_shard: int = FILES_PER_SHARD,
    max_record_bytes: int = DEFAULT_RECORD_MB << 20,
) -> Source:
    """A source string parsed; a local relative path or glob is taken from the working directory."""
    kind, _, pattern = text.partition(":")
    if kind == STDLIB:
        directory = sysconfig.get_paths()["stdlib"]
        max_bytes = int(_max_mb(pattern) * 1_000_000)
        return Source("text", directory, pafs.LocalFileSystem(), "", files_per_shard, max_bytes, (), max_record_bytes)
    if kind not in FORMATS or not pattern:
        raise UserError(f"source {text!r}: give {' | '.join(f'{name}:<glob>' for name in FORMATS)} | {STDLIB}[:max_mb=N]")
    if files_per_shard < 1:
        raise UserError(f"files_per_shard {files_per_shard}: give 1 or more")
    if pattern.startswith("s3://"):
        filesystem = pafs.S3FileSystem(**filesystem_arguments(options or {}))
        return Source(kind, pattern[len("s3://") :], filesystem, "s3://", files_per_shard, None, (), max_record_bytes)
    # pyarrow lists a local directory by its absolute path: ./*.jsonl would match nothing
    pattern = os.path.abspath(pattern)
    return Source(kind, pattern, pafs.LocalFileSystem(), "", files_per_shard, None, (), max_record_bytes)


def _max_mb(options: str) -> float:
    if not options:
        return STDLIB_MAX_MB
    key, _, value = options.partition("=")
    try:
        max_mb = float(value) if key.strip() == "max_mb" else 0.0
    except ValueError:
        max_mb = 0.0
    if not max_mb > 0:
        raise UserError(f"{STDLIB} option {options!r}: the only option is max_mb=N (N > 0), e.g. {STDLIB}:max_mb=8")
    return max_mb


def glob_pattern(pattern: str) -> re.Pattern[str]:
    """A glob as a regular expression over ``/``-separated paths: ``*`` and ``?`` stay within one
    path component, ``**`` spans any number of them, ``[...]`` is a character class."""
    out, index = [], 0
    while index < len(pattern):
        char = pattern[index]
        if pattern.startswith("**/", index):
            out.append("(?:.*/)?")
            index += 3
            continue
        if pattern.startswith("**", index):
            out.append(".*")
            index += 2
            continue
        if char == "*":
            out.append("[^/]*")
        elif char == "?":
            out.append("[^/]")
        elif char == "[" and "]" in pattern[index + 1 :]:
            end = pattern.index("]", index + 1)
            body = pattern[index + 1 : end]
            out.append("[" + ("^" + body[1:] if body.startswith("!") else body) + "]")
            index = end
        else:
            out.append(re.escape(char))
        index += 1
    return re.compile("".join(out) + r"\Z")


def _matches(source: Source) -> list[pafs.FileInfo]:
    pattern = source.pattern
    static = pattern.split("*", 1)[0].split("?", 1)[0].split("[", 1)[0]
    base = static.rsplit("/", 1)[0] if "/" in static else "."
    if static == pattern:  # a single file
        info = source.filesystem.get_file_info(pattern)
        return [info] if info.type == pafs.FileType.File else []
    relative = pattern[len(base) + 1 :] if base != "." else pattern
    # only as deep as the pattern reaches: a glob of one directory does not walk a whole bucket
    recursive = "**" in relative or "/" in relative
    try:
        infos = source.filesystem.get_file_info(pafs.FileSelector(base, recursive=recursive, allow_not_found=True))
    except OSError as error:
        raise UserError(f"cannot list {source.uri(base)}: {error}") from None
    matcher = glob_pattern(relative)
    found = []
    for info in infos:
        name = info.path[len(base) + 1 :] if base != "." else info.path
        if info.type == pafs.FileType.File and matcher.match(name) and not _hidden(name):
            found.append(info)
    return found


def _hidden(name: str) -> bool:
    """Files under a hidden directory or named with a leading dot (an ingest's own records, say)."""
    return any(part.startswith(".") for part in name.split("/"))


def _read_json(source: Source, path: str) -> Any:
    try:
        with source.filesystem.open_input_stream(path) as handle:
            return json.loads(handle.read())
    except FileNotFoundError:
        return None


def _hf_shards(source: Source) -> list[Shard]:
    """The Arrow files of a Hugging Face dataset saved with ``save_to_disk``, in its own order."""
    directory = source.pattern.rstrip("/")
    splits = _read_json(source, f"{directory}/dataset_dict.json")
    if splits is not None:
        names = ", ".join(splits.get("splits", []))
        raise UserError(
            f"hf:{source.uri(directory)} holds several splits ({names}): name one, e.g. hf:{source.uri(directory)}/"
            f"{(splits.get('splits') or ['train'])[0]}"
        )
    state = _read_json(source, f"{directory}/state.json")
    if state is None or not state.get("_data_files"):
        raise UserError(
            f"hf:{source.uri(directory)} is not a Hugging Face dataset saved with save_to_disk (no state.json listing "
            "its data files)\n  fix: point hf: at the directory save_to_disk wrote (one split)"
        )
    shards = []
    for entry in state["_data_files"]:
        path = f"{directory}/{entry['filename']}"
        size = source.filesystem.get_file_info(path).size or 0
        shards.append(Shard(path, path, "hf", size))
    return shards


def class_names(source: Source, field_name: str) -> list[str] | None:
    """The class names of the label: an image folder's class directories, or the names of a
    ``ClassLabel`` field of a saved Hugging Face dataset."""
    if source.format == "imagefolder":
        return list(source.classes) or None
    if source.format != "hf":
        return None
    info = _read_json(source, f"{source.pattern.rstrip('/')}/dataset_info.json") or {}
    feature = (info.get("features") or {}).get(field_name) or {}
    names = feature.get("names") if feature.get("_type") == "ClassLabel" else None
    return [str(name) for name in names] if names else None


def _stdlib_files(source: Source) -> list[pafs.FileInfo]:
    """The ``.py`` files of this interpreter's standard library, sorted, whole files while their
    total stays within the source's ``max_bytes``."""
    assert source.max_bytes is not None
    infos = source.filesystem.get_file_info(pafs.FileSelector(source.base, recursive=True))
    found = [
        info
        for info in infos
        if info.type == pafs.FileType.File
        and info.path.endswith(".py")
        and not STDLIB_SKIPPED_DIRS & set(info.path[len(source.base) + 1 :].split("/")[:-1])
    ]
    taken, total = [], 0
    for info in sorted(found, key=lambda item: item.path):
        total += info.size or 0
        if total > source.max_bytes:
            break
        taken.append(info)
    return taken


def file_key(source: Source, path: str) -> str:
    """A file's key: its path under the source's directory, the same wherever the source is mounted."""
    return path[len(source.base) + 1 :] if source.base != "." else path


def _image_folder_files(source: Source) -> list[pafs.FileInfo]:
    """An image folder's images (``<dir>/<class>/.../<file>``), the class directories noted on the
    source, in an order mixed by a hash of each file's key so that classes are mixed in every
    shard and fragment (contiguous reads see every class), the same order on every run."""
    try:
        infos = source.filesystem.get_file_info(pafs.FileSelector(source.base, recursive=True, allow_not_found=True))
    except OSError as error:
        raise UserError(f"cannot list {source.uri(source.base)}: {error}") from None
    images = [
        info
        for info in infos
        if info.type == pafs.FileType.File
        and "/" in file_key(source, info.path)
        and not _hidden(file_key(source, info.path))
        and info.path.rpartition(".")[2].lower() in IMAGE_EXTENSIONS
    ]
    if not images:
        raise UserError(
            f"imagefolder:{source.uri(source.base)} has no images in class sub-directories (e.g. "
            f"{source.uri(source.base)}/cat/1.jpg)\n  fix: point it at the folder that holds one directory per class"
        )
    source.classes = tuple(sorted({file_key(source, info.path).split("/", 1)[0] for info in images}))
    return sorted(
        images, key=lambda info: (hashlib.blake2b(file_key(source, info.path).encode(), digest_size=8).digest(), info.path)
    )


def _file_runs(source: Source, infos: list[pafs.FileInfo]) -> list[Shard]:
    """Consecutive runs of ``files_per_shard`` files, one shard each."""
    shards = []
    for start in range(0, len(infos), source.files_per_shard):
        run = infos[start : start + source.files_per_shard]
        paths = tuple(info.path for info in run)
        shard_id = f"{source.uri(paths[0])}+{len(paths)}"
        shards.append(Shard(shard_id, paths[0], source.format, sum(info.size or 0 for info in run), files=paths))
    return shards


def list_shards(source: Source) -> list[Shard]:
    """The source's shards in a stable order (sorted paths; a Parquet file's row groups in order;
    runs of files of an image folder or a text corpus)."""
    if source.format == "hf":
        return _hf_shards(source)
    if source.format == "imagefolder":
        return _file_runs(source, _image_folder_files(source))
    if source.max_bytes is not None:
        return _file_runs(source, _stdlib_files(source))
    infos = sorted(_matches(source), key=lambda info: info.path)
    if source.format == "text":
        infos = [info for info in infos if not _hidden(file_key(source, info.path))]
    if not infos:
        raise UserError(
            f"{source.format}:{source.uri(source.pattern)} matches no file\n"
            "  fix: check the path and the glob (quote it in a shell so the shell does not expand it)"
        )
    shards: list[Shard] = []
    if source.format == "text":
        return _file_runs(source, infos)
    for info in infos:
        if source.format == "parquet":
            try:
                with source.filesystem.open_input_file(info.path) as handle:
                    groups = pq.ParquetFile(handle).metadata.num_row_groups
            except (pa.ArrowInvalid, OSError) as error:
                raise UserError(f"{source.uri(info.path)} is not a Parquet file, or is damaged: {error}") from None
            if groups > 1:
                share = info.size // groups
                shards += [Shard(f"{info.path}#{group}", info.path, "parquet", share, group) for group in range(groups)]
                continue
        shards.append(Shard(info.path, info.path, source.format, info.size))
    return shards
