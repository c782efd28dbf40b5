"""A fast S3-compatible server for the benchmark: one local directory served as one bucket.

moto answers the S3 protocol faithfully but spends milliseconds of CPU per request, so a loader
reading through it measures moto. This server answers what Lance's object store client sends
(GET with a Range, HEAD, ListObjectsV2, PUT, DELETE, CopyObject, multipart upload) from the files
under ``root``, accepts any signature, and holds every answer back by a first-byte latency that
models S3 or Tigris. The wait is an asyncio sleep: it costs no CPU and no thread, so hundreds of
requests can wait at once. It runs as its own process, so its CPU is counted apart from the
loader's, and it counts what a store would bill.

Library use::

    server = start_server(root, latency_ms=25)   # a subprocess on a free loopback port
    uri = f"s3://{server.bucket}/photos/train.lance"   # root/photos/train.lance
    dataset = lance.dataset(uri, storage_options=server.storage_options())
    server.counters()        # {"requests", "gets", "get_bytes", "heads", "lists", "puts",
                             #  "put_bytes", "deletes", "errors", "max_in_flight", "cpu_s"}
    server.reset_counters()
    server.cpu_seconds()     # the server process's user + system CPU time
    server.stop()            # or: with start_server(root) as server: ...

From a shell: ``python -m benchmarks.s3_server ROOT --port 9000 --latency-ms 25``.

Counters are read and reset over HTTP (``GET /_bench/counters``, ``POST /_bench/reset``), so a
measurement process that only knows the endpoint can read them too (:func:`read_counters`,
:class:`CounterWindow`); ``_bench`` is not a valid bucket name, so no object can hide them.
A ranged GET of 34 KB costs the server about 0.07 ms of CPU: half in its Python (the header lines
of each object are formatted once), most of the rest in the kernel's loopback send, which any
server on the same machine would pay.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from email.utils import formatdate
from pathlib import Path
from typing import Iterator
from urllib.parse import parse_qs, unquote, urlsplit
from xml.sax.saxutils import escape

from lance_hpc.bench.resources import _proc_usage

BUCKET = "bench"
CONTROL_PREFIX = "/_bench/"
# Files this server writes while a PUT or an upload is under way; never listed.
STAGING_PREFIX = ".s3-bench-"
# Bodies are sent in pieces of this size, so a GET of a whole large file needs little memory.
SEND_CHUNK = 1 << 20
LIST_MAX_KEYS = 1000
READY_PATTERN = re.compile(r"serving .* at (http://\S+)")
COUNTER_NAMES = ("requests", "gets", "get_bytes", "heads", "lists", "puts", "put_bytes", "deletes", "errors")
S3_NAMESPACE = "http://s3.amazonaws.com/doc/2006-03-01/"
REASONS = {
    200: "OK",
    204: "No Content",
    206: "Partial Content",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    411: "Length Required",
    412: "Precondition Failed",
    416: "Range Not Satisfiable",
    500: "Internal Server Error",
}


class S3Error(Exception):
    """An S3 error answer: HTTP status, S3 error code, message."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


def parse_range(header: str, size: int) -> tuple[int, int]:
    """``bytes=a-b``, ``bytes=a-`` or ``bytes=-n`` as a half-open (start, end) within ``size``."""
    match = re.fullmatch(r"bytes=(\d*)-(\d*)", header.strip())
    if not match or match.groups() == ("", ""):
        raise S3Error(416, "InvalidRange", f"unsupported range {header!r} (one range only)")
    first, last = match.groups()
    if first == "":
        start, end = max(0, size - int(last)), size
    else:
        start, end = int(first), size if last == "" else min(size, int(last) + 1)
    if start >= size or end <= start:
        raise S3Error(416, "InvalidRange", f"range {header!r} outside an object of {size} bytes")
    return start, end


