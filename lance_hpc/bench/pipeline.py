"""The pipeline a job benchmark measures: lance_hpc's own loader for a job's data spec and image
task, built the way the trainer builds it, and the image tensor of a batch."""

from __future__ import annotations

import os
import shutil
from typing import Any, Iterable

from lance_hpc.bench.configs import Measurement


def lance_hpc_loader(config: Measurement) -> Iterable[Any]:
    """lance_hpc's build_train_loader for the strategy in ``config.data``, with the image task's
    decoder at the configuration's size and augmentation (resize only unless a job asks for more)."""
    from lance_hpc.loading import build_train_loader
    from lance_hpc.spec import DataSpec
    from lance_hpc.tasks.image import ImageDecoder
    from lance_hpc.tasks.image_decode import Transform

    world_size = config.data_world_size or config.world_size
    decoder = ImageDecoder(
        config.image_column, config.label_column, Transform(config.image_size, train=True, augment=config.augment)
    )
    data = dict(config.data)
    if data.get("cache"):  # a node-local cache of its own, empty: the warm-up epochs fill it
        data["cache"] = {**data["cache"], "dir": fresh_directory(data["cache"]["dir"])}
    pinned = bool(config.train_model) and config.device.startswith("cuda")  # as the trainer feeds a GPU
    loader = build_train_loader(DataSpec.model_validate(data), decoder, config.rank, world_size, pin_memory=pinned)
    for epoch in range(config.warmup_epochs):
        loader.set_epoch(epoch)
        for _ in loader:
            pass
    loader.set_epoch(config.warmup_epochs)
    return loader


def fresh_directory(parent: str) -> str:
    """A cache directory for this measurement, empty: every measurement starts cold. A new one each
    time (the process id under ``parent``, emptied of earlier measurements' copies), so no state a
    loader keeps by its cache's path (MDS's shared memory) can outlive an earlier measurement's files."""
    shutil.rmtree(parent, ignore_errors=True)
    return os.path.join(parent, str(os.getpid()))


def batch_images(batch: Any) -> Any:
    """The image tensor of a batch: ``(images, labels)``, ``[images, labels]`` or a dict with an
    ``"image"`` field (the peers' collates and lance_hpc's batches)."""
    if isinstance(batch, dict):
        return batch["image"]
    return batch[0]
