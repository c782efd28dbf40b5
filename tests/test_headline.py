"""The one line a validation ends with (``Task.headline``): each metric by its short name, with its
prefix only where two would print the same."""

from __future__ import annotations

from types import SimpleNamespace

from lance_hpc.tasks.base import Task


def headline(metrics: dict[str, float], main: str = "perplexity") -> str:
    return Task.headline(SimpleNamespace(headline_metric=main), metrics)  # type: ignore[arg-type]


def test_two_metrics_of_one_name_keep_their_prefixes() -> None:
    line = headline({"val/perplexity": 21.5, "train/loss": 3.067, "val/loss": 3.165})
    assert line == "perplexity: 21.5000 (train/loss 3.067, val/loss 3.165)"


def test_metrics_of_distinct_names_print_without_prefixes() -> None:
    assert headline({"val/accuracy": 0.99, "val/loss": 0.0243}, "accuracy") == "accuracy: 0.9900 (loss 0.0243)"
