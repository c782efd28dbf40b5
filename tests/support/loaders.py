"""Small image datasets whose label is the row id (so a batch shows which rows were read), and the
image task's loaders over them, for the data-layer tests."""

from __future__ import annotations

import lance
import numpy as np
import pyarrow as pa

from lance_hpc.data import build_eval_loader, build_train_loader
from lance_hpc.data.decode import Transform
from lance_hpc.data.ingest import schema_for
from lance_hpc.data.sources import skimage_photo_crops
from lance_hpc.spec import DataSpec
from lance_hpc.tasks.image import ImageDecoder

IMAGES = [data for data, _ in skimage_photo_crops(13, size=20)]


def write_dataset(uri, fragment_rows, corrupt=(), mode="create"):
    """A dataset whose label is the row id, so batches show which rows were read."""
    total = sum(fragment_rows)
    start = lance.dataset(uri).count_rows() if mode == "append" else 0
    ids = np.arange(start, start + total)
    images = [b"corrupt bytes" if int(i) in corrupt else IMAGES[int(i) % len(IMAGES)] for i in ids]
    schema = schema_for([str(i) for i in range(start + total)], "test")
    batches, offset = [], 0
    for rows in fragment_rows:
        batches.append(
            pa.record_batch(
                [pa.array(images[offset : offset + rows], pa.binary()), pa.array(ids[offset : offset + rows], pa.int64())],
                schema=schema,
            )
        )
        offset += rows
    for batch in batches:  # one fragment per batch
        lance.write_dataset(
            pa.Table.from_batches([batch]), uri, mode=mode if mode == "append" or batch is batches[0] else "append"
        )
    return uri


def spec(uri, **fields):
    defaults = dict(batch_size=8, num_workers=0, seed=3)
    return DataSpec(uri=uri, **(defaults | fields))


def image_decoder(train=True, image_size=16, augment="crop_flip"):
    """The image task's worker half, as ImageClassification builds it from its options."""
    return ImageDecoder("image", "label", Transform(image_size, train=train, augment=augment))


def train_loader(data, rank, world_size, **decoder):
    return build_train_loader(data, image_decoder(**decoder), rank, world_size)


def eval_loader(data, rank, world_size):
    return build_eval_loader(data, image_decoder(train=False), rank, world_size)
