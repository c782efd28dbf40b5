"""Image classifiers by name: the built-in ``small_cnn``, any torchvision classification model
(``resnet50``, ``convnext_tiny``, ``vit_b_16``, ...; never pretrained), or a factory by import path
(``my_pkg.models:build``, called with ``num_classes``)."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from lance_hpc.errors import UserError
from lance_hpc.imports import is_import_path, load_callable


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


BUILT_IN: dict[str, Callable[[int], nn.Module]] = {"small_cnn": small_cnn}


def torchvision_models() -> list[str]:
    """Names of torchvision's classification models (imported here, not at the top: DataLoader
    workers import the rank's main module, and they never need torchvision)."""
    import torchvision

    return torchvision.models.list_models(module=torchvision.models)


def model_problem(name: str) -> str | None:
    """Why ``name`` names no image classifier, or None when it does (import paths load later)."""
    if name in BUILT_IN or is_import_path(name):
        return None
    known = torchvision_models()
    if name in known:
        return None
    return (f"unknown model {name!r}; use small_cnn, a torchvision classification model "
            f"({', '.join(known[:6])}, ... {len(known)} in all), or a factory by import path (my_pkg.models:build)")


def build_model(name: str, num_classes: int) -> nn.Module:
    """A freshly initialised classifier with ``num_classes`` outputs."""
    if name in BUILT_IN:
        return BUILT_IN[name](num_classes)
    if is_import_path(name):
        model = load_callable(name, "task.options.model")(num_classes=num_classes)
        if not isinstance(model, nn.Module):
            raise UserError(f"task.options.model: {name} returned a {type(model).__name__}, not a torch.nn.Module")
        return model
    problem = model_problem(name)
    if problem:
        raise UserError(f"task.options.model: {problem}")
    import torchvision

    return torchvision.models.get_model(name, weights=None, num_classes=num_classes)