class Store:
    """The bucket's objects as files under ``root``; open files are kept for the next range."""

    def __init__(self, root: Path) -> None:
        self.root = root.resolve()
        self.uploads = Path(tempfile.mkdtemp(prefix="s3-bench-uploads-"))
        self._descriptors: dict[str, int] = {}  # by key: resolving a path costs a stat per component
        self._fields: dict[str, tuple[tuple[int, int], bytes]] = {}  # by key: (size, mtime) and header lines

    def path(self, key: str) -> Path:
        path = (self.root / key).resolve()
        if path != self.root and self.root not in path.parents:
            raise S3Error(400, "InvalidArgument", f"key {key!r} leaves the bucket")
        return path

    def descriptor(self, key: str) -> tuple[int, os.stat_result]:
        fd = self._descriptors.get(key)
        if fd is None:
            try:
                fd = os.open(self.path(key), os.O_RDONLY)
            except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
                raise S3Error(404, "NoSuchKey", f"no object {key!r}") from None
            self._descriptors[key] = fd
        return fd, os.fstat(fd)

    def object_fields(self, key: str, stat: os.stat_result) -> bytes:
        """The header lines every answer about the object carries, formatted once per version of it."""
        version = (stat.st_size, stat.st_mtime_ns)
        kept = self._fields.get(key)
        if kept is None or kept[0] != version:
            lines = (
                f"ETag: {etag(stat)}\r\nLast-Modified: {formatdate(stat.st_mtime, usegmt=True)}\r\n"
                "Accept-Ranges: bytes\r\nContent-Type: application/octet-stream\r\n"
            )
            kept = self._fields[key] = (version, lines.encode("latin-1"))
        return kept[1]

    def forget(self) -> None:
        """Closes every kept descriptor: a file changed, under whichever spelling of its key."""
        for fd in self._descriptors.values():
            os.close(fd)
        self._descriptors.clear()

    def write(self, key: str, body: bytes | Path, if_none_match: bool = False) -> os.stat_result:
        """Replaces ``key`` at once (a reader sees the old or the new object, never a part)."""
        path = self.path(key)
        if if_none_match and path.is_file():
            raise S3Error(412, "PreconditionFailed", f"{key!r} exists and the request said If-None-Match: *")
        path.parent.mkdir(parents=True, exist_ok=True)
        staging = path.with_name(f"{STAGING_PREFIX}{uuid.uuid4().hex}")
        if isinstance(body, Path):
            shutil.copyfile(body, staging)
        else:
            staging.write_bytes(body)
        os.replace(staging, path)
        self.forget()
        return path.stat()

    def delete(self, key: str) -> None:
        self.path(key).unlink(missing_ok=True)  # S3 answers 204 for a missing key too
        self.forget()

    def keys(self, prefix: str) -> Iterator[tuple[str, os.stat_result]]:
        """Every object whose key starts with ``prefix``, in no particular order."""
        directory = self.root / prefix.rpartition("/")[0]
        for dirpath, _, files in os.walk(directory):
            base = Path(dirpath).relative_to(self.root).as_posix()
            for name in files:
                key = name if base == "." else f"{base}/{name}"
                if key.startswith(prefix) and not name.startswith(STAGING_PREFIX):
                    yield key, os.stat(os.path.join(dirpath, name))


def etag(stat: os.stat_result) -> str:
    return f'"{stat.st_size:x}-{stat.st_mtime_ns:x}"'


def iso_time(stat: os.stat_result) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime(stat.st_mtime))


def list_objects(store: Store, bucket: str, query: dict[str, str]) -> bytes:
    """The ListObjectsV2 answer: keys after the continuation token, folded at the delimiter."""
    prefix, delimiter = query.get("prefix", ""), query.get("delimiter", "")
    max_keys = min(int(query.get("max-keys", LIST_MAX_KEYS)), LIST_MAX_KEYS)
    after = query.get("continuation-token") or query.get("start-after", "")
    entries: dict[str, os.stat_result | None] = {}  # key, or common prefix (None)
    for key, stat in store.keys(prefix):
        cut = key.find(delimiter, len(prefix)) if delimiter else -1
        if cut >= 0:
            entries[key[: cut + len(delimiter)]] = None
        else:
            entries[key] = stat
    names = sorted(name for name in entries if name > after)
    page, truncated = names[:max_keys], len(names) > max_keys
    parts = [
        f'<?xml version="1.0" encoding="UTF-8"?><ListBucketResult xmlns="{S3_NAMESPACE}">',
        f"<Name>{escape(bucket)}</Name><Prefix>{escape(prefix)}</Prefix><KeyCount>{len(page)}</KeyCount>",
        f"<MaxKeys>{max_keys}</MaxKeys><IsTruncated>{'true' if truncated else 'false'}</IsTruncated>",
    ]
    if delimiter:
        parts.append(f"<Delimiter>{escape(delimiter)}</Delimiter>")
    if truncated:
        parts.append(f"<NextContinuationToken>{escape(page[-1])}</NextContinuationToken>")
    for name in page:
        entry = entries[name]
        if entry is None:
            parts.append(f"<CommonPrefixes><Prefix>{escape(name)}</Prefix></CommonPrefixes>")
        else:
            parts.append(
                f"<Contents><Key>{escape(name)}</Key><LastModified>{iso_time(entry)}</LastModified>"
                f"<ETag>{escape(etag(entry))}</ETag><Size>{entry.st_size}</Size>"
                "<StorageClass>STANDARD</StorageClass></Contents>"
            )
    parts.append("</ListBucketResult>")
    return "".join(parts).encode()


