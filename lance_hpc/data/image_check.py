"""Images checked as they are ingested: the header read for the width and height, the end of the
file checked for truncation, and a pixel limit. No pixel is decoded, so the check costs a small
fraction of a decode; what it cannot read is skipped and counted (or fails the ingest)."""

from __future__ import annotations

import io
import warnings

from PIL import Image

# Above this many pixels an image is refused (Pillow's own decompression-bomb limit is 89 M pixels).
MAX_PIXELS = 178_956_970


def image_size(data: bytes | None, max_pixels: int = MAX_PIXELS) -> tuple[int, int] | str:
    """``(width, height)``, or why the image cannot be used: empty, unreadable, truncated, too big."""
    if not data:
        return "empty"
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
    if width <= 0 or height <= 0:
        return "unreadable"
    if width * height > max_pixels:
        return "too many pixels"
    if image_format == "JPEG" and not data.rstrip(b"\x00").endswith(b"\xff\xd9"):
        return "truncated"
    if image_format == "PNG" and b"IEND" not in data[-16:]:
        return "truncated"
    return width, height
