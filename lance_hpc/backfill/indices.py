"""Indices on the columns a write-back job replaces or extends: never lost without a word.

Lance keeps an index through a commit that adds values to its column (a refresh keeps the column's
field id), but the index covers only the fragments it was built over: the rows a refresh fills are
searched without it until ``optimize_indices`` adds them, which the job does after its commit. A
column an overwrite replaces is a new field, and Lance drops the indices of the field it removes:
the job reads each index's type and parameters before its commit and builds it again on the new
column after. An index built after the rows were appended and before the refresh covers their
nulls: it is built again too, since ``optimize_indices`` adds only fragments it does not cover. An index that cannot be built again (a kind or parameter this does not know) is
named, with the call that rebuilds it, instead of vanishing.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Mapping

# Lance's names of scalar index types (as its statistics give them) -> create_scalar_index's.
SCALAR_TYPES = {
    "btree": "BTREE",
    "bitmap": "BITMAP",
    "labellist": "LABEL_LIST",
    "label_list": "LABEL_LIST",
    "inverted": "INVERTED",
    "ngram": "NGRAM",
    "zonemap": "ZONEMAP",
    "bloomfilter": "BLOOMFILTER",
}


@dataclass(frozen=True)
class Index:
    """An index on one column, as it can be built again: its name, type and parameters."""

    name: str
    column: str
    index_type: str
    vector: bool
    parameters: dict[str, Any] = field(default_factory=dict)
    fragments: frozenset[int] = frozenset()  # the ids of the fragments it covers

    def call(self) -> str:
        """The pylance call that builds it, for a message."""
        settings = "".join(f", {key}={value!r}" for key, value in self.parameters.items())
        if self.vector:
            return f"dataset.create_index({self.column!r}, {self.index_type!r}, name={self.name!r}{settings})"
        return f"dataset.create_scalar_index({self.column!r}, {self.index_type!r}, name={self.name!r})"


def on_columns(dataset: Any, columns: Iterable[str]) -> list[Index]:
    """The indices of ``dataset`` on any of ``columns`` (one column each), with what rebuilds them."""
    wanted = set(columns)
    with warnings.catch_warnings():  # list_indices is deprecated, but alone in saying which fragments an index covers
        warnings.simplefilter("ignore", DeprecationWarning)
        covered = {str(found["name"]): frozenset(found.get("fragment_ids") or ()) for found in dataset.list_indices()}
    found = []
    for description in dataset.describe_indices():
        names = list(description.field_names)
        if len(names) == 1 and names[0] in wanted:
            index = _described(dataset, description.name, names[0])
            found.append(replace(index, fragments=covered.get(index.name, frozenset())))
    return found


def _described(dataset: Any, name: str, column: str) -> Index:
    try:
        stats = dataset.stats.index_stats(name)
    except (ValueError, OSError, RuntimeError):
        stats = {}
    index_type = str(stats.get("index_type", ""))
    segment = (stats.get("indices") or [{}])[0]
    if "num_partitions" not in segment:  # a scalar index
        return Index(name, column, SCALAR_TYPES.get(index_type.lower(), index_type.upper()), False)
    parameters: dict[str, Any] = {"num_partitions": segment["num_partitions"]}
    if segment.get("metric_type"):
        parameters["metric"] = segment["metric_type"]
    sub_index = segment.get("sub_index") or {}
    if "num_sub_vectors" in sub_index:
        parameters["num_sub_vectors"] = sub_index["num_sub_vectors"]
    if "nbits" in sub_index and sub_index.get("index_type") == "PQ":
        parameters["num_bits"] = sub_index["nbits"]
    return Index(name, column, str(stats.get("index_type") or index_type), True, parameters)


def follow(
    uri: str, options: Mapping[str, str], indices: list[Index], *, replaced: bool, filled: Iterable[int] = ()
) -> list[str]:
    """After the commit: each index on a replaced column built again; on an extended column brought
    up to date, or built again when it covered a fragment whose values the commit ``filled`` (it
    holds their nulls); the lines that say so (and name any index left behind, with its fix)."""
    from lance_hpc.storage.datasets import open_dataset

    lines = []
    for index in indices:
        dataset: Any = open_dataset(uri, None, dict(options))
        stale = bool(index.fragments & set(filled))
        try:
            if not replaced and not stale:
                dataset.optimize.optimize_indices(index_names=[index.name])
                lines.append(f"index {index.name} on {index.column}: updated with the new rows (optimize_indices)")
            else:
                if index.vector:
                    dataset.create_index(index.column, index.index_type, name=index.name, replace=True, **index.parameters)
                else:
                    dataset.create_scalar_index(index.column, index.index_type, name=index.name, replace=True)
                why = "on the new values" if replaced else "(it held the nulls of rows the refresh filled)"
                lines.append(f"index {index.name} on {index.column}: built again {why} ({index.index_type})")
        except (ValueError, OSError, RuntimeError, TypeError) as error:
            state = "dropped with the column it replaced" if replaced else "does not cover the new rows"
            lines.append(
                f"warning: index {index.name} on {index.column} {state}: {str(error).splitlines()[0] if str(error) else error!r}\n"
                f"  fix: {index.call() if replaced else f'dataset.optimize.optimize_indices(index_names=[{index.name!r}])'}"
            )
    return lines
