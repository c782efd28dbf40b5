"""The pipelines the benchmark measures, by name: the peers a user would otherwise pick, and
lance_hpc's own strategies. Each builder returns an iterable of batches; :func:`batch_images`
finds the uint8 or float image tensor in whatever a pipeline yields.

The peers are written the way their documentation shows them (the reference map-style and
iterable pipelines of the lance-distributed-training example, torchvision's ImageFolder), with
the same batch size, output size and worker count as lance_hpc, so the ratios compare loaders,
not settings.
"""

from __future__ import annotations

import io
from typing import Any, Callable, Iterable

from lance_hpc.bench.configs import Measurement

Builder = Callable[[Measurement], Iterable[Any]]


def pil_transform(image_size: int) -> Any:
    """The peers' per-image transform: resize to a square, then to a float tensor."""
    from torchvision import transforms

    return transforms.Compose([transforms.Resize((image_size, image_size)), transforms.ToTensor()])


class PilCollate:
    """Collate for SafeLanceDataset rows (dicts): PIL open, convert, resize, to tensor, stack.

    A class rather than a closure so DataLoader workers in other processes can unpickle it."""

    def __init__(self, image_size: int) -> None:
        self.image_size = image_size
        self._transform = None

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        import torch
        from PIL import Image

        if self._transform is None:
            self._transform = pil_transform(self.image_size)
        images = [self._transform(Image.open(io.BytesIO(row["image"])).convert("RGB")) for row in rows]
        return {"image": torch.stack(images), "label": torch.tensor([row["label"] for row in rows], dtype=torch.long)}


class PilToTensor:
    """``to_tensor_fn`` for pylance's LanceDataset: the same PIL path over an Arrow record batch."""

    def __init__(self, image_size: int) -> None:
        self.collate = PilCollate(image_size)

    def __call__(self, batch: Any, **_: Any) -> dict[str, Any]:
        return self.collate(batch.to_pylist())


def reference_map_style(config: Measurement) -> Iterable[Any]:
    """pylance SafeLanceDataset + DistributedSampler + get_safe_loader + PIL collate."""
    import torch
    from lance.torch.data import SafeLanceDataset, get_safe_loader
    from torch.utils.data.distributed import DistributedSampler

    dataset = SafeLanceDataset(config.lance_uri)
    sampler = DistributedSampler(dataset, num_replicas=config.world_size, rank=config.rank, shuffle=True, seed=0)
    return get_safe_loader(
        dataset,
        batch_size=config.batch_size,
        sampler=sampler,
        num_workers=config.num_workers,
        collate_fn=PilCollate(config.image_size),
        pin_memory=torch.cuda.is_available(),
        persistent_workers=config.num_workers > 0,
    )


def reference_iterable(config: Measurement) -> Iterable[Any]:
    """pylance LanceDataset + ShardedBatchSampler + PIL to_tensor_fn, no workers."""
    from lance.sampler import ShardedBatchSampler
    from lance.torch.data import LanceDataset
    from torch.utils.data import DataLoader

    dataset = LanceDataset(
        config.lance_uri,
        batch_size=config.batch_size,
        to_tensor_fn=PilToTensor(config.image_size),
        sampler=ShardedBatchSampler(config.rank, config.world_size, randomize=True, seed=0),
    )
    return DataLoader(dataset, batch_size=None, num_workers=0)


def image_folder(config: Measurement) -> Iterable[Any]:
    """torchvision ImageFolder + DataLoader over the JPEG files (the default fork workers)."""
    import torch
    from torch.utils.data import DataLoader
    from torchvision.datasets import ImageFolder

    dataset = ImageFolder(config.folder, transform=pil_transform(config.image_size))
    return DataLoader(
        dataset,
        batch_size=config.batch_size,
        shuffle=True,
        num_workers=config.num_workers,
        pin_memory=torch.cuda.is_available(),
        persistent_workers=config.num_workers > 0,
    )


def lance_hpc_loader(config: Measurement) -> Iterable[Any]:
    """lance_hpc's build_train_loader for the strategy in ``config.data``, with the image task's
    decoder at the configuration's size and augmentation (resize only unless a job asks for more)."""
    from lance_hpc.data import build_train_loader
    from lance_hpc.data.decode import Transform
    from lance_hpc.spec import DataSpec
    from lance_hpc.tasks.image import ImageDecoder

    world_size = config.data_world_size or config.world_size
    decoder = ImageDecoder(config.image_column, config.label_column,
                           Transform(config.image_size, train=True, augment=config.augment))
    loader = build_train_loader(DataSpec.model_validate(config.data), decoder, config.rank, world_size)
    loader.set_epoch(0)
    return loader


PIPELINES: dict[str, Builder] = {
    "reference_map": reference_map_style,
    "reference_iterable": reference_iterable,
    "image_folder": image_folder,
    "lance_hpc": lance_hpc_loader,
}


def import_modules(config: Measurement) -> None:
    """Import what the pipeline needs before the clock starts: a training script has torch,
    torchvision and its data library loaded long before it asks for the first batch."""
    import lance  # noqa: F401
    import torch  # noqa: F401
    import torchvision  # noqa: F401

    if config.kind == "lance_hpc":
        import lance_hpc.data  # noqa: F401
    else:
        import lance.torch.data  # noqa: F401


def build_pipeline(config: Measurement) -> Iterable[Any]:
    """The pipeline named by ``config.kind``; an unknown name lists the valid ones."""
    try:
        builder = PIPELINES[config.kind]
    except KeyError:
        raise ValueError(f"unknown pipeline {config.kind!r}: valid names are {', '.join(sorted(PIPELINES))}") from None
    return builder(config)


def batch_images(batch: Any) -> Any:
    """The image tensor of a batch: ``(images, labels)``, ``[images, labels]`` or a dict with an
    ``"image"`` field (the peers' collates and lance_hpc's batches)."""
    if isinstance(batch, dict):
        return batch["image"]
    return batch[0]
