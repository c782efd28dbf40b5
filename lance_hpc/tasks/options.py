"""What ``task.options`` may hold: :class:`TaskOptions`, the base of every task's options, and the
options of the built-in tasks with their checks, in a module that imports neither torch nor the
tasks. A spec is validated here, so the commands that read one (submit, plan, status, logs,
cancel) start without the second or more that importing torch takes, on a login node often longer.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from lance_hpc.imports import is_import_path
from lance_hpc.tasks.formats import TOKENS_COLUMN

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
# Training augmentations by name; evaluation always resizes (and, unless "none", centre-crops).
AUGMENTS = ("crop_flip", "crop", "none")
# The image models lance_hpc builds itself (lance_hpc.tasks.models.BUILT_IN).
BUILT_IN_MODELS = ("small_cnn",)


class TaskOptions(BaseModel):
    """Base of every task's options: frozen, unknown keys refused (reported as task.options.KEY),
    floats finite: a .nan or .inf option would pass here and then fail on every rank."""

    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True, protected_namespaces=(), allow_inf_nan=False)


def torchvision_models() -> list[str]:
    """Names of torchvision's classification models: torchvision (and torch) imported only when a
    spec names a model that is neither built in nor an import path."""
    import torchvision

    return torchvision.models.list_models(module=torchvision.models)


def model_problem(name: str) -> str | None:
    """Why ``name`` names no image classifier, or None when it does (import paths load later)."""
    if name in BUILT_IN_MODELS or is_import_path(name):
        return None
    known = torchvision_models()
    if name in known:
        return None
    return (
        f"unknown model {name!r}; use small_cnn, a torchvision classification model "
        f"({', '.join(known[:6])}, ... {len(known)} in all), or a factory by import path (my_pkg.models:build)"
    )


def channels_problem(name: str, channels: int) -> str | None:
    """Why model ``name`` cannot take ``channels`` input channels, or None."""
    if channels == 3 or name in BUILT_IN_MODELS or is_import_path(name):
        return None
    return (
        f"model {name} (torchvision) takes 3 channels, not {channels}; use small_cnn or your own factory "
        f"(my_pkg.models:build, called with channels={channels}), or set channels: 3"
    )


# Upper bounds of the options: past them a spec would pass validation and then fail on every rank
# allocating its batches or its model. 4096 px a side is 48 MiB per uint8 image, well past any
# classifier's input; 2**24 classes is far past the largest label sets in use.
MAX_IMAGE_SIZE = 4096
MAX_CLASSES = 2**24


class ImageOptions(TaskOptions):
    image_column: str = Field("image", description="Column of encoded image bytes (JPEG, PNG, ...).")
    label_column: str = Field("label", description="Column of integer class labels.")
    image_size: int = Field(224, ge=8, le=MAX_IMAGE_SIZE, description="Side of the square images the model sees.")
    augment: str = Field("crop_flip", description=f"Training augmentation: {', '.join(AUGMENTS)}.")
    model: str = Field("resnet18", description="small_cnn, a torchvision classification model, or my_pkg.models:build.")
    num_classes: int | None = Field(None, ge=2, le=MAX_CLASSES, description="Classes; null reads them from the dataset.")
    channels_last: bool = Field(True, description="Channels-last memory format on GPU (faster convolutions).")
    channels: Literal[1, 3] = Field(3, description="3 (RGB) or 1 (grey levels, BT.601 luma): the channels the model sees.")
    mean: list[float] | None = Field(
        None, description="Per-channel mean of pixels in [0, 1] subtracted on the device; null: ImageNet's (3 channels) or 0.5."
    )
    std: list[float] | None = Field(
        None, description="Per-channel standard deviation the pixels are divided by; null: ImageNet's (3 channels) or 0.5."
    )
    weights: str | None = Field(
        None,
        description="Initial weights from a local file (a state_dict saved with torch.save, or a lance_hpc checkpoint); "
        "never downloaded; a resumed job takes its checkpoint's instead.",
    )

    @model_validator(mode="after")
    def _fits_the_channels(self) -> ImageOptions:
        for name in ("mean", "std"):
            values = getattr(self, name)
            if values is not None and len(values) != self.channels:
                raise ValueError(f"{name} has {len(values)} value(s) for {self.channels} channel(s): give one per channel")
        if self.std is not None and any(value <= 0 for value in self.std):
            raise ValueError("std values must be greater than 0")
        problem = channels_problem(self.model, self.channels)
        if problem:
            raise ValueError(problem)
        return self

    def normalization(self) -> tuple[list[float], list[float]]:
        """(mean, std) per channel, defaults filled in."""
        default_mean, default_std = (list(IMAGENET_MEAN), list(IMAGENET_STD)) if self.channels == 3 else ([0.5], [0.5])
        return self.mean or default_mean, self.std or default_std

    @field_validator("augment")
    @classmethod
    def _known_augment(cls, value: str) -> str:
        if value not in AUGMENTS:
            raise ValueError(f"unknown augment {value!r}: use one of {', '.join(AUGMENTS)}")
        return value

    @field_validator("model")
    @classmethod
    def _known_model(cls, value: str) -> str:
        problem = model_problem(value)
        if problem:
            raise ValueError(problem)
        return value


# Upper bounds of the gpt options: past them a spec would pass validation and then fail on every
# rank allocating the model. Each is far past the largest transformers trained; a vocabulary of
# 2**24 ids still fits the int32 token column with room to spare.
MAX_LAYERS = 1024
MAX_WIDTH = 65536
MAX_HEADS = 1024
MAX_VOCAB_SIZE = 2**24


class LanguageModelOptions(TaskOptions):
    tokens_column: str = Field(TOKENS_COLUMN, description="Column of fixed-length token sequences (sequence_length + 1 each).")
    model: str = Field("gpt", description="gpt (built in), or a factory by import path: build(vocab_size, sequence_length).")
    layers: int = Field(4, ge=1, le=MAX_LAYERS, description="gpt: transformer blocks.")
    width: int = Field(256, ge=8, le=MAX_WIDTH, description="gpt: embedding width (a multiple of heads).")
    heads: int = Field(4, ge=1, le=MAX_HEADS, description="gpt: attention heads.")
    dropout: float = Field(0.0, ge=0, lt=1, description="gpt: dropout in attention and MLP.")
    vocab_size: int | None = Field(
        None, ge=2, le=MAX_VOCAB_SIZE, description="Vocabulary size; null reads it from the dataset's metadata."
    )


class ColumnsOptions(TaskOptions):
    columns: list[str] = Field(
        min_length=1, description="The columns each batch carries, as tensors (numbers, fixed-size lists) or lists."
    )

    @field_validator("columns")
    @classmethod
    def _distinct(cls, value: list[str]) -> list[str]:
        repeated = sorted({name for name in value if value.count(name) > 1})
        if repeated:
            raise ValueError(f"column(s) named more than once: {', '.join(repeated)}")
        return value
