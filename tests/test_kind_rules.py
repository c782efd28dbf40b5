"""Each job kind owns its rules: validation asks the kind the spec names (a registered one, or one
of the user's own by import path) what it needs and refuses, and no module outside
lance_hpc/kinds/ compares a job's name with a kind's to decide anything."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import lance_hpc
from lance_hpc.kinds import JobKind, job_kind
from lance_hpc.spec import SpecError, validate_spec
from lance_hpc.spec.kinds import KINDS, JobKindBase, named_kind

PACKAGE = Path(lance_hpc.__file__).parent
BASE = {"name": "kinds", "data": {"uri": "/data/train.lance"}}


def kind_name_comparisons(source: str, names: set[str]) -> list[str]:
    """The comparisons in ``source`` of something about a job (its text mentions "job") with a
    literal kind name, or a tuple, list or set of them."""

    def literal_names(node: ast.expr) -> bool:
        if isinstance(node, ast.Constant):
            return node.value in names
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return any(literal_names(item) for item in node.elts)
        return False

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            if any(literal_names(operand) for operand in operands) and any(
                "job" in ast.unparse(operand) for operand in operands if not literal_names(operand)
            ):
                found.append(ast.unparse(node))
    return found


def test_the_comparison_finder_sees_a_job_compared_with_kind_names_and_nothing_else() -> None:
    names = set(KINDS)
    source = (
        "if spec.job == 'evaluate': pass\n"
        "if raw.get('job', 'train') not in ('infer', 'map'): pass\n"
        "if style == 'map': pass\n"  # data.style, not a kind
        "if job == self.name: pass\n"  # a kind asking after itself names no kind
    )
    assert kind_name_comparisons(source, names) == [
        "spec.job == 'evaluate'",
        "raw.get('job', 'train') not in ('infer', 'map')",
    ]


def test_no_module_outside_the_kinds_compares_a_job_with_a_kind_name() -> None:
    kinds = PACKAGE / "kinds"
    found = [
        f"{path.relative_to(PACKAGE.parent)}: {comparison}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if kinds not in path.parents
        for comparison in kind_name_comparisons(path.read_text(), set(KINDS))
    ]
    assert not found, "ask the kind (lance_hpc.spec.kinds, lance_hpc.kinds) instead:\n  " + "\n  ".join(found)


def test_each_registered_kind_is_its_spec_half_with_the_ranks_half_added() -> None:
    for name, rules in KINDS.items():
        kind = job_kind(name)
        assert isinstance(kind, rules) and isinstance(kind, JobKind) and kind.name == name
    reading = {name for name in KINDS if named_kind({"job": name}).reads_with_workers}
    assert reading == {"train", "infer", "evaluate"}
    # a section that implies its kind wins over job:, whose mismatch is then reported
    assert named_kind({"job": "infer", "command": ["true"]}).name == "command"
    assert type(named_kind({"job": "my_pkg.kinds:Mine"})) is JobKindBase  # not imported


OWN_KIND = """
from lance_hpc import JobKind
from lance_hpc.spec import Problem


class Sized(JobKind):
    name = "sized"

    def spec_problems(self, raw):
        infer = raw.get("infer")
        if not isinstance(infer, dict) or not infer.get("outputs"):
            return [Problem("infer.outputs", "job: sized writes the sizes", "name them, e.g. {width: int32}")]
        return []
"""


def test_a_kind_of_ones_own_declares_its_rules_and_validation_asks_them(tmp_path: Path) -> None:
    (tmp_path / "sized.py").write_text(OWN_KIND)
    spec = {**BASE, "job": "sized.py:Sized"}
    with pytest.raises(SpecError) as raised:
        validate_spec(spec, base_dir=tmp_path)
    assert "infer.outputs: job: sized writes the sizes" in str(raised.value), raised.value
    # its rules replace the default, which refuses an infer section
    loaded = validate_spec({**spec, "infer": {"function": "f.py:size", "outputs": {"width": "int32"}}}, base_dir=tmp_path)
    assert loaded.spec.job == f"{tmp_path}/sized.py:Sized"
    with pytest.raises(SpecError, match="infer: job: train does not read it"):
        validate_spec({**BASE, "infer": {"function": "f.py:size", "outputs": {"width": "int32"}}})
    # reading a spec without imports (status) runs none of its code, its rules included
    assert validate_spec(spec, base_dir=tmp_path, imports=False).spec.job == f"{tmp_path}/sized.py:Sized"
