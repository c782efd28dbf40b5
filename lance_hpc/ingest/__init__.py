"""Ingest: sources (images, text, Parquet, JSON Lines, WebDataset, Hugging Face) written to Lance,
by one process or by the workers of an ingest job, each split committed once.

Training uses :func:`ensure_dataset`. It is loaded from its module when first used, so naming the
package costs nothing, and an ingest worker (:mod:`lance_hpc.ingest.write`) never imports
torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lance_hpc.imports import lazy_exports

_MODULE_OF = {"ensure_dataset": "lance_hpc.ingest.dataset"}

__all__ = ["ensure_dataset"]

__getattr__ = lazy_exports(__name__, _MODULE_OF)

if TYPE_CHECKING:
    from lance_hpc.ingest.dataset import ensure_dataset
