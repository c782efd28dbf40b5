"""WebDataset tars read as samples, within bounds.

A tar is read header by header (ustar, GNU long names and base-256 sizes, pax paths and sizes), with
each header's checksum checked: much cheaper than ``tarfile``, and a header is never trusted. A
member's data is read in chunks of at most :data:`READ_CHUNK`, and only when it is a regular file
within the record limit whose contents the read needs; any other is passed over chunk by chunk, so
memory never depends on what a header declares. A malformed header (a size that is not a number, a
negative one, a checksum that does not match, a tar cut short) is one clear error naming the file and
the byte: the next header cannot be found after it. A sample past a limit (a member over the record
size, more fields than :data:`~lance_hpc.limits.MAX_SAMPLE_FIELDS`) is skipped and counted, or
fails the ingest, as ``on_corrupt`` says.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Iterator, NamedTuple

import pyarrow as pa

from lance_hpc.errors import UserError
from lance_hpc.ingest.reading import BATCH_BYTES, BATCH_ROWS, TOO_BIG_FIX, Reading

TAR_BLOCK = 512
# The most bytes one read of the stream asks for: a member's data is gathered from such chunks.
READ_CHUNK = 8 << 20
# A GNU long name or a pax header is metadata of the next member: past this it is damage, not a name.
MAX_HEADER_BYTES = 1 << 20
OCTAL_DIGITS = frozenset(b"01234567")
# Member types that are files: regular (ustar, old tar) and contiguous.
FILE_TYPES = (b"0", b"\0", b"7")
DAMAGED_FIX = "mend or remove the file, or point the source's glob past it"


class Member(NamedTuple):
    """A file of a tar: its name, its size as its header declares it, and its data, or ``None``
    when it was passed over (over the record limit, or not needed)."""

    name: str
    size: int
    data: bytes | None


class _Blocks:
    """A stream read in chunks of at most :data:`READ_CHUNK`: a header is a slice of the buffer,
    a member's data is gathered chunk by chunk, and data passed over is read and dropped."""

    def __init__(self, stream: Any) -> None:
        self.stream, self.buffer, self.offset, self.position = stream, b"", 0, 0

    def _chunk(self) -> bytes:
        """What is left of the buffer, else the stream's next chunk (empty at its end)."""
        if self.offset < len(self.buffer):
            rest = self.buffer[self.offset :]
            self.buffer, self.offset = b"", 0
            return rest
        return bytes(self.stream.read(READ_CHUNK))

    def read(self, size: int) -> bytes:
        """The next ``size`` bytes, fewer at the end of the stream."""
        if self.offset + size <= len(self.buffer):
            part = self.buffer[self.offset : self.offset + size]
            self.offset += size
            self.position += size
            return part
        out = bytearray()
        while len(out) < size:
            chunk = self._chunk()
            if not chunk:
                break
            need = size - len(out)
            out += memoryview(chunk)[:need]
            if len(chunk) > need:
                self.buffer, self.offset = chunk, need
        self.position += len(out)
        return bytes(out)

    def skip(self, size: int) -> int:
        """Pass over the next ``size`` bytes; how many there were (fewer at the end of the stream)."""
        if self.offset + size <= len(self.buffer):
            self.offset += size
            self.position += size
            return size
        left = size
        while left > 0:
            chunk = self._chunk()
            if not chunk:
                break
            if len(chunk) > left:
                self.buffer, self.offset = chunk, left
                left = 0
            else:
                left -= len(chunk)
        self.position += size - left
        return size - left


def _damaged(where: str, position: int, what: str) -> UserError:
    return UserError(f"{where} is not a tar file, or is damaged: {what} (the header at byte {position:,})\n  fix: {DAMAGED_FIX}")


def _member_size(field: bytes, where: str, position: int) -> int:
    """A header's size field: octal digits, or GNU base-256 (first byte 0x80; 0xFF is negative)."""
    if field[0] == 0x80:
        return int.from_bytes(field[1:], "big")
    if field[0] & 0x80:
        raise _damaged(where, position, "a negative size")
    digits = field.split(b"\0", 1)[0].strip(b" ")
    if not set(digits) <= OCTAL_DIGITS:
        raise _damaged(where, position, f"a size that is not an octal number ({field!r})")
    return int(digits or b"0", 8)


