"""Functions for ``job: map`` (infer.function): plain Python over a ``pyarrow.RecordBatch``, no model.

    lance-hpc submit examples/map_job/job.yaml --local

``sizes`` gives each digit's encoded size and an average hash of its pixels (8x8: one bit per
pixel above the image's mean), which finds near-duplicates by Hamming distance.
"""

from __future__ import annotations

import io

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from PIL import Image


def average_hash(encoded: bytes) -> int:
    """64 bits: the image in grey at 8x8, each pixel above the mean a 1."""
    pixels = np.asarray(Image.open(io.BytesIO(encoded)).convert("L").resize((8, 8)), dtype=np.float32)
    bits = (pixels > pixels.mean()).reshape(-1)
    return int(np.packbits(bits).view(">i8")[0])


def sizes(batch: pa.RecordBatch) -> dict[str, object]:
    """Each row's encoded image size in bytes and its average hash."""
    images = batch.column("image")
    return {
        "image_bytes": pc.binary_length(images),
        "average_hash": np.array([average_hash(value) for value in images.to_pylist()], dtype=np.int64),
    }