class Server:
    """The asyncio server: one coroutine per connection, keep-alive, one request at a time each."""

    def __init__(self, root: Path, bucket: str = BUCKET, latency_ms: float = 0.0, request_log: Path | None = None) -> None:
        self.store = Store(root)
        self.bucket = bucket
        self.latency_s = latency_ms / 1000
        self.in_flight = 0
        # One line per request answered: arrival and end (Unix time), method, key, body bytes sent.
        self.request_log = open(request_log, "a") if request_log else None  # noqa: SIM115 (closed by serve)
        self.reset()

    def reset(self) -> None:
        self.counts = dict.fromkeys(COUNTER_NAMES, 0)
        self.max_in_flight = 0

    def counters(self) -> dict[str, float]:
        return {**self.counts, "max_in_flight": self.max_in_flight, "cpu_s": time.process_time()}

    async def connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                request_line, *header_lines = head.decode("latin-1").split("\r\n")
                method, target, _ = request_line.split(" ", 2)
                headers = {}
                for line in header_lines:
                    name, _, value = line.partition(":")
                    if name:
                        headers[name.strip().lower()] = value.strip()
                length = int(headers.get("content-length", 0) or 0)
                body = await reader.readexactly(length) if length else b""
                await self.answer(method, target, headers, body, writer)
                if headers.get("connection", "").lower() == "close":
                    return
        except (ConnectionError, asyncio.IncompleteReadError):
            return
        except asyncio.CancelledError:  # the server stopping with this connection idle: nothing to report
            return
        finally:
            writer.close()

    async def answer(self, method: str, target: str, headers: dict[str, str], body: bytes, writer: asyncio.StreamWriter) -> None:
        url = urlsplit(target)
        if url.path.startswith(CONTROL_PREFIX):
            await self.control(method, url.path[len(CONTROL_PREFIX) :], writer)
            return
        self.counts["requests"] += 1
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        arrived, sent = time.time(), 0
        try:
            if self.latency_s:
                await asyncio.sleep(self.latency_s)  # first-byte latency: waits without a thread or CPU
            query = {name: values[0] for name, values in parse_qs(url.query, keep_blank_values=True).items()} if url.query else {}
            bucket, _, key = unquote(url.path).lstrip("/").partition("/")
            try:
                if bucket != self.bucket:
                    raise S3Error(404, "NoSuchBucket", f"this server has one bucket, {self.bucket!r}")
                sent = await self.object_request(method, key, query, headers, body, writer)
            except S3Error as error:
                self.counts["errors"] += 1
                xml = (
                    f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{error.code}</Code>'
                    f"<Message>{escape(error.message)}</Message></Error>"
                ).encode()
                send(writer, error.status, {"Content-Type": "application/xml"}, b"" if method == "HEAD" else xml, len(xml))
            await writer.drain()
        finally:
            self.in_flight -= 1
            if self.request_log is not None:
                self.request_log.write(f"{arrived:.4f}\t{time.time():.4f}\t{method}\t{url.path}\t{sent}\n")

    async def object_request(
        self, method: str, key: str, query: dict[str, str], headers: dict[str, str], body: bytes, writer: asyncio.StreamWriter
    ) -> int:
        """Answers one request on an object or the bucket; returns the object bytes a GET sent."""
        if method in ("GET", "HEAD") and not key:
            if "list-type" not in query and method == "GET":
                raise S3Error(400, "NotImplemented", "only ListObjectsV2 (list-type=2) is served")
            self.counts["lists"] += 1
            listing = list_objects(self.store, self.bucket, query)
            send(writer, 200, {"Content-Type": "application/xml"}, listing if method == "GET" else b"", len(listing))
        elif method in ("GET", "HEAD"):
            return await self.read(method, key, headers, writer)
        elif method == "PUT" and "uploadId" in query:
            self.counts["puts"] += 1
            self.counts["put_bytes"] += len(body)
            part = self.upload_dir(query["uploadId"]) / f"{int(query['partNumber']):05d}"
            part.write_bytes(body)
            send(writer, 200, {"ETag": f'"{part.name}"'}, b"")
        elif method == "PUT":
            self.counts["puts"] += 1
            source = headers.get("x-amz-copy-source")
            if source:
                _, _, source_key = unquote(source).lstrip("/").partition("/")
                stat = self.store.write(key, self.store.path(source_key), headers.get("if-none-match") == "*")
                copied = (
                    f"<CopyObjectResult><LastModified>{iso_time(stat)}</LastModified>"
                    f"<ETag>{escape(etag(stat))}</ETag></CopyObjectResult>"
                ).encode()
                send(writer, 200, {"Content-Type": "application/xml"}, copied)
            else:
                self.counts["put_bytes"] += len(body)
                stat = self.store.write(key, body, headers.get("if-none-match") == "*")
                send(writer, 200, {"ETag": etag(stat)}, b"")
        elif method == "POST" and "uploads" in query:
            upload_id = uuid.uuid4().hex
            self.upload_dir(upload_id, create=True)
            xml = (
                f'<InitiateMultipartUploadResult xmlns="{S3_NAMESPACE}"><Bucket>{self.bucket}</Bucket>'
                f"<Key>{escape(key)}</Key><UploadId>{upload_id}</UploadId></InitiateMultipartUploadResult>"
            )
            send(writer, 200, {"Content-Type": "application/xml"}, xml.encode())
        elif method == "POST" and "uploadId" in query:
            stat = self.complete_upload(key, query["uploadId"], headers.get("if-none-match") == "*")
            xml = (
                f'<CompleteMultipartUploadResult xmlns="{S3_NAMESPACE}"><Bucket>{self.bucket}</Bucket>'
                f"<Key>{escape(key)}</Key><ETag>{escape(etag(stat))}</ETag></CompleteMultipartUploadResult>"
            )
            send(writer, 200, {"Content-Type": "application/xml"}, xml.encode())
        elif method == "DELETE" and "uploadId" in query:
            shutil.rmtree(self.upload_dir(query["uploadId"]), ignore_errors=True)
            send(writer, 204, {}, b"")
        elif method == "DELETE":
            self.counts["deletes"] += 1
            self.store.delete(key)
            send(writer, 204, {}, b"")
        else:
            raise S3Error(405, "MethodNotAllowed", f"{method} is not served")
        return 0

    async def read(self, method: str, key: str, headers: dict[str, str], writer: asyncio.StreamWriter) -> int:
        """GET or HEAD of one object, whole or one byte range (206 with Content-Range); the bytes sent."""
        fd, stat = self.store.descriptor(key)
        start, end, status, extra = 0, stat.st_size, 200, b""
        if "range" in headers:
            start, end = parse_range(headers["range"], stat.st_size)
            status = 206
            extra = f"Content-Range: bytes {start}-{end - 1}/{stat.st_size}\r\n".encode()
        head = response_head(status, end - start, self.store.object_fields(key, stat) + extra)
        if method == "HEAD":
            self.counts["heads"] += 1
            writer.write(head)
            return 0
        self.counts["gets"] += 1
        first = os.pread(fd, min(end - start, SEND_CHUNK), start)
        writer.write(head + first)
        offset = start + len(first)
        while offset < end:
            await writer.drain()
            piece = os.pread(fd, min(end - offset, SEND_CHUNK), offset)
            if not piece:
                raise ConnectionError(f"{key} shrank while it was sent")
            writer.write(piece)
            offset += len(piece)
        self.counts["get_bytes"] += end - start
        return end - start

    def upload_dir(self, upload_id: str, create: bool = False) -> Path:
        directory = self.store.uploads / re.sub(r"[^0-9a-f]", "", upload_id)
        if create:
            directory.mkdir()
        elif not directory.is_dir():
            raise S3Error(404, "NoSuchUpload", f"no multipart upload {upload_id!r}")
        return directory

    def complete_upload(self, key: str, upload_id: str, if_none_match: bool) -> os.stat_result:
        directory = self.upload_dir(upload_id)
        joined = directory / "joined"
        with open(joined, "wb") as output:
            for part in sorted(path for path in directory.iterdir() if path.name != "joined"):
                with open(part, "rb") as piece:
                    shutil.copyfileobj(piece, output)
        try:
            return self.store.write(key, joined, if_none_match)
        finally:
            shutil.rmtree(directory, ignore_errors=True)

    async def control(self, method: str, command: str, writer: asyncio.StreamWriter) -> None:
        """``GET counters``; ``POST reset`` answers the counters as they were before it zeroed them."""
        if command not in ("counters", "reset"):
            send(writer, 404, {}, b"")
        else:
            counters = self.counters()
            if command == "reset" and method == "POST":
                self.reset()
            send(writer, 200, {"Content-Type": "application/json"}, json.dumps(counters).encode())
        await writer.drain()


