"""Images checked as they are ingested: the header read for the width and height, the end of the
file checked for truncation, and a pixel limit. No pixel is decoded, so the check costs a small
fraction of a decode; what it cannot read is skipped and counted (or fails the ingest). The pixel
limit is the decoder's (:data:`~lance_hpc.limits.MAX_PIXELS`): an image ingest keeps is one
training can decode."""

from __future__ import annotations

import io
import warnings

from PIL import Image

from lance_hpc.limits import MAX_PIXELS

# Lance field metadata for encoded images: stored as they are. JPEG, PNG and WebP bytes do not
# compress, and trying costs Lance's writer most of its time (about 5x on the benchmark's photos).
ENCODED_BYTES = {"lance-encoding:compression": "none"}


# JPEG start-of-frame markers: the frame header holds the height and width.
SOF_MARKERS = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
# Markers with no length field after them.
STANDALONE_MARKERS = frozenset([0x01, 0xD8, *range(0xD0, 0xD8)])


def _jpeg_size(data: bytes) -> tuple[int, int] | None:
    """Width and height from the JPEG frame header, walking the markers up to it; None where the
    markers do not lead to one (then Pillow decides)."""
    index, end = 2, len(data)
    while index + 4 <= end:
        if data[index] != 0xFF:
            return None
        marker = data[index + 1]
        if marker == 0xFF:  # fill byte
            index += 1
            continue
        if marker in STANDALONE_MARKERS:
            index += 2
            continue
        if marker == 0xDA:  # the scan starts before any frame header
            return None
        if marker in SOF_MARKERS:
            if index + 9 > end:
                return None
            return int.from_bytes(data[index + 7 : index + 9], "big"), int.from_bytes(data[index + 5 : index + 7], "big")
        index += 2 + int.from_bytes(data[index + 2 : index + 4], "big")
    return None


def _fast_size(data: bytes) -> tuple[tuple[int, int], str] | None:
    """(size, format) of a JPEG or PNG read from its header bytes alone; None for anything else."""
    if data[:3] == b"\xff\xd8\xff":
        size = _jpeg_size(data)
        return (size, "JPEG") if size else None
    if data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR" and len(data) >= 24:
        return (int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")), "PNG"
    return None


def image_size(data: bytes | None, max_pixels: int = MAX_PIXELS) -> tuple[int, int] | str:
    """``(width, height)``, or why the image cannot be used: empty, unreadable, truncated, too big.

    JPEG and PNG sizes come from their headers directly (a few microseconds); other formats, and
    JPEGs whose markers do not lead to a frame header, are opened with Pillow (headers only)."""
    if not data:
        return "empty"
    fast = _fast_size(data)
    if fast is not None:
        (width, height), image_format = fast
        return _judged(data, width, height, image_format, max_pixels)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as image:
                width, height = image.size
                image_format = image.format
    except Image.DecompressionBombError:
        return "too many pixels"
    except Image.DecompressionBombWarning:
        return "too many pixels"
    except Exception:  # Pillow raises many kinds for a file it cannot read
        return "unreadable"
    return _judged(data, width, height, image_format, max_pixels)


def _judged(data: bytes, width: int, height: int, image_format: str | None, max_pixels: int) -> tuple[int, int] | str:
    if width <= 0 or height <= 0:
        return "unreadable"
    if width * height > max_pixels:
        return "too many pixels"
    if image_format == "JPEG" and not data.rstrip(b"\x00").endswith(b"\xff\xd9"):
        return "truncated"
    if image_format == "PNG" and b"IEND" not in data[-16:]:
        return "truncated"
    return width, height
