"""Functions an inference job's spec names in the tests (infer.function)."""

from __future__ import annotations

import time

import torch
from torch import nn


def slow_predict(model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model's prediction, a quarter of a second per batch: time to interrupt a job mid-way."""
    time.sleep(0.25)
    return {"predicted": model(batch["image"]).argmax(dim=1)}


def slow_predict_again(model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """:func:`slow_predict` under another column's name."""
    return {"predicted_again": slow_predict(model, batch)["predicted"]}


def label_twice(model: None, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """No model at all: twice each row's label."""
    return {"twice": batch["label"] * 2}
