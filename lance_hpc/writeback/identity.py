"""What produces a write-back's values, in its run's key: the code, not only its name.

A run's fragments are kept across reruns, so they must all come from the same code: the digest of
the source file of ``infer.function``'s module (the file of a ``file.py:name`` path), and the
checkpoint's identity (the digest of its step's manifest, written once per save: another save at
the same step is another checkpoint). Both go into the run's key; the rest of the key (the
dataset, the columns, the names: :func:`lance_hpc.writeback.new_columns.run_key`) names the job.
A rerun whose code changed is another run of the same job, which discards the earlier runs'
uncommitted fragments (:mod:`lance_hpc.writeback.earlier_runs`).
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import json
from pathlib import Path
from typing import Mapping

from lance_hpc.checkpoint.manifests import MANIFEST_BYTES, latest, manifest_name
from lance_hpc.checkpoint.stores import open_store
from lance_hpc.spec import JobSpec


def _digest(payload: bytes) -> str:
    return hashlib.blake2b(payload, digest_size=8).hexdigest()


def source_file(function: str) -> Path | None:
    """The file that defines ``function`` (``module:name`` or ``file.py:name``), found on sys.path
    as the import would find it, without importing anything (``lance-hpc status`` imports no
    user code); None when it is not a file (a namespace, a compiled module) or is not found (the
    import says why, later)."""
    module = function.rpartition(":")[0]
    if module.endswith(".py"):
        return Path(module).resolve()
    parts, search = module.split("."), None
    found = None
    for depth, part in enumerate(parts):
        try:
            found = importlib.machinery.PathFinder.find_spec(part, search)
        except (ImportError, ValueError):
            return None
        if found is None:
            return None
        if depth < len(parts) - 1:
            search = list(found.submodule_search_locations or [])
    origin = found.origin if found is not None else None
    return Path(origin) if origin and Path(origin).is_file() else None


def code(spec: JobSpec) -> dict[str, str]:
    """Digests of what produces the values: the function's source file, the checkpoint's manifest."""
    assert spec.infer is not None
    found = {}
    if spec.infer.function:
        file = source_file(spec.infer.function)
        found["function"] = _digest(file.read_bytes()) if file is not None and file.is_file() else ""
    if spec.infer.checkpoint is not None:
        store = open_store(spec.infer.checkpoint)
        saved = latest(store)
        try:
            manifest = store.read_bytes(manifest_name(saved.step), MANIFEST_BYTES) if saved else b""
        except OSError:  # a checkpoint saved before manifests: its step, which the name holds, is all
            manifest = b""
        found["checkpoint"] = _digest(manifest)
    return found


def with_code(job: str, produced_by: Mapping[str, str]) -> str:
    """The run's key: the job's key and what produces the values."""
    return _digest(json.dumps({"job": job, "code": dict(produced_by)}, sort_keys=True).encode())
