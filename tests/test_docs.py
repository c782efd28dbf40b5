"""The documentation stays true to the code: every job spec a page names exists and validates, every
YAML example validates as a job spec (or says it is a fragment), every internal link and anchor
resolves, and the spec reference is what its generator writes from the schema now. No network, no
training: the spec checks import at most the task a spec names."""

from __future__ import annotations

import difflib
import importlib.util
import re
import textwrap
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

from lance_hpc.spec import SpecError, load_spec, load_spec_text

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]
# The first line of a YAML example that shows part of a spec, not a whole one.
FRAGMENT = "# fragment"
# A job spec named in prose or in a command: jobs/x.yaml, examples/.../x.yaml.
SPEC_PATH = re.compile(r"(?<![\w/.-])((?:jobs|examples(?:/[\w.-]+)*)/[\w.-]+\.ya?ml)\b")
FENCE = re.compile(r"^( *)```(\w*)[^\n]*\n(.*?)^\1```", re.MULTILINE | re.DOTALL)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6} +(.+?) *$", re.MULTILINE)
# The two commands the README's quick start gives; CI runs the second.
QUICK_START = "python3 -m pip install -e '.[demo]' && python3 -m lance_hpc.submit jobs/quickstart.yaml --local"
TEST_COMMAND = "bash tests/run_all.sh"


def relative(path: Path) -> str:
    return str(path.relative_to(ROOT))


def without_code(text: str) -> str:
    """The prose of a page: fenced blocks and inline code removed (links there are examples)."""
    return re.sub(r"`[^`\n]*`", "", FENCE.sub("", text))


def slug(heading: str) -> str:
    """The anchor MkDocs (Python-Markdown's toc) gives a heading."""
    text = re.sub(r"[`*_]{1,2}(?=\S)|(?<=\S)[`*_]{1,2}", "", heading)
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(page: Path) -> set[str]:
    return {slug(heading) for heading in HEADING.findall(FENCE.sub("", page.read_text()))}


def yaml_examples() -> list[tuple[str, str]]:
    """Every ```yaml block of the pages, as (page:line, text) with its indentation removed."""
    found = []
    for page in PAGES:
        text = page.read_text()
        for match in FENCE.finditer(text):
            if match.group(2) in ("yaml", "yml"):
                line = text.count("\n", 0, match.start()) + 1
                found.append((f"{relative(page)}:{line}", textwrap.dedent(match.group(3))))
    return found


def named_specs() -> list[str]:
    return sorted({name for page in PAGES for name in SPEC_PATH.findall(page.read_text())})


def generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_spec_reference", DOCS / "gen_spec_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_spec_reference_is_generated_from_the_schema_as_it_is_now() -> None:
    committed = (DOCS / "spec-reference.md").read_text()
    current = generator().render()
    diff = "".join(
        list(difflib.unified_diff(committed.splitlines(True), current.splitlines(True), "committed", "generated"))[:60]
    )
    assert committed == current, (
        f"docs/spec-reference.md is out of date with lance_hpc/spec/schema.py:\n{diff}\n"
        "  fix: python3 docs/gen_spec_reference.py (and commit the page)"
    )


def test_the_pages_name_the_shipped_specs() -> None:
    names = named_specs()
    assert "jobs/quickstart.yaml" in names and "jobs/quickstart_infer.yaml" in names, names


@pytest.mark.parametrize("name", named_specs())
def test_every_job_spec_a_page_names_exists_and_validates(name: str) -> None:
    path = ROOT / name
    pages = [relative(page) for page in PAGES if name in page.read_text()]
    assert path.is_file(), f"{', '.join(pages)} name {name}, which does not exist"
    try:
        load_spec(path, base_dir=ROOT)
    except SpecError as error:
        pytest.fail(f"{name}, named in {', '.join(pages)}, does not validate:\n{error}")


@pytest.mark.parametrize(("where", "text"), yaml_examples(), ids=[where for where, _ in yaml_examples()])
def test_every_yaml_example_is_a_valid_job_spec_or_a_marked_fragment(where: str, text: str) -> None:
    try:
        parsed: Any = yaml.safe_load(text)
    except yaml.YAMLError as error:
        pytest.fail(f"{where}: the example is not YAML: {error}")
    if text.lstrip().startswith(FRAGMENT):
        assert isinstance(parsed, dict), f"{where}: a fragment should still be a mapping of spec keys, got {parsed!r}"
        return
    try:
        load_spec_text(text, source=where, base_dir=ROOT)
    except SpecError as error:
        pytest.fail(
            f"{where}: the example is not a valid job spec:\n{error}\n"
            f"  fix: correct it, or make its first line '{FRAGMENT}' if it shows only part of a spec"
        )


def test_every_internal_link_and_anchor_resolves() -> None:
    broken = []
    for page in PAGES:
        for target in LINK.findall(without_code(page.read_text())):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:: outside the repository
                continue
            path_text, _, anchor = target.partition("#")
            linked = (page.parent / path_text).resolve() if path_text else page
            if not linked.exists():
                broken.append(f"{relative(page)}: {target}: {path_text} does not exist")
            elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
                broken.append(f"{relative(page)}: {target}: no heading of {relative(linked)} has the anchor #{anchor}")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_every_page_is_in_the_site_navigation() -> None:
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())

    def files(entries: Any) -> list[str]:
        if isinstance(entries, str):
            return [entries]
        if isinstance(entries, list):
            return [name for entry in entries for name in files(entry)]
        return [name for value in entries.values() for name in files(value)]

    in_nav = files(config["nav"])
    missing = sorted(relative(page)[len("docs/") :] for page in PAGES[1:] if relative(page)[len("docs/") :] not in in_nav)
    absent = sorted(name for name in in_nav if not (DOCS / name).is_file())
    assert not missing and not absent, f"pages not in mkdocs.yml's nav: {missing}; nav entries without a page: {absent}"


def test_the_readme_is_short_and_keeps_the_quick_start_and_test_command() -> None:
    readme = (ROOT / "README.md").read_text()
    lines = readme.count("\n")
    assert lines <= 250, f"README.md has {lines} lines; the manual belongs in docs/ (at most 250 lines here)"
    for command in (QUICK_START, TEST_COMMAND):
        assert command in readme.splitlines(), f"README.md lost its command line {command!r}"
    assert TEST_COMMAND in (ROOT / ".ci" / "run").read_text().splitlines(), ".ci/run no longer runs the README's test command"
