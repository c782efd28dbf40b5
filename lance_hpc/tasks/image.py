"""``image_classification``: encoded images and integer labels in, a classifier trained with
cross-entropy out; top-1 accuracy reported.

Workers decode JPEG with libjpeg-turbo (other formats through PIL) and resize with torch's uint8
kernel straight into the batch, which is uint8 ``[B, 3, S, S]`` in channels-last memory; the rank
normalises on the device (4x fewer bytes cross to it than float pixels would).
"""

from __future__ import annotations

import json
import re

import numpy as np
import pyarrow as pa
import torch
from torch import nn

from lance_hpc.tasks.base import (
    Batch,
    DatasetInfo,
    Decoder,
    FieldSpec,
    Task,
    TaskError,
    column_problems,
)
from lance_hpc.tasks.formats import CLASS_NAMES_KEY
from lance_hpc.tasks.image_decode import (
    Transform,
    binary_values,
    decode_pixels,
    normalize,
    to_grey,
)
from lance_hpc.tasks.models import build_model
from lance_hpc.tasks.options import ImageOptions


class ImageDecoder(Decoder):
    """Worker half: decode, crop/resize (seeded per batch), label as int64."""

    def __init__(self, image_column: str, label_column: str, transform: Transform, channels: int = 3) -> None:
        self.image_column, self.label_column, self.transform = image_column, label_column, transform
        self.columns = (image_column, label_column)
        self.channels = channels

    def fields(self) -> dict[str, FieldSpec]:
        size = self.transform.image_size
        # channels-last lets a decoded H x W x 3 image be copied as it is; one channel has no such order
        order = (1, 2, 0) if self.channels == 3 else None
        return {
            "image": FieldSpec((self.channels, size, size), torch.uint8, memory_order=order),
            "label": FieldSpec((), torch.int64),
        }

    def decode(self, table: pa.Table, out: Batch, rng: np.random.Generator) -> dict[int, str]:
        values, offsets, valid = binary_values(table.column(self.image_column))
        labels = table.column(self.label_column)
        out["label"].copy_(torch.from_numpy(labels.to_numpy(zero_copy_only=False).astype(np.int64)))
        images, bad = out["image"], {}
        for index in range(table.num_rows):
            try:
                if not valid[index]:
                    raise ValueError("null image")
                image = self.transform(decode_pixels(values[offsets[index] : offsets[index + 1]]), rng)
                images[index].copy_(to_grey(image) if self.channels == 1 else image)
            except ValueError as error:
                bad[index] = str(error)
        return bad