def response_head(status: int, length: int, lines: bytes) -> bytes:
    """The status line, Content-Length, the request id and ``lines`` (header lines, each ending in
    CRLF), then the blank line."""
    return (
        (f"HTTP/1.1 {status} {REASONS.get(status, 'Error')}\r\nContent-Length: {length}\r\nx-amz-request-id: bench\r\n").encode(
            "latin-1"
        )
        + lines
        + b"\r\n"
    )


def send(writer: asyncio.StreamWriter, status: int, fields: dict[str, str], body: bytes, length: int | None = None) -> None:
    """Writes the status line, the headers and the first part of the body (``length`` in all)."""
    lines = "".join(f"{name}: {value}\r\n" for name, value in fields.items()).encode("latin-1")
    writer.write(response_head(status, len(body) if length is None else length, lines) + body)


async def serve(
    root: Path, host: str, port: int, bucket: str, latency_ms: float, exit_with_parent: bool, request_log: Path | None = None
) -> None:
    """Serves until SIGTERM, Ctrl-C or, with ``exit_with_parent``, the end of stdin."""
    server = Server(root, bucket, latency_ms, request_log)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    if exit_with_parent:
        # The parent holds our stdin open; when it exits, for whatever reason, so do we.
        stdin = sys.stdin.fileno()

        def parent_gone() -> None:
            if not os.read(stdin, 1 << 16):
                loop.remove_reader(stdin)
                stop.set()

        loop.add_reader(stdin, parent_gone)
    listener = await asyncio.start_server(server.connection, host, port, backlog=1024, limit=1 << 16)
    bound = listener.sockets[0].getsockname()
    print(
        f"serving {server.store.root} as s3://{bucket} at http://{bound[0]}:{bound[1]} (first-byte latency {latency_ms:g} ms)",
        flush=True,
    )
    try:
        async with listener:
            await stop.wait()
    finally:
        server.store.forget()
        shutil.rmtree(server.store.uploads, ignore_errors=True)
        if server.request_log is not None:
            server.request_log.close()


