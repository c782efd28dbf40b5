"""Models by name: a small CNN for tests and demos, and torchvision's ResNets (never pretrained)."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from lance_hpc.errors import UserError


def small_cnn(num_classes: int) -> nn.Module:
    """Three conv-BN-ReLU blocks and a linear head: trains on small images in seconds on a CPU."""

    def block(inputs: int, outputs: int) -> list[nn.Module]:
        return [nn.Conv2d(inputs, outputs, 3, padding=1, bias=False), nn.BatchNorm2d(outputs), nn.ReLU(inplace=True)]

    return nn.Sequential(
        *block(3, 32),
        nn.MaxPool2d(2),
        *block(32, 64),
        nn.MaxPool2d(2),
        *block(64, 128),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(128, num_classes),
    )


def _torchvision(name: str) -> Callable[[int], nn.Module]:
    def build(num_classes: int) -> nn.Module:
        import torchvision  # here, not at the top: DataLoader workers import the rank's main module

        return getattr(torchvision.models, name)(weights=None, num_classes=num_classes)

    return build


MODELS: dict[str, Callable[[int], nn.Module]] = {
    "small_cnn": small_cnn,
    "resnet18": _torchvision("resnet18"),
    "resnet34": _torchvision("resnet34"),
    "resnet50": _torchvision("resnet50"),
}


def build_model(arch: str, num_classes: int) -> nn.Module:
    """A freshly initialised model; an unknown name lists the valid ones."""
    try:
        factory = MODELS[arch]
    except KeyError:
        raise UserError(f"unknown model.arch '{arch}'\n  fix: use one of: {', '.join(MODELS)}") from None
    return factory(num_classes)