def _check_sum(header: bytes, where: str, position: int) -> None:
    stored = header[148:156].split(b"\0", 1)[0].strip(b" ")
    if not stored or not set(stored) <= OCTAL_DIGITS:
        raise _damaged(where, position, "a header checksum that is not an octal number")
    if int(stored, 8) != sum(header[:148]) + 8 * 32 + sum(header[156:]):
        raise _damaged(where, position, "a header checksum that does not match")


def _header_name(header: bytes) -> str:
    name = header[:100].split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
    if header[257:262] == b"ustar":
        prefix = header[345:500].split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
        return f"{prefix}/{name}" if prefix else name
    return name


def _pax_fields(data: bytes, where: str, position: int) -> tuple[str | None, int | None]:
    """The next member's path and size from a pax header's ``LENGTH KEY=VALUE`` records."""
    path, size = None, None
    for record in data.decode("utf-8", "surrogateescape").splitlines():
        key, _, value = record.partition(" ")[2].partition("=")
        if key == "path":
            path = value
        elif key == "size":
            if not value.isdigit() or not value.isascii():
                raise _damaged(where, position, f"a pax size that is not a number ({value[:40]!r})")
            size = int(value)
    return path, size


def tar_members(stream: Any, where: str, max_bytes: int, wanted: Callable[[str], bool] = lambda name: True) -> Iterator[Member]:
    """Each file of a tar stream, in order; the data of one over ``max_bytes`` or not ``wanted(name)``
    is passed over (``None``). Directories, links and global pax headers are passed over too."""
    blocks = _Blocks(stream)
    long_name: str | None = None
    pax_size: int | None = None
    while True:
        position = blocks.position
        header = blocks.read(TAR_BLOCK)
        if len(header) < TAR_BLOCK or not header.strip(b"\0"):
            if header.strip(b"\0"):
                raise _damaged(where, position, f"the file ends inside a header ({len(header)} bytes)")
            return
        _check_sum(header, where, position)
        size = pax_size if pax_size is not None else _member_size(header[124:136], where, position)
        kind = header[156:157]
        if kind in (b"L", b"x"):  # the next member's long name, or its pax attributes
            if size > MAX_HEADER_BYTES:
                raise _damaged(where, position, f"a long-name or pax header of {size:,} bytes")
            data = _exactly(blocks, size, where, position, "a long-name or pax header")
            if kind == b"L":
                long_name = data.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
            else:
                path, pax_size = _pax_fields(data, where, position)
                long_name = path or long_name
            blocks.skip(-size % TAR_BLOCK)
            continue
        name = long_name or _header_name(header)
        is_file = kind in FILE_TYPES
        read = is_file and size <= max_bytes and wanted(name)
        contents = _exactly(blocks, size, where, position, repr(name)) if read else None
        if contents is None and blocks.skip(size) < size:
            raise _damaged(where, position, f"the file ends inside {name!r}, which should have {size:,} bytes")
        blocks.skip(-size % TAR_BLOCK)
        long_name, pax_size = None, None
        if is_file:
            yield Member(name, size, contents)


def _exactly(blocks: _Blocks, size: int, where: str, position: int, what: str) -> bytes:
    data = blocks.read(size)
    if len(data) < size:
        raise _damaged(where, position, f"the file ends inside {what}, which should have {size:,} bytes")
    return data


def sample_key(name: str) -> tuple[str, str] | None:
    """``(key, extension)`` of a member: the name up to the first dot after the last slash, and the
    rest lower-cased; ``None`` for a name with no extension or a hidden file."""
    directory, _, base = name.rpartition("/")
    stem, dot, extension = base.partition(".")
    if not dot or stem.startswith("."):
        return None
    return (f"{directory}/{stem}" if directory else stem), extension.lower()


