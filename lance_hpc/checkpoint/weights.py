"""A model's initial weights from a file (``task.options.weights``): a state dict saved with
``torch.save``, or a lance_hpc checkpoint file, whose layout only this package knows."""

from __future__ import annotations

from typing import Any

from torch import nn

from lance_hpc.errors import UserError


def read_weights(path: str) -> Any:
    """The state dict in ``path``: the file itself, or the registered ``model`` of a lance_hpc
    checkpoint (or of the earlier built-in trainer's). Read with weights_only, so the file runs no code."""
    import torch

    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise UserError(
            f"task.options.weights: {path} does not exist\n  fix: give the path of a file every node "
            "can read (a shared file system), or remove task.options.weights"
        ) from None
    except Exception as error:
        raise UserError(
            f"task.options.weights: cannot read {path}: {type(error).__name__}: {error}\n"
            "  fix: save the weights with torch.save(model.state_dict(), path)"
        ) from None
    if isinstance(saved, dict) and isinstance(saved.get("objects"), dict) and "model" in saved["objects"]:
        return saved["objects"]["model"]  # a lance_hpc checkpoint
    if isinstance(saved, dict) and isinstance(saved.get("model"), dict):
        return saved["model"]  # a checkpoint of the earlier built-in trainer
    return saved


def load_weights(model: nn.Module, path: str) -> None:
    """Load the weights in ``path`` (:func:`read_weights`) into ``model``; a UserError when they do not fit it."""
    saved = read_weights(path)
    try:
        model.load_state_dict(saved)
    except (RuntimeError, TypeError, AttributeError) as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise UserError(
            f"task.options.weights: {path} does not fit this model: {first}\n"
            "  fix: point it at weights saved from the same model (task.options.model, channels, "
            "num_classes)"
        ) from None
