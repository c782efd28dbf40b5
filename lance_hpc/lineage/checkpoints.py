"""A checkpoint's lineage: the data it was trained on and the spec, kept in its manifest.

The trainer pins the dataset versions (the one a tag named at the first start), filters and mix
sources of a run in the checkpoint itself, so that a resumed run reads the same rows. The
manifest beside each checkpoint copies them, with local paths made absolute and a digest of the
spec, so that ``lance-hpc lineage`` and the provenance of the columns a checkpoint computes read
them without loading the checkpoint.
"""

from __future__ import annotations

from typing import Any, Mapping

from lance_hpc.lineage.provenance import absolute, spec_digest


def checkpoint_lineage(spec: Mapping[str, Any], pinned: Mapping[str, Any] | None) -> dict[str, Any]:
    """The lineage of a checkpoint of a run of ``spec`` (its redacted dict) that pinned ``pinned``
    (the loader's: one dataset, or a mix's sources): what it was trained and validated on, and by
    what: the spec's ``entry`` (a loop of its own, None for the built-in trainer) and its task (for
    an entry, maybe only the decoder of its rows: ``columns``)."""
    data = spec.get("data") or {}
    if pinned and pinned.get("sources"):
        sources = [dict(source) for source in pinned["sources"]]
    elif pinned and pinned.get("uri"):
        sources = [dict(pinned)]
    else:
        sources = [{"uri": data.get("uri"), "version": data.get("version"), "tag": data.get("tag"), "filter": data.get("filter")}]
    for source in sources:
        if source.get("uri"):
            source["uri"] = absolute(str(source["uri"]))
    return {
        "trained_on": sources,
        "validated_on": absolute(str(data["val_uri"])) if data.get("val_uri") else None,
        "entry": spec.get("entry"),  # the loop that trained it, when not the built-in trainer
        "task": (spec.get("task") or {}).get("name"),
        "spec": spec_digest(spec),
        "job": spec.get("name"),
    }


def source_text(source: Mapping[str, Any]) -> str:
    """One training source in a few words: its dataset, version, tag, filter and weight."""
    text = f"{source.get('uri')} version {source.get('version')}"
    if source.get("tag"):
        text += f" (tag {source['tag']!r})"
    if source.get("filter"):
        text += f", rows where {source['filter']}"
    if source.get("weight") is not None:
        text += f", weight {source['weight']:g}"
    return text
