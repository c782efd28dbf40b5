"""Opening a dataset where it lives (local or object storage), with errors a user can act on, and
the preflight check before submission; the options come from :mod:`lance_hpc.storage.options`.

Credentials only ever travel inside the options dict handed to Lance (and pickled into DataLoader
workers); they are never printed: every message that could echo an option is redacted first.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Any, Mapping, Protocol
from urllib.parse import urlparse

import pyarrow as pa

from lance_hpc.errors import UserError
from lance_hpc.storage.options import (
    CREDENTIAL_FIX,
    PREFLIGHT_OPTIONS,
    is_remote,
    redact,
)
from lance_hpc.storage.retry import retrying


class Fragment(Protocol):
    """The part of a Lance fragment that lance_hpc reads through."""

    @property
    def fragment_id(self) -> int: ...

    @property
    def metadata(self) -> Any: ...

    def count_rows(self, filter: Any = None) -> int: ...

    def take(self, indices: Any, columns: Any = None) -> pa.Table: ...


class Dataset(Protocol):
    """The part of ``lance.LanceDataset`` that lance_hpc reads through (a version of a dataset)."""

    @property
    def uri(self) -> str: ...

    @property
    def version(self) -> int: ...

    @property
    def latest_version(self) -> int: ...

    @property
    def schema(self) -> pa.Schema: ...

    def count_rows(self, filter: Any = None) -> int: ...

    def get_fragments(self, filter: Any = None) -> list[Any]: ...

    def get_fragment(self, fragment_id: int) -> Any: ...

    def take(self, indices: Any, columns: Any = None) -> pa.Table: ...

    def to_table(self, columns: Any = None) -> pa.Table: ...

    def drop_columns(self, columns: list[str]) -> None: ...


@dataclass
class ReadStats:
    """What reading batches took besides the rows, summed over batches: corrupt rows replaced
    (``on_corrupt: skip``), requests to the store that were retried, and rows read from the
    node-local cache (hits) or, with a cache, from the store (misses)."""

    skipped: int = 0
    retries: int = 0
    cache_hits: int = 0
    cache_misses: int = 0

    def add(self, other: ReadStats) -> None:
        self.skipped += other.skipped
        self.retries += other.retries
        self.cache_hits += other.cache_hits
        self.cache_misses += other.cache_misses


def dataset_error(error: Exception, uri: str, options: Mapping[str, str], version: int | None = None) -> UserError:
    """A UserError saying what is wrong with opening ``uri`` and how to fix it."""
    text = redact(str(error), options)
    endpoint = options.get("endpoint", "the default endpoint")
    bucket = urlparse(uri).netloc
    if any(code in text for code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken", "ExpiredToken")):
        return UserError(f"{uri}: the object store at {endpoint} rejected the credentials ({_code(text)}): {CREDENTIAL_FIX}")
    if "AccessDenied" in text or "403 Forbidden" in text:
        return UserError(f"{uri}: access denied at {endpoint}: the credentials lack permission to read the bucket '{bucket}'")
    if "NoSuchBucket" in text:
        return UserError(f"{uri}: bucket '{bucket}' does not exist at {endpoint}: create it or fix data.uri")
    if "error sending request" in text or "Connection refused" in text or "dns error" in text:
        return UserError(
            f"{uri}: cannot reach the object store at {endpoint}: check data.storage_options.endpoint "
            "(and allow_http for http:// endpoints) and the network"
        )
    if "not found" in text.lower() and version is not None and "version" in text.lower():
        return UserError(f"{uri}: version {version} does not exist: fix data.version or remove it for the latest")
    if "was not found" in text or "Not found" in text or "No such file" in text:
        return UserError(f"{uri}: no Lance dataset there: fix the path, or set data.ingest to create it")
    return UserError(f"{uri}: cannot open the dataset: {text.splitlines()[0] if text else type(error).__name__}")


def _code(text: str) -> str:
    for code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken", "ExpiredToken"):
        if code in text:
            return code
    return "rejected"


def open_dataset(
    uri: str, version: int | None = None, options: Mapping[str, str] | None = None, timeout_s: float | None = None, rank: int = 0
) -> Dataset:
    """``lance.dataset`` with errors turned into UserErrors that say how to fix them. With
    ``timeout_s`` (a rank opening its data: data.io_timeout_s), transient store errors are retried
    and a store that fails or hangs for that long raises StoreUnavailable, as a failing read does."""
    import lance

    options = dict(options or {})

    def attempt() -> Any:
        return lance.dataset(uri, version=version, storage_options=options or None)

    try:
        if timeout_s is None:
            return attempt()
        return retrying(
            attempt, what=f"opening {uri}", uri=uri, options=options, timeout_s=timeout_s, on_retry=lambda: None, rank=rank
        )
    except (OSError, ValueError, RuntimeError) as error:
        raise dataset_error(error, uri, options, version) from None


def dataset_exists(uri: str, options: Mapping[str, str] | None = None) -> bool:
    """Whether a committed Lance dataset is at ``uri`` (other errors are raised as UserErrors)."""
    try:
        open_dataset(uri, None, options)
    except UserError as error:
        if "no Lance dataset there" in str(error):
            return False
        raise
    return True


def check_endpoint(options: Mapping[str, str], timeout_s: float = 5.0) -> None:
    """A quick TCP connect to the configured endpoint, before Lance's slower retries."""
    endpoint = options.get("endpoint")
    if not endpoint:
        return
    parsed = urlparse(endpoint if "://" in endpoint else f"https://{endpoint}")
    port = parsed.port or (80 if parsed.scheme == "http" else 443)
    try:
        with socket.create_connection((parsed.hostname or "", port), timeout=timeout_s):
            pass
    except OSError as error:
        raise UserError(
            f"cannot reach the object store endpoint {endpoint}: {error.strerror or error}. "
            "Check data.storage_options.endpoint and the network from this machine."
        ) from None


def preflight_uri(uri: str, options: Mapping[str, str], version: int | None = None, may_create: bool = False) -> None:
    """Raise a UserError unless ``uri`` opens (or, with ``may_create``, could be created)."""
    if is_remote(uri):
        check_endpoint(options)
    probe = {**PREFLIGHT_OPTIONS, **options} if is_remote(uri) else dict(options)
    try:
        dataset = open_dataset(uri, None, probe)
    except UserError as error:
        if may_create and "no Lance dataset there" in str(error):
            return  # the bucket answered with valid credentials; ingest will create the dataset
        raise
    if version is not None and version > dataset.latest_version:
        raise UserError(f"{uri}: version {version} does not exist (latest is {dataset.latest_version}): fix data.version")
