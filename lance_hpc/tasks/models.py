"""Image classifiers by name: the built-in ``small_cnn``, any torchvision classification model
(``resnet50``, ``convnext_tiny``, ``vit_b_16``, ...; never pretrained), or a factory by import path
(``my_pkg.models:build``, called with ``num_classes``, and ``channels`` when they are not 3)."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from lance_hpc.errors import UserError
from lance_hpc.imports import is_import_path, load_callable
from lance_hpc.tasks.options import BUILT_IN_MODELS, model_problem


def small_cnn(num_classes: int, channels: int = 3) -> nn.Module:
    """Three conv-BN-ReLU blocks and a linear head: trains on small images in seconds on a CPU."""

    def block(inputs: int, outputs: int) -> list[nn.Module]:
        return [nn.Conv2d(inputs, outputs, 3, padding=1, bias=False), nn.BatchNorm2d(outputs), nn.ReLU(inplace=True)]

    return nn.Sequential(
        *block(channels, 32),
        nn.MaxPool2d(2),
        *block(32, 64),
        nn.MaxPool2d(2),
        *block(64, 128),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(128, num_classes),
    )


BUILT_IN: dict[str, Callable[..., nn.Module]] = {"small_cnn": small_cnn}
assert tuple(BUILT_IN) == BUILT_IN_MODELS  # the names the options accept


def build_model(name: str, num_classes: int, channels: int = 3) -> nn.Module:
    """A freshly initialised classifier of ``channels``-channel images with ``num_classes`` outputs."""
    extra = {} if channels == 3 else {"channels": channels}
    if name in BUILT_IN:
        return BUILT_IN[name](num_classes, **extra)
    if is_import_path(name):
        factory = load_callable(name, "task.options.model")
        try:
            model = factory(num_classes=num_classes, **extra)
        except TypeError as error:
            if not extra or "channels" not in str(error):
                raise
            raise UserError(
                f"task.options.model: {name} takes no channels argument ({error})\n"
                "  fix: give it a channels parameter (def build(num_classes, channels=3)), or set "
                "task.options.channels: 3"
            ) from None
        if not isinstance(model, nn.Module):
            raise UserError(f"task.options.model: {name} returned a {type(model).__name__}, not a torch.nn.Module")
        return model
    problem = model_problem(name)
    if problem:
        raise UserError(f"task.options.model: {problem}")
    import torchvision

    return torchvision.models.get_model(name, weights=None, num_classes=num_classes)
