"""Shared-memory batch buffers: a batch crosses to another process as tensors over the worker's
buffer, the buffer is reused only after every tensor over it is freed, and real DataLoader
workers hand over exactly the pixels an in-process loader computes while reusing a handful of
buffers for a whole epoch."""

import gc
import os
import pickle
from multiprocessing.reduction import ForkingPickler

import torch

from lance_hpc.loading import dict_batches
from lance_hpc.loading.dict_batches import SharedDict
from lance_hpc.loading.reader import ROW_ID_FIELD
from lance_hpc.loading.transport import BufferPool
from lance_hpc.spec import DataSpec
from lance_hpc.storage.datasets import ReadStats
from lance_hpc.tasks.base import ROW_ID
from tests.support.loaders import batch_mappings, image_decoder, train_loader, workers_of, write_dataset


def send(batch):
    """What a DataLoader queue does to a worker's result: pickle it for another process."""
    return pickle.loads(ForkingPickler.dumps(batch))


def image_fields(image_size):
    """The fields a reader writes for the image task: uint8 channels-last images, labels, row ids."""
    return {**image_decoder(image_size=image_size).fields(), ROW_ID: ROW_ID_FIELD}


def test_a_buffer_is_reused_only_after_every_tensor_over_it_is_freed():
    pool = BufferPool()
    first = pool.batch(image_fields(4), 2)
    assert first.fields["image"].is_contiguous(memory_format=torch.channels_last)
    first.fields["image"].copy_(torch.arange(96, dtype=torch.uint8).view(2, 4, 4, 3).permute(0, 3, 1, 2))
    first.fields["label"].copy_(torch.tensor([7, 9]))
    first.fields[ROW_ID].copy_(torch.tensor([70, 90]))
    first.stats = ReadStats(skipped=1, retries=2)
    fields, stats = send(first)
    assert set(fields) == {"image", "label", ROW_ID} and stats == ReadStats(skipped=1, retries=2)
    assert torch.equal(fields["image"], first.fields["image"]) and fields["label"].tolist() == [7, 9]
    assert fields[ROW_ID].tolist() == [70, 90] and fields[ROW_ID].dtype == torch.int64
    assert fields["image"].is_contiguous(memory_format=torch.channels_last)

    held_view = fields["image"][1]  # a view keeps the buffer as busy as the batch itself
    del fields
    gc.collect()
    second = pool.batch(image_fields(4), 2)
    assert second.buffer is not first.buffer and len(pool.buffers) == 2
    assert int(held_view[0, 0, 0]) == 48  # untouched

    del held_view
    gc.collect()
    assert first.buffer.free
    assert pool.batch(image_fields(4), 2).buffer is first.buffer and len(pool.buffers) == 2


def test_a_batch_that_failed_gives_its_buffer_back():
    pool = BufferPool()
    pool.batch(image_fields(8), 3).release()
    pool.batch(image_fields(8), 3)
    assert len(pool.buffers) == 1


def test_a_smaller_batch_fits_a_larger_free_buffer():
    pool = BufferPool()
    pool.batch(image_fields(8), 4).release()
    smaller = pool.batch(image_fields(8), 2)
    assert len(pool.buffers) == 1 and smaller.fields["image"].shape == (2, 3, 8, 8)
    assert smaller.fields["label"].shape == (2,) and smaller.fields[ROW_ID].shape == (2,)


def test_a_dict_batch_crosses_in_one_buffer_keeping_its_order_strides_and_other_values(monkeypatch):
    """What a transform may return: tensors of any shape (channels-last, a scalar, a strided
    slice, booleans) cross in one buffer, each with its values and dtype and a dense one with
    its strides; what is not a plain tensor (one that needs its gradient, a list, an int key)
    is pickled beside them; the keys keep their order."""
    image = torch.arange(96, dtype=torch.uint8).view(2, 4, 4, 3).permute(0, 3, 1, 2)
    weights = torch.ones(3, requires_grad=True)
    value = {
        "image": image,
        "names": ["a", "b"],
        "scale": torch.tensor(2.5),
        "every_other": torch.arange(12.0).view(3, 4)[:, ::2],
        7: torch.tensor([True, False]),
        "weights": weights,
    }
    pool = BufferPool()  # this process's own pool would outlive the test, mapped
    monkeypatch.setattr(dict_batches, "worker_pool", lambda: pool)
    sent = SharedDict.of(value, ReadStats(retries=3))
    received, stats = send(sent)
    assert list(received) == list(value) and stats == ReadStats(retries=3)
    for name, tensor in value.items():
        if isinstance(tensor, torch.Tensor):
            assert received[name].dtype == tensor.dtype and torch.equal(received[name].detach(), tensor.detach()), name
    assert received["image"].stride() == image.stride()
    assert received["names"] == ["a", "b"] and received["weights"].requires_grad
    buffered = ["image", "scale", "every_other", 7]
    assert {received[name].untyped_storage().data_ptr() for name in buffered} == {received["image"].untyped_storage().data_ptr()}
    assert not sent.buffer.free
    del received
    gc.collect()
    assert sent.buffer.free, "the buffer is the worker's again once the batch is freed"
    (buffer,) = pool.buffers
    pool.buffers.clear()
    del sent
    os.close(buffer.fd)


def test_a_worker_reuses_a_few_buffers_for_a_whole_epoch(tmp_path):
    uri = write_dataset(str(tmp_path / "d.lance"), [40, 40, 40])
    loader = train_loader(DataSpec(uri=uri, batch_size=6, num_workers=1, prefetch_factor=2), 0, 1)
    loader.set_epoch(0)
    steps = sum(1 for _ in loader)  # each batch dropped before the next
    workers = workers_of(os.getpid())
    assert steps == 20 and len(workers) == 1
    # In flight at once: the prefetched batches, the one being written and the one just handed over.
    assert 1 <= len(batch_mappings(workers[0])) <= 2 + 2


def test_workers_hand_over_in_process_pixels_and_never_overwrite_a_held_batch(tmp_path):
    uri = write_dataset(str(tmp_path / "d.lance"), [40, 40, 40])
    fields = dict(uri=uri, batch_size=6, seed=5)
    expected = train_loader(DataSpec(**fields, num_workers=0), 0, 1, augment="crop_flip")
    expected.set_epoch(0)
    reference = list(expected)

    loader = train_loader(DataSpec(**fields, num_workers=2), 0, 1, augment="crop_flip")
    loader.set_epoch(0)
    held = list(loader)  # every batch kept, so no buffer may be reused under them
    assert len(held) == len(reference) == 20
    for batch, want in zip(held, reference):
        assert batch.keys() == want.keys() == {"image", "label", ROW_ID}
        assert all(torch.equal(batch[name], want[name]) for name in want)
    del held, batch
    gc.collect()
    assert not batch_mappings(os.getpid())  # released batches are unmapped in the main process
