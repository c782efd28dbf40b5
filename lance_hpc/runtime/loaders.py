"""A rank's loaders, as ``ctx.train_loader()`` and ``ctx.eval_loader()`` build them: training
batches from the data a resumed job pinned, evaluation batches in equal numbers on every rank of a
sharded model."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist

from lance_hpc import loading
from lance_hpc.checkpoint.resuming import Checkpoint
from lance_hpc.loading import EvalLoader, TrainLoader, selection
from lance_hpc.runtime.environment import DistEnv
from lance_hpc.spec import DataSpec, TrainSpec
from lance_hpc.tasks import Batch, Decoder


def train_loader(data: DataSpec, resumed: Checkpoint | None, decoder: Decoder, env: DistEnv, device: torch.device) -> TrainLoader:
    """This rank's training batches with the spec's strategy, from the dataset versions ``resumed`` read."""
    return loading.build_train_loader(
        selection.pinned_data(data, resumed),
        decoder,
        env.rank,
        env.world_size,
        pin_memory=device.type == "cuda",
    )


def eval_loader(
    data: DataSpec, train: TrainSpec, decoder: Decoder, uri: str | None, env: DistEnv, device: torch.device
) -> Iterable[Batch]:
    """This rank's share of data.val_uri (or of ``uri``); under fsdp, collective: as many batches as
    the rank with the most (see :class:`EqualBatches`)."""
    loader = loading.build_eval_loader(
        data if uri is None else data.model_copy(update={"val_uri": uri}),
        decoder,
        env.rank,
        env.world_size,
        pin_memory=device.type == "cuda",
    )
    if train.parallelism != "fsdp":
        return loader
    most = torch.tensor([len(loader)], dtype=torch.int64, device=device)
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    return EqualBatches(loader, int(most.item()), decoder)


class EqualBatches:
    """An evaluation loader followed by batches of no rows, ``count`` batches in all: every rank of a
    sharded model runs as many forward passes."""

    def __init__(self, loader: EvalLoader, count: int, decoder: Decoder) -> None:
        self.loader, self.count, self.decoder = loader, count, decoder

    def __len__(self) -> int:
        return self.count

    def __iter__(self) -> Iterator[Batch]:
        yield from self.loader
        for _ in range(self.count - len(self.loader)):
            yield self.decoder.empty_batch()
