"""A column's provenance: one JSON document in the field metadata of each column lance_hpc writes.

The document names what computed the column (the job kind; the checkpoint's directory, step and a
digest of its weights; or the function), a digest of the spec, the dataset and version the job
read, the rows and fragments it computed, the run and the time. A refresh that fills the rows
appended since adds an entry to its ``refreshes``. The document is written in the same commit as
the values (readers never see one without the other), so a column without it was not written by
lance_hpc (or was written before lance_hpc recorded provenance). Anyone who may write to the
dataset may set a column's field metadata: a document is checked against its shape
(:data:`lance_hpc.lineage.shapes.PROVENANCE_SHAPE`) when it is read, before any field is used.

Everything here reads and writes plain values; nothing imports Lance or torch at module level.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Mapping

import pyarrow as pa

from lance_hpc.errors import UserError
from lance_hpc.lineage.shapes import PROVENANCE_SHAPE, parse
from lance_hpc.output import printable

# The field-metadata key of the document (Lance keeps field metadata with the schema of a version).
PROVENANCE_KEY = "lance_hpc.provenance"
# A larger document is not one lance_hpc wrote (each refresh adds about 200 bytes to it).
PROVENANCE_BYTES = 1 << 22


class InvalidProvenance(UserError):
    """The provenance of ``column`` is not a document lance_hpc wrote; ``problem`` says why."""

    def __init__(self, column: str, problem: str) -> None:
        super().__init__(
            f"the provenance of column {printable(column)} is not a document lance_hpc wrote: {problem}\n"
            "  fix: compute the column again (infer.overwrite: true), or drop it"
        )
        self.column, self.problem = column, problem


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def absolute(uri: str) -> str:
    """A local path made absolute (the same dataset named from two directories is one dataset); an
    object-store URI as it is."""
    return uri if "://" in uri else os.path.abspath(uri)


@dataclass(frozen=True)
class Producer:
    """What computes a column: a kind of job with a checkpoint (its directory, step and weights),
    a function, or both (the function given the checkpoint's model)."""

    job: str
    checkpoint: str | None = None
    step: int | None = None
    function: str | None = None
    weights: str | None = None  # a digest of the model's tensors, known once they are loaded

    def describe(self) -> str:
        parts = []
        if self.checkpoint is not None:
            parts.append(f"checkpoint {self.checkpoint} step {self.step}")
        if self.function is not None:
            parts.append(f"function {self.function}")
        return f"job: {self.job}, " + (" with ".join(parts) or "no model")


def producer_of(document: Mapping[str, Any]) -> Producer:
    """The producer a provenance document records."""
    checkpoint = document.get("checkpoint") or {}
    return Producer(
        str(document.get("job", "infer")),
        checkpoint.get("dir"),
        checkpoint.get("step"),
        document.get("function"),
        checkpoint.get("weights"),
    )


def differs(document: Mapping[str, Any] | None, producer: Producer) -> str | None:
    """Why ``producer``'s values may not join a column whose provenance is ``document`` (None when
    they may): a column holds values of one model or function only."""
    if document is None:
        return "it has no record of what computed it (not written by lance_hpc, or before lance_hpc recorded provenance)"
    recorded = producer_of(document)
    reasons = []
    if recorded.checkpoint != producer.checkpoint:
        reasons.append(f"checkpoint {recorded.checkpoint or 'none'}, not {producer.checkpoint or 'none'}")
    elif recorded.step != producer.step:
        reasons.append(f"step {recorded.step} of {recorded.checkpoint}, not step {producer.step}")
    elif recorded.weights and producer.weights and recorded.weights != producer.weights:
        reasons.append(f"weights {recorded.weights}, not {producer.weights} (the checkpoint was rewritten)")
    if recorded.function != producer.function:
        own = "the task's own outputs"
        reasons.append(f"function {recorded.function or own}, not {producer.function or own}")
    if not reasons:
        return None
    return f"it was computed by {recorded.describe()}: " + "; ".join(reasons)


def column_document(
    producer: Producer,
    *,
    spec: str,
    uri: str,
    version: int,
    filter: str | None,
    run: str,
    rows: int,
    fragments: int,
    trained: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The provenance of a column written whole by one job; ``trained``: the lineage of its
    checkpoint (:mod:`lance_hpc.lineage.checkpoints`), kept here for when the checkpoint is pruned."""
    checkpoint = None
    if producer.checkpoint is not None:
        checkpoint = {"dir": producer.checkpoint, "step": producer.step, "weights": producer.weights, "lineage": trained}
    return {
        "job": producer.job,
        "checkpoint": checkpoint,
        "function": producer.function,
        "spec": spec,
        "dataset": {"uri": absolute(uri), "version": version},
        "filter": filter,
        "rows": rows,
        "fragments": fragments,
        "run": run,
        "written_at": now(),
        "refreshes": [],
    }


def with_refresh(
    document: Mapping[str, Any], producer: Producer, *, spec: str, version: int, run: str, rows: int, fragments: int
) -> dict[str, Any]:
    """``document`` with one more refresh: the version it read, the rows and fragments it filled."""
    entry = {
        "dataset_version": version,
        "rows": rows,
        "fragments": fragments,
        "spec": spec,
        "run": run,
        "weights": producer.weights,
        "written_at": now(),
    }
    return {**document, "refreshes": [*document.get("refreshes", []), entry]}


def encode(document: Mapping[str, Any]) -> str:
    return json.dumps(document, sort_keys=True, separators=(",", ":"))


def provenance_of(schema: pa.Schema, name: str) -> dict[str, Any] | None:
    """The provenance of column ``name`` (None when it has none, or there is no such column);
    :class:`InvalidProvenance` when its document is too large, not JSON or of the wrong shape."""
    if name not in schema.names:
        return None
    text = (schema.field(name).metadata or {}).get(PROVENANCE_KEY.encode())
    if text is None:
        return None
    if len(text) > PROVENANCE_BYTES:
        raise InvalidProvenance(name, f"it is larger than {PROVENANCE_BYTES:,} bytes")
    try:
        return parse(text, PROVENANCE_SHAPE)
    except ValueError as error:
        raise InvalidProvenance(name, str(error)) from None


def derived_columns(schema: pa.Schema) -> list[str]:
    """The columns of ``schema`` that lance_hpc computed (they carry a provenance document)."""
    return [item.name for item in schema if PROVENANCE_KEY.encode() in (item.metadata or {})]


def runs_of(document: Mapping[str, Any]) -> set[str]:
    """The runs that wrote a column: the one that wrote it whole and each that refreshed it."""
    return {str(document.get("run"))} | {str(entry.get("run")) for entry in document.get("refreshes", [])}


def spec_digest(spec: Mapping[str, Any]) -> str:
    """A digest of a spec (as a dict, credentials redacted): equal specs, equal digests."""
    return hashlib.sha256(json.dumps(spec, sort_keys=True, default=str).encode()).hexdigest()[:16]


def weights_digest(state: Mapping[str, Any]) -> str:
    """A digest of a model's state dict: each tensor's name, type, shape and bytes, in name order;
    the same weights give the same digest on any machine and in any memory layout."""
    import torch

    digest = hashlib.blake2b(digest_size=16)
    for name in sorted(state):
        value = state[name]
        digest.update(name.encode())
        if isinstance(value, torch.Tensor):
            tensor = value.detach().to("cpu").contiguous()
            digest.update(f"{tensor.dtype}{tuple(tensor.shape)}".encode())
            digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
        else:
            digest.update(repr(value).encode())
    return "blake2b:" + digest.hexdigest()


__all__ = [
    "PROVENANCE_BYTES",
    "PROVENANCE_KEY",
    "InvalidProvenance",
    "Producer",
    "absolute",
    "column_document",
    "derived_columns",
    "differs",
    "encode",
    "producer_of",
    "provenance_of",
    "runs_of",
    "spec_digest",
    "weights_digest",
    "with_refresh",
]