def _control(endpoint: str, method: str, command: str) -> dict[str, float]:
    request = urllib.request.Request(endpoint.rstrip("/") + CONTROL_PREFIX + command, method=method)
    with urllib.request.urlopen(request, timeout=30) as answer:
        return json.loads(answer.read())


def read_counters(endpoint: str) -> dict[str, float]:
    """The counters of the server at ``endpoint`` (see the module docstring)."""
    return _control(endpoint, "GET", "counters")


def reset_counters(endpoint: str) -> dict[str, float]:
    """Zeroes the counters of the server at ``endpoint``; returns them as they were."""
    return _control(endpoint, "POST", "reset")


class CounterWindow:
    """What the server at ``endpoint`` did between :meth:`start` and :meth:`end`, its CPU included.

    One window at a time per server: starting one resets the counters."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self._cpu_at_start = 0.0

    def start(self) -> None:
        self._cpu_at_start = reset_counters(self.endpoint)["cpu_s"]

    def end(self) -> dict[str, float]:
        counters = read_counters(self.endpoint)
        return {**counters, "cpu_s": counters["cpu_s"] - self._cpu_at_start}


class EpochCounterWindow(CounterWindow):
    """A :class:`CounterWindow` that also counts from when it is made: :meth:`end` adds
    ``epoch_<counter>`` for every counter of :data:`COUNTER_NAMES`, what the server did since then
    (made before a loader starts, that is its whole epoch, the reads before the first batch included).
    The window's own counters are those of :class:`CounterWindow`."""

    def __init__(self, endpoint: str) -> None:
        super().__init__(endpoint)
        reset_counters(endpoint)
        self._before_window: dict[str, float] = {}

    def start(self) -> None:
        self._before_window = reset_counters(self.endpoint)
        self._cpu_at_start = self._before_window["cpu_s"]

    def end(self) -> dict[str, float]:
        window = super().end()
        return {**window, **{f"epoch_{name}": self._before_window.get(name, 0.0) + window[name] for name in COUNTER_NAMES}}


