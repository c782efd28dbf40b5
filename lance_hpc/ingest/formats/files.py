"""What the built-in formats share: a source as files, local or on an object store (``s3://...``),
matched by a glob, each shard one file, one part of a file, or a run of files, remembered as it was
listed so that a read needs only the shard's name.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import pyarrow as pa
import pyarrow.fs as pafs

from lance_hpc.errors import UserError
from lance_hpc.ingest.formats.base import ShardFormat
from lance_hpc.ingest.reading import BATCH_BYTES, BATCH_ROWS, TOO_BIG_FIX, Reading
from lance_hpc.storage.options import filesystem_arguments


@dataclass(frozen=True)
class Part:
    """A shard as it was listed: the file (a run of files: the first one), its bytes, the row group
    of a part of a Parquet file, the files of a run (each one a row)."""

    path: str
    bytes: int
    row_group: int | None = None
    files: tuple[str, ...] = ()


class FileFormat(ShardFormat):
    """A format of files: the file system opened from the source, the shards listed into :attr:`parts`."""

    #: the name the source's prefix gives, for messages
    name: str = ""

    def open(self, source: str) -> str:
        """The file system of ``source`` opened; returns its pattern as that file system reads it (a
        local relative path or glob is taken from the working directory)."""
        self.parts: dict[str, Part] = {}
        self.scheme = ""
        if source.startswith("s3://"):
            self.scheme = "s3://"
            self.filesystem: pafs.FileSystem = pafs.S3FileSystem(**filesystem_arguments(self.settings.storage_options))
            self.pattern = source[len("s3://") :]
        else:
            self.filesystem = pafs.LocalFileSystem()
            # pyarrow lists a local directory by its absolute path: ./*.jsonl would match nothing
            self.pattern = os.path.abspath(source)
        return self.pattern

    def uri(self, path: str) -> str:
        return f"{self.scheme}{path}"

    @property
    def base(self) -> str:
        """The directory the glob starts from: a file's key is its path under it."""
        static = self.pattern.split("*", 1)[0].split("?", 1)[0].split("[", 1)[0]
        return static.rsplit("/", 1)[0] if "/" in static else "."

    def key(self, path: str) -> str:
        """A file's key: its path under the source's directory, the same wherever the source is mounted."""
        return path[len(self.base) + 1 :] if self.base != "." else path

    def shard_bytes(self, shard: str) -> int:
        return self.parts[shard].bytes

    def where(self, shard: str) -> str:
        return self.uri(self.parts[shard].path)

    def matched(self) -> list[pafs.FileInfo]:
        """The files the glob matches, sorted, hidden ones left out; an error naming the glob when none."""
        infos = sorted(self._matches(), key=lambda info: info.path)
        if not infos:
            raise UserError(
                f"{self.name}:{self.uri(self.pattern)} matches no file\n"
                "  fix: check the path and the glob (quote it in a shell so the shell does not expand it)"
            )
        return infos

    def _matches(self) -> list[pafs.FileInfo]:
        pattern = self.pattern
        static = pattern.split("*", 1)[0].split("?", 1)[0].split("[", 1)[0]
        base = self.base
        if static == pattern:  # a single file
            info = self.filesystem.get_file_info(pattern)
            return [info] if info.type == pafs.FileType.File else []
        relative = pattern[len(base) + 1 :] if base != "." else pattern
        # only as deep as the pattern reaches: a glob of one directory does not walk a whole bucket
        recursive = "**" in relative or "/" in relative
        matcher = glob_pattern(relative)
        return [
            info
            for info in self.listing(base, recursive)
            if info.type == pafs.FileType.File and matcher.match(self.key(info.path)) and not hidden(self.key(info.path))
        ]

    def listing(self, directory: str, recursive: bool = True) -> list[pafs.FileInfo]:
        """What ``directory`` holds; an error naming it when it cannot be listed."""
        try:
            return self.filesystem.get_file_info(pafs.FileSelector(directory, recursive=recursive, allow_not_found=True))
        except OSError as error:
            raise UserError(f"cannot list {self.uri(directory)}: {error}") from None

    def one_per_file(self, infos: list[pafs.FileInfo]) -> list[str]:
        """One shard per file, named by its path."""
        for info in infos:
            self.parts[info.path] = Part(info.path, info.size or 0)
        return [info.path for info in infos]

    def file_runs(self, infos: list[pafs.FileInfo]) -> list[str]:
        """Consecutive runs of ``files_per_shard`` files, one shard each."""
        per_shard = self.settings.files_per_shard
        for start in range(0, len(infos), per_shard):
            run = infos[start : start + per_shard]
            paths = tuple(info.path for info in run)
            self.parts[f"{self.uri(paths[0])}+{len(paths)}"] = Part(paths[0], sum(info.size or 0 for info in run), files=paths)
        return list(self.parts)

    def run_batches(
        self, shard: str, reading: Reading, field_name: str, record: Callable[[str, bytes], dict[str, Any]]
    ) -> Iterator[pa.RecordBatch]:
        """A run of files, each one record (``record(key, contents)``), in batches bounded in rows and
        bytes; a file over the record limit is never read whole, and one whose contents the read does
        not need is not opened."""
        records: list[dict[str, Any]] = []
        size, limit = 0, self.settings.max_record_bytes
        for path in self.parts[shard].files:
            data = b""
            if reading.wants(field_name):
                with self.filesystem.open_input_stream(path) as handle:
                    data = read_bounded(handle, limit)
                if len(data) > limit:
                    reading.skip("too big", f"{self.uri(path)} is larger than max_record_mb ({limit >> 20} MiB)", TOO_BIG_FIX)
                    continue
            records.append(record(self.key(path), data))
            size += len(data)
            if len(records) >= BATCH_ROWS or size >= BATCH_BYTES:
                yield pa.RecordBatch.from_pylist(records)
                records, size = [], 0
        if records:
            yield pa.RecordBatch.from_pylist(records)


def hidden(name: str) -> bool:
    """Files under a hidden directory or named with a leading dot (an ingest's own records, say)."""
    return any(part.startswith(".") for part in name.split("/"))


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


# The first read of a file; each next one doubles, up to READ_CHUNK. A read of the whole record limit
# at once would allocate it for every small file.
FIRST_READ = 64 << 10
READ_CHUNK = 8 << 20


def read_bounded(handle: Any, limit: int) -> bytes:
    """A file's bytes, or its first ``limit + 1`` when it is larger than ``limit``."""
    parts: list[bytes] = []
    total, chunk = 0, FIRST_READ
    while total <= limit:
        part = handle.read(min(chunk, limit + 1 - total))
        if not part:
            break
        parts.append(part)
        total += len(part)
        chunk = min(chunk * 2, READ_CHUNK)
    return b"".join(parts)


def sliced(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """Batches cut to at most ``BATCH_ROWS`` rows."""
    for batch in batches:
        for start in range(0, batch.num_rows, BATCH_ROWS):
            yield batch.slice(start, BATCH_ROWS)
