"""Shared-memory batch buffers: a batch crosses to another process as tensors over the worker's
buffer, the buffer is reused only after every tensor over it is freed, and real DataLoader
workers hand over exactly the pixels an in-process loader computes while reusing a handful of
buffers for a whole epoch."""

import gc
import os
import pickle

import torch
from multiprocessing.reduction import ForkingPickler

from lance_hpc.bench.resources import descendants
from lance_hpc.data import build_train_loader
from lance_hpc.data.transport import BufferPool
from lance_hpc.spec import DataSpec
from tests.test_data_loader import write_dataset


def send(batch):
    """What a DataLoader queue does to a worker's result: pickle it for another process."""
    return pickle.loads(ForkingPickler.dumps(batch))


def test_a_buffer_is_reused_only_after_every_tensor_over_it_is_freed():
    pool = BufferPool()
    first = pool.batch(2, 4)
    first.images.copy_(torch.arange(96, dtype=torch.uint8).view(2, 4, 4, 3).permute(0, 3, 1, 2))
    first.labels.copy_(torch.tensor([7, 9]))
    first.skipped = 1
    images, labels, skipped = send(first)
    assert torch.equal(images, first.images) and labels.tolist() == [7, 9] and skipped == 1
    assert images.is_contiguous(memory_format=torch.channels_last)

    held_view = images[1]  # a view keeps the buffer as busy as the batch itself
    del images, labels
    gc.collect()
    second = pool.batch(2, 4)
    assert second.buffer is not first.buffer and len(pool.buffers) == 2
    assert int(held_view[0, 0, 0]) == 48  # untouched

    del held_view
    gc.collect()
    assert first.buffer.free
    assert pool.batch(2, 4).buffer is first.buffer and len(pool.buffers) == 2


def test_a_batch_that_failed_gives_its_buffer_back():
    pool = BufferPool()
    pool.batch(3, 8).release()
    pool.batch(3, 8)
    assert len(pool.buffers) == 1


def test_a_smaller_batch_fits_a_larger_free_buffer():
    pool = BufferPool()
    pool.batch(4, 8).release()
    smaller = pool.batch(2, 8)
    assert len(pool.buffers) == 1 and smaller.images.shape == (2, 3, 8, 8) and smaller.labels.shape == (2,)


def batch_mappings(pid):
    """Distinct batch buffers mapped by ``pid``."""
    with open(f"/proc/{pid}/maps") as maps:
        return {line.split()[4] for line in maps if "memfd:lance_hpc-batch" in line}


def workers_of(pid):
    """The descendants of ``pid`` that hold batch buffers: its DataLoader workers."""
    return [child for child in descendants(pid) if batch_mappings(child)]


def test_a_worker_reuses_a_few_buffers_for_a_whole_epoch(tmp_path):
    uri = write_dataset(str(tmp_path / "d.lance"), [40, 40, 40])
    loader = build_train_loader(DataSpec(uri=uri, batch_size=6, image_size=16, num_workers=1, prefetch_factor=2), 0, 1)
    loader.set_epoch(0)
    steps = sum(1 for _ in loader)  # each batch dropped before the next
    workers = workers_of(os.getpid())
    assert steps == 20 and len(workers) == 1
    # In flight at once: the prefetched batches, the one being written and the one just handed over.
    assert 1 <= len(batch_mappings(workers[0])) <= 2 + 2


def test_workers_hand_over_in_process_pixels_and_never_overwrite_a_held_batch(tmp_path):
    uri = write_dataset(str(tmp_path / "d.lance"), [40, 40, 40])
    fields = dict(uri=uri, batch_size=6, image_size=16, seed=5, augment="crop_flip")
    expected = build_train_loader(DataSpec(**fields, num_workers=0), 0, 1)
    expected.set_epoch(0)
    reference = list(expected)

    loader = build_train_loader(DataSpec(**fields, num_workers=2), 0, 1)
    loader.set_epoch(0)
    held = list(loader)  # every batch kept, so no buffer may be reused under them
    assert len(held) == len(reference) == 20
    for (images, labels), (want_images, want_labels) in zip(held, reference):
        assert torch.equal(labels, want_labels) and torch.equal(images, want_images)
    del held, images, labels
    gc.collect()
    assert not batch_mappings(os.getpid())  # released batches are unmapped in the main process
