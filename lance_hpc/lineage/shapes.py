"""The shape of a JSON document lance_hpc reads back, checked before any field is used.

Provenance and manifests are read from datasets and directories that others may write to: a field
of the wrong type (``"checkpoint": "x"``, a list where a number belongs) would otherwise fail deep
in the code that prints or compares it. A shape names, for each key a document may have, what its
value may be; a key that is absent is allowed (older documents have fewer), an unknown key ignored.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Mapping

# How each JSON value is named in a message.
_KINDS: dict[type, str] = {
    bool: "true or false",
    int: "an integer",
    float: "a number",
    str: "a string",
    list: "a list",
    dict: "an object",
    type(None): "null",
}


@dataclass(frozen=True)
class Fields:
    """A JSON object: each key it may have, with the shape of its value; null too when ``nullable``."""

    shapes: Mapping[str, Shape]
    nullable: bool = True


@dataclass(frozen=True)
class Items:
    """A JSON list whose every item has ``shape``."""

    shape: Shape


# A leaf is the tuple of the Python types its value may have (JSON true and false are never integers).
Shape = tuple[type, ...] | Fields | Items

TEXT: tuple[type, ...] = (str, type(None))
COUNT: tuple[type, ...] = (int, type(None))
INTEGER: tuple[type, ...] = (int,)
NUMBER: tuple[type, ...] = (int, float, type(None))
FLAG: tuple[type, ...] = (bool, type(None))


def kind(value: Any) -> str:
    return _KINDS.get(type(value), type(value).__name__)


def shape_problem(value: Any, shape: Shape, where: str = "") -> str | None:
    """What is wrong with ``value`` for ``shape`` (``where``: its path, as ``a.b[0].c``), None when nothing."""
    if isinstance(shape, tuple):
        if type(value) in shape or (type(value) is int and float in shape):
            return None
        wanted = " or ".join(_KINDS[item] for item in shape if item is not type(None))
        return f"{where or 'the document'} is {kind(value)}, not {wanted}"
    if isinstance(shape, Items):
        if not isinstance(value, list):
            return f"{where or 'the document'} is {kind(value)}, not a list"
        found = (shape_problem(item, shape.shape, f"{where}[{index}]") for index, item in enumerate(value))
        return next((problem for problem in found if problem), None)
    if value is None and shape.nullable:
        return None
    if not isinstance(value, dict):
        return f"{where or 'the document'} is {kind(value)}, not an object"
    found = (
        shape_problem(value[key], inner, f"{where}.{key}" if where else key)
        for key, inner in shape.shapes.items()
        if key in value
    )
    return next((problem for problem in found if problem), None)


def parse(text: str | bytes, shape: Fields) -> dict[str, Any]:
    """The JSON object ``text`` holds, of ``shape``; ValueError saying what is wrong otherwise
    (not JSON, nested too deep to parse, or a field of the wrong type)."""
    try:
        document = json.loads(text)
    except RecursionError:
        raise ValueError("it is nested too deep to be a document lance_hpc wrote") from None
    except ValueError as error:
        raise ValueError(f"it is not JSON ({error})") from None
    problem = shape_problem(document, Fields(shape.shapes, nullable=False))
    if problem:
        raise ValueError(problem)
    return document


# A checkpoint's lineage (lance_hpc.lineage.checkpoints), in its manifest and in a column's provenance.
SOURCE_SHAPE = Fields({"uri": TEXT, "version": COUNT, "tag": TEXT, "filter": TEXT, "weight": NUMBER}, nullable=False)
LINEAGE_SHAPE = Fields(
    {"trained_on": Items(SOURCE_SHAPE), "validated_on": TEXT, "entry": TEXT, "task": TEXT, "spec": TEXT, "job": TEXT}
)
# A column's provenance (lance_hpc.lineage.provenance).
REFRESH_SHAPE = Fields(
    {
        "dataset_version": COUNT,
        "rows": INTEGER,
        "fragments": INTEGER,
        "spec": TEXT,
        "run": TEXT,
        "weights": TEXT,
        "written_at": TEXT,
    },
    nullable=False,
)
PROVENANCE_SHAPE = Fields(
    {
        "job": TEXT,
        "checkpoint": Fields({"dir": TEXT, "step": COUNT, "weights": TEXT, "lineage": LINEAGE_SHAPE}),
        "function": TEXT,
        "spec": TEXT,
        "dataset": Fields({"uri": TEXT, "version": COUNT}),
        "filter": TEXT,
        "rows": INTEGER,
        "fragments": INTEGER,
        "run": TEXT,
        "written_at": TEXT,
        "refreshes": Items(REFRESH_SHAPE),
    }
)
