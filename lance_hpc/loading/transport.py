"""Batches from DataLoader workers to the main process, through shared-memory buffers that each
worker reuses.

Writing a batch into fresh shared memory costs a page fault per 4 KiB page (about 0.1 ms per
224 px image on a 2-core VM, an eighth of decoding it), and that is what a new shared tensor per
batch pays. Here each worker keeps a pool of buffers instead (``memfd``: never a file in
/dev/shm, so a killed process leaves nothing behind). A batch travels as its buffer's file
descriptor and layout (each field's offset, shape, dtype and memory order); the main process maps
the buffer and builds the batch's tensors over the mapping. When the last tensor over a batch is
freed, the main process clears the buffer's in-use byte and the worker may write a later batch
there. A buffer whose batch is still
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

from lance_hpc.tasks.base import FieldSpec

# Bytes before the first field: byte 0 is the in-use flag; 64 keeps every field cache-line aligned.
HEADER = 64
ALIGN = 64
FREE, IN_USE = 0, 1

Layout = tuple[tuple[str, FieldSpec, int], ...]  # (field name, spec, byte offset) in buffer order


def layout(fields: dict[str, FieldSpec], rows: int) -> tuple[Layout, int]:
    """Where each field of a ``rows``-row batch lies in a buffer, and the buffer's size in bytes."""
    placed, offset = [], HEADER
    for name, spec in fields.items():
        placed.append((name, spec, offset))
        offset += -(-spec.row_bytes * rows // ALIGN) * ALIGN
    return tuple(placed), offset


def _views(data: torch.Tensor, placed: Layout, rows: int) -> dict[str, torch.Tensor]:
    """The batch's fields over ``data``, each in its own memory layout."""
    views = {}
    for name, spec, offset in placed:
        stored = data[offset : offset + spec.row_bytes * rows].view(spec.dtype).view(rows, *spec.stored_shape)
        views[name] = spec.view(stored)
    return views


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
    """A batch written into a worker's buffer. Sent to the main process, it arrives as the pair
    ``(fields, stats)``: a dict of tensors over the same memory, and what reading it took
    (a small picklable record, :class:`lance_hpc.loading.reader.ReadStats`)."""

    def __init__(self, buffer: Buffer, placed: Layout, rows: int) -> None:
        self.buffer = buffer
        self.placed = placed
        self.rows = rows
        self.fields = _views(buffer.data, placed, rows)
        self.stats: Any = None

    def release(self) -> None:
        """Give the buffer back without sending it (the batch failed)."""
        self.buffer.mapping[0] = FREE

    def __reduce__(self) -> tuple[Any, tuple]:
        return _receive, (DupFd(self.buffer.fd), self.buffer.nbytes, self.placed, self.rows, self.stats)


def _receive(fd: Any, nbytes: int, placed: Layout, rows: int, stats: Any) -> tuple[dict[str, torch.Tensor], Any]:
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
    return _views(torch.from_numpy(owner), placed, rows), stats


def _release(mapping: mmap.mmap) -> None:
    mapping[0] = FREE


class BufferPool:
    """A worker's buffers: a free one that fits, else a new one."""

    def __init__(self) -> None:
        self.buffers: list[Buffer] = []

    def batch(self, fields: dict[str, FieldSpec], rows: int, kind: type[SharedBatch] = SharedBatch) -> SharedBatch:
        """A free buffer for a ``rows``-row batch of ``fields``, as ``kind`` (a :class:`SharedBatch`
        that travels another way, such as a dict batch's)."""
        placed, nbytes = layout(fields, rows)
        buffer = next((b for b in self.buffers if b.nbytes >= nbytes and b.free), None)
        if buffer is None:
            buffer = Buffer(nbytes)
            self.buffers.append(buffer)
        buffer.mapping[0] = IN_USE
        return kind(buffer, placed, rows)


_pools: dict[int, BufferPool] = {}


def worker_pool() -> BufferPool:
    """This process's pool (a forked process starts with an empty one)."""
    return _pools.setdefault(os.getpid(), BufferPool())