class _Samples:
    """Consecutive members sharing a key, gathered into one record each: ``.json`` members add
    their fields, ``.cls`` an integer (its text when it holds a name), ``.txt`` a string, other extensions their bytes."""

    def __init__(self, where: str, max_bytes: int, reading: Reading) -> None:
        self.where, self.max_bytes, self.reading = where, max_bytes, reading
        self.current: dict[str, Any] | None = None
        self.skipping = False  # the current sample is past a limit: its other members are passed over
        self.done: list[dict[str, Any]] = []
        self.bytes = 0

    def wanted(self, name: str) -> bool:
        """Whether a member's data is read (not for a sample being skipped, nor an unneeded field)."""
        split = sample_key(name)
        if split is None:
            return False
        key, extension = split
        same_sample = self.current is not None and self.current["__key__"] == key
        return not (self.skipping and same_sample) and self.reading.wants(extension)

    def add(self, member: Member) -> None:
        split = sample_key(member.name)
        if split is None:
            return
        key, extension = split
        if self.current is None or self.current["__key__"] != key:
            self.close()
            self.current = {"__key__": key}
        if self.skipping:
            return
        if member.size > self.max_bytes:
            self._skip(
                "too big",
                f"{self.where}: {member.name} has {member.size:,} bytes, over max_record_mb ({self.max_bytes >> 20} MiB)",
                TOO_BIG_FIX,
            )
        elif member.data is None:  # a field whose contents this read does not need
            self.current[extension] = b""
            self.reading.unread += member.size
        else:
            self._field(member.name, extension, member.data)
            self.bytes += member.size
        if not self.skipping and len(self.current) - 1 > self.reading.max_fields:
            self._skip(
                "too many fields",
                f"{self.where}: sample {key!r} has more than {self.reading.max_fields} fields",
                "give each sample fewer files and JSON fields, or ingest with on_corrupt: skip to leave such samples out",
            )

    def _field(self, name: str, extension: str, data: bytes) -> None:
        assert self.current is not None
        if extension == "json":
            try:
                fields = json.loads(data)
            except (ValueError, RecursionError) as error:  # nesting past Python's recursion limit too
                raise UserError(f"{self.where}: {name} is not JSON ({type(error).__name__}: {error})") from None
            if isinstance(fields, dict):
                for field_name, value in fields.items():
                    self.current.setdefault(field_name, value)
        elif extension == "cls":
            text = data.decode("utf-8", errors="replace").strip()
            try:
                self.current["cls"] = int(text)
            except ValueError:  # a class name: kept as text, which the label column refuses with its fix
                self.current["cls"] = text
        elif extension == "txt":
            self.current["txt"] = data.decode("utf-8", errors="replace")
        else:
            self.current[extension] = data

    def _skip(self, reason: str, what: str, fix: str) -> None:
        self.reading.skip(reason, what, fix)  # raises with on_corrupt: fail
        self.skipping = True

    def close(self) -> None:
        """The current sample is complete: kept, unless it is being skipped."""
        if self.current is not None and not self.skipping:
            self.done.append(self.current)
        self.current, self.skipping = None, False

    def take(self) -> list[dict[str, Any]] | None:
        """The samples gathered, once a batch's worth (or ``close`` was called and some are left)."""
        if len(self.done) < BATCH_ROWS and self.bytes < BATCH_BYTES and self.current is not None:
            return None
        taken, self.done, self.bytes = self.done, [], 0
        return taken or None


def webdataset_batches(stream: Any, where: str, max_bytes: int, reading: Reading) -> Iterator[pa.RecordBatch]:
    """Samples of a WebDataset tar stream as record batches, each bounded in rows and bytes:
    consecutive members sharing a key make one sample."""
    samples = _Samples(where, max_bytes, reading)
    for member in tar_members(stream, where, max_bytes, samples.wanted):
        samples.add(member)
        taken = samples.take()
        if taken:
            yield _samples_batch(taken, where)
    samples.close()
    taken = samples.take()
    if taken:
        yield _samples_batch(taken, where)


def _samples_batch(records: list[dict[str, Any]], where: str) -> pa.RecordBatch:
    """Samples as columns: every field any of them has (missing ones null), not only the first's."""
    names = dict.fromkeys(name for record in records for name in record)
    try:
        return pa.RecordBatch.from_pydict({name: [record.get(name) for record in records] for name in names})
    except (pa.ArrowInvalid, pa.ArrowTypeError) as error:
        raise UserError(f"{where}: the samples' fields do not fit one type each: {error}") from None