def stop_process(process: subprocess.Popen, timeout_s: float = 10.0) -> None:
    """Ask a server process to stop (SIGTERM); kill it if it has not within ``timeout_s``."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


class S3BenchServer:
    """A running server process (see :func:`start_server`)."""

    def __init__(self, process: subprocess.Popen, endpoint: str, bucket: str, latency_ms: float) -> None:
        self.process, self.endpoint, self.bucket, self.latency_ms = process, endpoint, bucket, latency_ms

    def storage_options(self) -> dict[str, str]:
        """Lance storage options for ``s3://{bucket}/...`` through this server (any key is accepted)."""
        return {
            "endpoint": self.endpoint,
            "allow_http": "true",
            "region": "us-east-1",
            "access_key_id": "bench",
            "secret_access_key": "bench",
        }

    def uri(self, key: str) -> str:
        return f"s3://{self.bucket}/{key.strip('/')}"

    def counters(self) -> dict[str, float]:
        """Requests by kind, bytes sent for GETs, peak requests in flight, and the server's CPU seconds."""
        return read_counters(self.endpoint)

    def reset_counters(self) -> None:
        reset_counters(self.endpoint)

    def cpu_seconds(self) -> float:
        usage = _proc_usage(self.process.pid)
        return usage.cpu_s if usage else 0.0

    def stop(self) -> None:
        stop_process(self.process)
        for stream in (self.process.stdin, self.process.stdout):
            if stream:
                stream.close()

    def __enter__(self) -> S3BenchServer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def start_server(
    root: Path,
    latency_ms: float = 0.0,
    port: int = 0,
    bucket: str = BUCKET,
    host: str = "127.0.0.1",
    request_log: Path | None = None,
) -> S3BenchServer:
    """Serves ``root`` as ``s3://{bucket}`` from a new process; ``port`` 0 picks a free one;
    ``request_log``: a file that gets one line per request (see ``--request-log``)."""
    command = [
        sys.executable,
        "-m",
        "benchmarks.s3_server",
        str(root),
        "--port",
        str(port),
        "--host",
        host,
        "--bucket",
        bucket,
        "--latency-ms",
        str(latency_ms),
        "--exit-with-parent",
        *(["--request-log", str(request_log)] if request_log else []),
    ]
    environment = dict(os.environ)
    package_root = str(Path(__file__).resolve().parents[1])  # the repository root, above benchmarks/
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, environment.get("PYTHONPATH")]))
    process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=environment, text=True)
    assert process.stdout is not None  # stdout=PIPE
    line = process.stdout.readline()
    match = READY_PATTERN.search(line)
    if not match:
        process.kill()
        process.wait()
        raise RuntimeError(f"the S3 benchmark server did not start (exit code {process.returncode}): {line!r}")
    return S3BenchServer(process, match.group(1), bucket, latency_ms)


def run_event_loop(main_coroutine) -> None:
    """Runs the server on uvloop's event loop where it is installed (the bench extra), asyncio's own
    otherwise: uvloop's transports spend less CPU per request, which leaves more of the shared cores
    to the loader being measured."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(main_coroutine)
    else:
        uvloop.run(main_coroutine)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.s3_server", description="Serve a directory as one S3 bucket, with a first-byte latency."
    )
    parser.add_argument("root", type=Path, help="directory whose files are the bucket's objects")
    parser.add_argument("--port", type=int, default=9000, help="TCP port (0: a free one; default 9000)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--bucket", default=BUCKET, help=f"bucket name (default {BUCKET})")
    parser.add_argument("--latency-ms", type=float, default=0.0, help="first-byte latency of every request")
    parser.add_argument("--exit-with-parent", action="store_true", help="exit when stdin closes")
    parser.add_argument(
        "--request-log",
        type=Path,
        help="append one line per request to this file: arrival and end (Unix time), method, path, body bytes sent",
    )
    args = parser.parse_args(argv)
    if not args.root.is_dir():
        parser.error(f"{args.root} is not a directory")
    try:
        run_event_loop(
            serve(args.root, args.host, args.port, args.bucket, args.latency_ms, args.exit_with_parent, args.request_log)
        )
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
