"""Batches from DataLoader workers to the main process, through shared-memory buffers that each
worker reuses.

Writing a batch into fresh shared memory costs a page fault per 4 KiB page (about 0.1 ms per
224 px image on a 2-core VM, an eighth of decoding it), and that is what a new shared tensor per
batch pays. Here each worker keeps a pool of buffers instead (``memfd``: never a file in
/dev/shm, so a killed process leaves nothing behind). A batch travels as its buffer's file
descriptor and layout; the main process maps the buffer and builds the image and label tensors
over the mapping. When the last tensor over a batch is freed, the main process clears the
buffer's in-use byte and the worker may write a later batch there. A buffer whose batch is still
referenced is never written: the worker allocates another one rather than wait.
"""

from __future__ import annotations

import mmap
import os
import weakref
from multiprocessing.reduction import DupFd
from typing import Any

import numpy as np
import torch

# Bytes before the images: byte 0 is the in-use flag; 64 keeps the pixels cache-line aligned.
HEADER = 64
FREE, IN_USE = 0, 1


def _layout(count: int, size: int) -> tuple[int, int]:
    """(offset of the labels, total bytes) of a batch of ``count`` RGB ``size`` squares."""
    labels_at = HEADER + -(-count * size * size * 3 // 8) * 8  # int64 labels, 8-byte aligned
    return labels_at, labels_at + 8 * count


def _views(data: torch.Tensor, count: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 images [count, 3, size, size] in channels-last memory, and int64 labels [count]."""
    labels_at, end = _layout(count, size)
    images = data[HEADER : HEADER + count * size * size * 3].view(count, size, size, 3).permute(0, 3, 1, 2)
    return images, data[labels_at:end].view(torch.int64)


class Buffer:
    """One shared-memory buffer of a worker, mapped for as long as the worker lives."""

    def __init__(self, nbytes: int) -> None:
        self.fd = os.memfd_create("lance_hpc-batch", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, nbytes)
        self.nbytes = nbytes
        self.mapping = mmap.mmap(self.fd, nbytes)
        self.data = torch.from_numpy(np.frombuffer(self.mapping, dtype=np.uint8))

    @property
    def free(self) -> bool:
        return self.mapping[0] == FREE


class SharedBatch:
    """A batch written into a worker's buffer. Sent to the main process, it arrives as the tuple
    ``(images, labels, skipped)`` of tensors over the same memory."""

    def __init__(self, buffer: Buffer, count: int, size: int) -> None:
        self.buffer = buffer
        self.count = count
        self.size = size
        self.images, self.labels = _views(buffer.data, count, size)
        self.skipped = 0

    def release(self) -> None:
        """Give the buffer back without sending it (the batch failed)."""
        self.buffer.mapping[0] = FREE

    def __reduce__(self) -> tuple[Any, tuple]:
        return _receive, (DupFd(self.buffer.fd), self.buffer.nbytes, self.count, self.size, self.skipped)


def _receive(fd: Any, nbytes: int, count: int, size: int, skipped: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Main process: map the buffer; when the last tensor over it is freed, mark it free."""
    try:
        descriptor = fd.detach()  # fetched from the worker that sent the batch
    except (OSError, EOFError) as error:
        raise RuntimeError(
            f"a DataLoader worker exited before handing over a batch it had prepared ({error}): see its "
            "error above, or the system log if it was killed (out of memory, for one)"
        ) from error
    try:
        mapping = mmap.mmap(descriptor, nbytes)
    finally:
        os.close(descriptor)
    owner = np.frombuffer(mapping, dtype=np.uint8)  # kept alive by every tensor built below
    weakref.finalize(owner, _release, mapping)
    images, labels = _views(torch.from_numpy(owner), count, size)
    return images, labels, skipped


def _release(mapping: mmap.mmap) -> None:
    mapping[0] = FREE


class BufferPool:
    """A worker's buffers: a free one that fits, else a new one."""

    def __init__(self) -> None:
        self.buffers: list[Buffer] = []

    def batch(self, count: int, size: int) -> SharedBatch:
        nbytes = _layout(count, size)[1]
        buffer = next((b for b in self.buffers if b.nbytes >= nbytes and b.free), None)
        if buffer is None:
            buffer = Buffer(nbytes)
            self.buffers.append(buffer)
        buffer.mapping[0] = IN_USE
        return SharedBatch(buffer, count, size)


_pools: dict[int, BufferPool] = {}


def worker_pool() -> BufferPool:
    """This process's pool (a forked process starts with an empty one)."""
    return _pools.setdefault(os.getpid(), BufferPool())
