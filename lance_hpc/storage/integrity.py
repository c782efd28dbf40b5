"""A dataset damaged outside Lance: a data file the manifest lists is missing, or its size differs
from what the manifest recorded (truncated by an interrupted copy, overwritten). Lance reports
either as a bare I/O error on whichever read meets it first ("Not found: ...", "Invalid range
0..2796 for object of size 1398 bytes"); :class:`DamagedDataset` names the file and the fix.

One listing of the dataset's ``data/`` directory (local or on the object store) against the
manifest finds every such file; it runs at preflight, and when a read fails with such an error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping
from urllib.parse import urlparse

from lance_hpc.errors import UserError
from lance_hpc.storage.datasets import open_dataset
from lance_hpc.storage.options import filesystem_arguments, is_remote
from lance_hpc.storage.retry import is_damage, short_error

FIX = (
    "the dataset was modified or partly deleted outside Lance: restore the file from a copy of the "
    "dataset, or re-create the dataset (delete it and run with data.ingest set, or write it again)"
)


class DamagedDataset(UserError):
    """A data file of the dataset is missing or has the wrong size; the message names it."""


@dataclass(frozen=True)
class FileProblem:
    path: str  # relative to the dataset root, e.g. data/abc.lance
    expected_bytes: int | None
    found_bytes: int | None  # None: missing

    def describe(self, uri: str) -> str:
        if self.found_bytes is None:
            return f"data file {self.path} of {uri} is missing"
        return (
            f"data file {self.path} of {uri} has {self.found_bytes:,} bytes where the manifest records "
            f"{self.expected_bytes:,} (truncated or overwritten)"
        )


def _filesystem(uri: str, options: Mapping[str, str]) -> tuple[Any, str]:
    """A pyarrow filesystem for ``uri`` and the dataset root's path in it."""
    from pyarrow import fs

    if not is_remote(uri):
        return fs.LocalFileSystem(), uri.removeprefix("file://").rstrip("/")
    parsed = urlparse(uri)
    return fs.S3FileSystem(**filesystem_arguments(options)), f"{parsed.netloc}{parsed.path}".rstrip("/")


def file_problems(dataset: Any, uri: str, options: Mapping[str, str]) -> list[FileProblem]:
    """Data files of ``dataset`` (its manifest) that are missing under ``uri`` or have another
    size than the manifest records. Files on other base paths are not checked."""
    from pyarrow import fs

    filesystem, root = _filesystem(uri, options)
    selector = fs.FileSelector(f"{root}/data", allow_not_found=True, recursive=True)
    found = {info.path[len(root) + 1 :]: info.size for info in filesystem.get_file_info(selector)}
    problems = []
    for fragment in dataset.get_fragments():
        for data_file in fragment.data_files():
            if getattr(data_file, "base_id", None) is not None:
                continue
            path = f"data/{data_file.path}"
            expected = getattr(data_file, "file_size_bytes", None)
            size = found.get(path)
            if size is None or (expected is not None and size != expected):
                problems.append(FileProblem(path, expected, size))
    return problems


def damaged_dataset(problems: list[FileProblem], uri: str, version: int | None) -> DamagedDataset:
    first = problems[0].describe(uri)
    more = f" (and {len(problems) - 1} more data file(s) likewise)" if len(problems) > 1 else ""
    at = f" at version {version}" if version is not None else ""
    return DamagedDataset(f"{first}{more}: the manifest{at} lists it, so {FIX}")


def explain_read_error(error: BaseException, dataset: Any | None, uri: str, options: Mapping[str, str]) -> BaseException:
    """What to raise for a read of ``dataset`` that failed with ``error`` (not a transient one):
    a :class:`DamagedDataset` naming the file when the listing finds one missing or of the wrong
    size; for a missing-file or short-file error without such a file (the store may have lost it
    between the read and the listing), a :class:`DamagedDataset` with the error's own text;
    otherwise ``error`` itself (also when the dataset never opened)."""
    if dataset is None:
        return error
    try:
        problems = file_problems(dataset, uri, options)
    except OSError as listing_error:
        problems, listing = [], f"; listing the data files failed too: {short_error(listing_error, options)}"
    else:
        listing = ""
    if problems:
        return damaged_dataset(problems, uri, getattr(dataset, "version", None))
    if is_damage(error):
        return DamagedDataset(
            f"reading {uri} failed: {short_error(error, options)}{listing}; if a data file is missing or cut short, {FIX}"
        )
    return error


def check_data_files(uri: str, options: Mapping[str, str], version: int | None = None) -> None:
    """Raise a :class:`DamagedDataset` if a data file of the dataset at ``uri`` is missing or
    has the wrong size (no dataset there: nothing to check)."""
    try:
        dataset = open_dataset(uri, version, options)
    except UserError as error:
        if "no Lance dataset there" in str(error):
            return
        raise
    problems = file_problems(dataset, uri, options)
    if problems:
        raise damaged_dataset(problems, uri, dataset.version)