class ImageClassification(Task[ImageOptions]):
    """Cross-entropy over ``num_classes``; reports loss and top-1 accuracy."""

    Options = ImageOptions
    metrics = ("loss_sum", "correct", "samples")
    tags = {
        "train/loss": "mean training loss since the previous log point, over all ranks",
        "train/accuracy": "top-1 training accuracy since the previous log point, over all ranks",
        "val/loss": "validation loss over the whole validation set",
        "val/accuracy": "top-1 validation accuracy over the whole validation set",
    }
    headline_metric = "accuracy"

    def __init__(self, options: ImageOptions, train: DatasetInfo, val: DatasetInfo | None = None) -> None:
        super().__init__(options, train, val)
        problems = []
        for info in filter(None, (train, val)):
            problems += column_problems(
                info,
                "image_column",
                options.image_column,
                "binary (encoded images)",
                lambda kind: pa.types.is_binary(kind) or pa.types.is_large_binary(kind),
            )
            problems += column_problems(
                info, "label_column", options.label_column, "integers (class labels)", pa.types.is_integer
            )
        if problems:
            raise TaskError("image_classification", problems)
        self.class_names = class_names(train, options.label_column)
        if options.num_classes is not None and options.num_classes < len(self.class_names):
            raise TaskError(
                "image_classification",
                [
                    f"task.options.num_classes is {options.num_classes}, but {train.uri} has {len(self.class_names)} "
                    f"classes (labels 0..{len(self.class_names) - 1}); labels past {options.num_classes - 1} would be out "
                    f"of range\n      fix: remove num_classes to read it from the dataset, or set it to at least "
                    f"{len(self.class_names)}"
                ],
            )
        self.num_classes = options.num_classes or len(self.class_names)

    def decoder(self, train: bool) -> ImageDecoder:
        transform = Transform(self.options.image_size, train=train, augment=self.options.augment)
        return ImageDecoder(self.options.image_column, self.options.label_column, transform, self.options.channels)

    def build_model(self) -> nn.Module:
        return build_model(self.options.model, self.num_classes, self.options.channels)

    def weights_file(self) -> str | None:
        return self.options.weights

    def blocks(self, model: nn.Module) -> list[nn.Module] | None:
        """A ResNet's stages (layer1 ... layer4); other models: lance_hpc's choice."""
        stages = [module for name, module in model.named_children() if re.fullmatch(r"layer\d+", name)]
        return stages or None

    def _memory_format(self, device: torch.device) -> torch.memory_format:
        channels_last = device.type == "cuda" and self.options.channels_last
        return torch.channels_last if channels_last else torch.contiguous_format

    def prepare_model(self, model: nn.Module, device: torch.device) -> nn.Module:
        return model.to(device).to(memory_format=self._memory_format(device))

    def to_device(self, batch: Batch, device: torch.device) -> Batch:
        mean, std = self.options.normalization()
        images = normalize(batch["image"].to(device, non_blocking=True), mean, std)
        return {
            "image": images.contiguous(memory_format=self._memory_format(device)),
            "label": batch["label"].to(device, non_blocking=True),
        }

    def forward(self, model: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        logits, labels = model(batch["image"]), batch["label"]
        loss = nn.functional.cross_entropy(logits, labels)
        count = torch.tensor(float(labels.numel()), device=labels.device)
        correct = (logits.detach().argmax(dim=1) == labels).sum().float()
        return loss, torch.stack([loss.detach().float() * count, correct, count])

    def report(self, sums: dict[str, float], prefix: str, seconds: float | None = None) -> dict[str, float]:
        samples = max(sums["samples"], 1.0)
        return {f"{prefix}/loss": sums["loss_sum"] / samples, f"{prefix}/accuracy": sums["correct"] / samples}

    # embedding: the input of the model's last linear layer (the penultimate features); score: the
    # top class's softmax probability; loss: each row's cross-entropy against its label
    outputs = ("embedding", "logits", "predicted", "score", "loss")

    def infer(self, model: nn.Module, batch: Batch) -> dict[str, torch.Tensor]:
        head = [module for module in model.modules() if isinstance(module, nn.Linear)]
        if not head:
            raise TaskError("image_classification", ["the model has no linear layer, so no penultimate features to embed"])
        features: list[torch.Tensor] = []
        hook = head[-1].register_forward_pre_hook(lambda module, args: features.append(args[0]))
        try:
            logits = model(batch["image"])
        finally:
            hook.remove()
        probabilities = torch.softmax(logits.float(), dim=1)
        return {
            "embedding": features[-1].flatten(1),
            "logits": logits,
            "predicted": logits.argmax(dim=1),
            "score": probabilities.max(dim=1).values,
            "loss": nn.functional.cross_entropy(logits.float(), batch["label"], reduction="none"),
        }


def class_names(info: DatasetInfo, label_column: str) -> list[str]:
    """Class names from the schema metadata that ingest writes; else "0".."max label"."""
    names = info.metadata.get(CLASS_NAMES_KEY.decode())
    if names is not None:
        return [str(name) for name in json.loads(names)]
    if info.dataset is None:
        raise TaskError("image_classification", [f"{info.uri} records no class names and is not open to count its labels"])
    labels = info.dataset.to_table(columns=[label_column]).column(label_column)
    top = labels.to_numpy().max() if len(labels) else -1
    return [str(label) for label in range(int(top) + 1)]
