"""Functions an inference job's spec names in the tests (infer.function)."""

from __future__ import annotations

import os
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


# When set, label_twice_failing fails on each rank's batch after this many (two per fragment here).
FAIL_AFTER_BATCHES = "LANCE_HPC_TEST_FAIL_AFTER_BATCHES"
_batches_seen = [0]


def label_twice_failing(model: None, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """:func:`label_twice`, failing part-way (with ``FAIL_AFTER_BATCHES`` set): the rank's first
    fragments are written, then it dies, as a model that breaks mid-job."""
    limit = os.environ.get(FAIL_AFTER_BATCHES)
    _batches_seen[0] += 1
    if limit is not None and _batches_seen[0] > int(limit):
        raise RuntimeError(f"label_twice_failing: failing at batch {_batches_seen[0]}, as the test asked")
    return label_twice(model, batch)


def label_twice_under_many_names(model: None, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """:func:`label_twice` under every name the refusal tests give infer.outputs, so that nothing
    but the name itself can stop the job."""
    twice = label_twice(model, batch)["twice"]
    return {name: twice for name in ("twice", "label", "_rowid", "_rowoffset", "_mine")}


def label_twice_but_not_sevens(model: None, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """:func:`label_twice`, raising the user's own error on a batch that holds a 7."""
    if (batch["label"] == 7).any():
        raise ValueError("no twice for a 7")
    return label_twice(model, batch)
