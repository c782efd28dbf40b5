"""Small image datasets whose label is the row id (so a batch shows which rows were read), the
image task's loaders over them, and the DataLoader worker processes serving them, for the
data-layer tests."""

from __future__ import annotations

import lance
import numpy as np
import pyarrow as pa

from lance_hpc.bench.resources import descendants
from lance_hpc.ingest.dataset import schema_for
from lance_hpc.ingest.sources import skimage_photo_crops
from lance_hpc.loading import build_eval_loader, build_train_loader
from lance_hpc.spec import DataSpec
from lance_hpc.tasks.image import ImageDecoder
from lance_hpc.tasks.image_decode import Transform

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
    defaults = dict(batch_size=8, num_workers=0, seed=3, block_kb=2, block_window=3)  # sampler: block: runs of a few rows
    return DataSpec(uri=uri, **(defaults | fields))


def image_decoder(train=True, image_size=16, augment="crop_flip"):
    """The image task's worker half, as ImageClassification builds it from its options."""
    return ImageDecoder("image", "label", Transform(image_size, train=train, augment=augment))


def train_loader(data, rank, world_size, **decoder):
    return build_train_loader(data, image_decoder(**decoder), rank, world_size)


def eval_loader(data, rank, world_size):
    return build_eval_loader(data, image_decoder(train=False), rank, world_size)


def loader_on(tmp_path, **fields):
    """Rank 0 of 1's training loader over a new 120-row dataset in ``tmp_path``, with two workers
    unless ``fields`` say otherwise, set to epoch 0."""
    uri = write_dataset(str(tmp_path / "d.lance"), [40, 40, 40])
    loader = train_loader(DataSpec(uri=uri, batch_size=6, **{"num_workers": 2, **fields}), 0, 1)
    loader.set_epoch(0)
    return loader


def batch_mappings(pid):
    """Distinct batch buffers mapped by ``pid``."""
    with open(f"/proc/{pid}/maps") as maps:
        return {line.split()[4] for line in maps if "memfd:lance_hpc-batch" in line}


def workers_of(pid):
    """The descendants of ``pid`` that hold batch buffers: its DataLoader workers."""
    return [child for child in descendants(pid) if batch_mappings(child)]
