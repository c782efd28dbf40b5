"""Where checkpoints are kept: a local directory (:mod:`.local`), or a prefix on S3-compatible
object storage (:mod:`.objects`), both behind one interface (:class:`~.base.Store`).

A checkpoint.dir is opened once (:func:`open_store`) and the store handed to whatever saves,
loads, prunes or leases there: which kind of store it is matters only inside it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from lance_hpc.checkpoint.stores.base import SMALL_FILE_FIX, TEMP_SUFFIX, LeaseStore, Location, NoSpace, Store
from lance_hpc.checkpoint.stores.local import LocalDirectory
from lance_hpc.checkpoint.stores.objects import ObjectStore
from lance_hpc.errors import UserError
from lance_hpc.spec.choices import check_registry
from lance_hpc.storage.options import CHECKPOINT_SCHEMES, unsupported

__all__ = [
    "SMALL_FILE_FIX",
    "STORES",
    "TEMP_SUFFIX",
    "LeaseStore",
    "LocalDirectory",
    "Location",
    "NoSpace",
    "ObjectStore",
    "Store",
    "open_store",
]

# URI scheme -> store; a directory without a scheme is a LocalDirectory.
STORES: dict[str, Callable[[str], Store]] = {"s3": ObjectStore}
check_registry(STORES, CHECKPOINT_SCHEMES, "checkpoint.dir scheme")


def open_store(directory: str | Path) -> Store:
    """The store for a checkpoint.dir: a local directory, or an object store for a URI."""
    problem = unsupported(directory)
    if problem:
        raise UserError(f"checkpoint.dir {directory}: {problem}")
    scheme, separator, _ = str(directory).partition("://")
    return STORES[scheme](str(directory)) if separator else LocalDirectory(directory)
