"""Writes docs/spec-reference.md from the job spec's own models, so the reference cannot drift from
what validation accepts: every section of :class:`lance_hpc.spec.JobSpec`, every field with its
type, default and the one-line description it carries in ``lance_hpc/spec/schema.py`` and the section
modules beside it.

    python3 docs/gen_spec_reference.py          # rewrite the page
    python3 docs/gen_spec_reference.py --check  # exit 1 if the committed page is out of date

``tests/test_docs.py`` runs the check.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import types
import typing
from pathlib import Path
from typing import Any, Iterator

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

PAGE = Path(__file__).resolve().parent / "spec-reference.md"
REGENERATE = "python3 docs/gen_spec_reference.py"

HEADER = f"""# Spec reference

Every field of a job spec, section by section, with its type, default and description. This page is
generated from the spec's models in `lance_hpc/spec/` (`schema.py` and a module per section:
`slurm_section.py`, `data_section.py`, `train_section.py`; `{REGENERATE}`); a test fails when
it is out of date. A task's own options (`task.options`) are listed on [Tasks](tasks.md); how the
fields work together is on [Job specs](job-specs.md).
"""

# The bounds pydantic keeps as annotated_types metadata, as a reader writes them.
BOUNDS = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<", "min_length": "length >=", "max_length": "length <="}


def sections(model: type[BaseModel], path: str = "") -> Iterator[tuple[str, type[BaseModel]]]:
    """The model and every section nested in it (a field whose type holds a model), depth first."""
    yield path, model
    for name, field in model.model_fields.items():
        nested = _section_model(field.annotation)
        if nested is not None:
            list_of = typing.get_origin(_without_none(field.annotation)) is list
            yield from sections(nested, f"{path}{name}[]." if list_of else f"{path}{name}.")


def _without_none(annotation: Any) -> Any:
    """``X | None`` as ``X``; anything else as it is."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        rest = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        if len(rest) == 1:
            return rest[0]
    return annotation


def _section_model(annotation: Any) -> type[BaseModel] | None:
    """The model a field holds, alone, optional or as a list of them; None for plain values."""
    inner = _without_none(annotation)
    if typing.get_origin(inner) is list:
        inner = typing.get_args(inner)[0]
    return inner if isinstance(inner, type) and issubclass(inner, BaseModel) else None


def type_text(field: FieldInfo) -> str:
    """The field's type as a reader writes it: ``int``, ``str or null``, ``list[str]``, bounds after."""
    annotation = field.annotation
    written = annotation.__name__ if isinstance(annotation, type) else repr(annotation)
    text = re.sub(r"\b(?:[A-Za-z_]\w*\.)+(\w+)", r"\1", written)  # typing.Any, lance_hpc.spec.schema.X
    text = text.replace(" | None", " or null").replace("NoneType", "null")
    bounds = []
    for item in field.metadata:
        for attribute, sign in BOUNDS.items():
            value = getattr(item, attribute, None)
            if value is not None:
                bounds.append(f"{sign} {value:,}" if isinstance(value, int) else f"{sign} {value}")
        pattern = getattr(item, "pattern", None)
        if pattern:
            bounds.append(f"matches `{pattern}`")
    return f"`{text}`" + (f" ({', '.join(bounds)})" if bounds else "")


def default_text(field: FieldInfo) -> str:
    """The default as YAML would write it; a nested section's default is its own fields' defaults."""
    if field.is_required():
        return "required"
    value = field.default_factory() if field.default_factory is not None else field.default  # type: ignore[call-arg]
    if value is PydanticUndefined:
        return "required"
    if isinstance(value, BaseModel):
        return "its fields' defaults"
    return f"`{json.dumps(value)}`"


def _cell(text: str) -> str:
    """Text safe inside a Markdown table cell."""
    return " ".join(text.split()).replace("|", "\\|")


def render() -> str:
    """The whole page."""
    from lance_hpc.spec.schema import JobSpec

    parts = [HEADER]
    for path, model in sections(JobSpec):
        title = path.rstrip(".") or "Top level"
        parts.append(f"## {title}\n")
        rows = ["| field | type | default | description |", "|---|---|---|---|"]
        for name, field in model.model_fields.items():
            nested = _section_model(field.annotation)
            description = field.description or ""
            if nested is not None:
                description += f" Fields: [{path}{name}](#{_anchor(path + name, field)})."
            rows.append(f"| `{path}{name}` | {_cell(type_text(field))} | {_cell(default_text(field))} | {_cell(description)} |")
        parts.append("\n".join(rows) + "\n")
    return "\n".join(parts)


def _anchor(dotted: str, field: FieldInfo) -> str:
    """The heading anchor MkDocs gives a nested section's title (dots and brackets dropped)."""
    title = dotted + ("[]" if typing.get_origin(_without_none(field.annotation)) is list else "")
    return re.sub(r"[^\w-]", "", title.lower())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the committed page differs from the models")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if PAGE.read_text() != text:
            print(f"{PAGE} is out of date with the models in lance_hpc/spec/\n  fix: {REGENERATE}", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(text)
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
