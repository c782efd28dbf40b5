"""The provenance a write-back job gives its columns, from its spec: what computed them and the
field metadata its commit sets (:mod:`lance_hpc.lineage.provenance` holds the document itself)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

from lance_hpc.checkpoint.manifests import latest, read_manifest
from lance_hpc.checkpoint.stores import open_store
from lance_hpc.lineage.provenance import PROVENANCE_KEY, Producer, absolute, column_document, encode, spec_digest, with_refresh

if TYPE_CHECKING:
    from lance_hpc.spec import JobSpec


def read_lineage(directory: str, step: int | None) -> dict[str, Any] | None:
    """The lineage in the manifest of ``step``'s checkpoint in ``directory`` (the latest when
    None); None when the manifest has none (written before lineage was recorded) or is gone."""
    store = open_store(directory)
    if step is None:
        saved = latest(store)
        if saved is None:
            return None
        step = saved.step
    found = read_manifest(store, step).get("lineage")
    return found if isinstance(found, dict) else None


def producer(spec: JobSpec, weights: str | None = None) -> Producer:
    """What the spec's job computes its columns with: the latest checkpoint of infer.checkpoint (by
    its name, nothing loaded), infer.function, or both; ``weights`` once the model is loaded."""
    assert spec.infer is not None
    checkpoint, step = None, None
    if spec.infer.checkpoint is not None:
        saved = latest(open_store(spec.infer.checkpoint))
        checkpoint, step = absolute(spec.infer.checkpoint), (saved.step if saved is not None else None)
    return Producer(spec.job, checkpoint, step, spec.infer.function, weights)


def commit_metadata(
    spec: JobSpec,
    made_by: Producer,
    *,
    version: int,
    run: str,
    rows: int,
    fragments: int,
    refreshed: Mapping[str, Mapping[str, Any]] | None = None,
) -> dict[str, dict[str, str]]:
    """The field metadata of each output the commit writes: a new provenance document for a column
    written whole, or, for a refresh (``refreshed``: each column's document so far), the document
    with one more refresh."""
    assert spec.infer is not None
    digest = spec_digest(spec.redacted_dict())
    trained = read_lineage(made_by.checkpoint, made_by.step) if made_by.checkpoint is not None else None
    found = {}
    for name in spec.infer.outputs:
        if refreshed is not None:
            document = with_refresh(
                refreshed[name], made_by, spec=digest, version=version, run=run, rows=rows, fragments=fragments
            )
        else:
            document = column_document(
                made_by,
                spec=digest,
                uri=spec.data.uri,
                version=version,
                filter=spec.infer.filter,
                run=run,
                rows=rows,
                fragments=fragments,
                trained=trained,
            )
        found[name] = {PROVENANCE_KEY: encode(document)}
    return found
