"""Reading a spec's YAML text within bounds: keys written twice, anchors that contain themselves,
and aliases that multiply a short text into millions of values are refused before anything walks
the values.

PyYAML resolves an alias to the very node its anchor names, so nine levels of six aliases each
are a 400-byte text that stands for ten million values, and every walk over the values (the
duplicate-key check, the deep copy, pydantic) would expand them again. Here each node's expanded
size is counted once, from its children's sizes, so checking costs as much as the text does, not
its expansion; an anchor whose value holds an alias to itself shows up as a node met again on the
path to it.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Iterator

import yaml

from lance_hpc.errors import UserError
from lance_hpc.spec.problems import Problem

# A job spec holds hundreds of values; a sweep's lists or a task's class names a few thousand.
MAX_EXPANDED_VALUES = 100_000
# Sections, a mapping of options, a list of lists: a spec needs a handful of levels.
MAX_DEPTH = 64


@dataclass(frozen=True)
class Anchor:
    """Where an anchored node was defined (``&name`` on ``line``)."""

    name: str
    line: int

    def __str__(self) -> str:
        return f"anchor &{self.name} (line {self.line})"


class _AnchorRecordingLoader(yaml.SafeLoader):
    """A SafeLoader that remembers which anchor each anchored node was defined with."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self.defined_anchors: dict[int, Anchor] = {}  # not "anchors": the Composer uses that name

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node:
        event = self.peek_event()
        anchor = None if isinstance(event, yaml.AliasEvent) else getattr(event, "anchor", None)
        node = super().compose_node(parent, index)
        if anchor is not None:
            self.defined_anchors[id(node)] = Anchor(anchor, event.start_mark.line + 1)
        return node


class _ContainsItself(Exception):
    def __init__(self, node: yaml.Node) -> None:
        self.node = node


def parse_yaml(text: str) -> tuple[Any, list[Problem]]:
    """The value YAML ``text`` holds, or None and the problems that stop it being read: not YAML,
    an anchor that contains itself, aliases that expand past the bounds, or keys written twice."""
    loader = _AnchorRecordingLoader(text)
    try:
        try:
            root = loader.get_single_node()
        except RecursionError:
            return None, [
                Problem("", f"nested too deeply to read (a spec needs a few levels, at most {MAX_DEPTH})", "flatten the nesting")
            ]
        except yaml.YAMLError as error:
            return None, [_yaml_error(error)]
        if root is None:
            return None, []
        problems = bound_problems(root, loader.defined_anchors) or duplicate_keys(root)
        if problems:
            return None, problems
        return loader.construct_document(root), []
    finally:
        loader.dispose()


def parse_value(text: str, where: str) -> tuple[Any, list[Problem]]:
    """Like :func:`parse_yaml`, for a value given on the command line; problems are told at ``where``."""
    value, problems = parse_yaml(text)
    return value, [Problem(where, problem.message, problem.fix) for problem in problems]


def expanded_sizes(root: yaml.Node) -> dict[int, tuple[int, int]]:
    """node id -> (values, depth) the node stands for with every alias expanded, each counted at
    most once past the bound. Visits every distinct node once, however often it is aliased;
    raises _ContainsItself for an anchor that holds an alias to itself."""
    sizes: dict[int, tuple[int, int]] = {}
    on_path: set[int] = set()  # nodes entered and not yet left: the path from the root
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:  # a loop, not recursion: a deep text must not end in a RecursionError
        node, leaving = stack.pop()
        if leaving:
            children = [sizes[id(child)] for child in _children(node)]
            size = min(1 + sum(values for values, _ in children), MAX_EXPANDED_VALUES + 1)
            sizes[id(node)] = (size, 1 + max((depth for _, depth in children), default=0))
            on_path.discard(id(node))
            continue
        if id(node) in sizes:
            continue
        on_path.add(id(node))
        stack.append((node, True))
        for child in _children(node):
            if id(child) in on_path:
                raise _ContainsItself(child)
            if id(child) not in sizes:
                stack.append((child, False))
    return sizes


def bound_problems(root: yaml.Node, anchors: dict[int, Anchor]) -> list[Problem]:
    """An anchor that contains itself, or aliases that make the spec larger or deeper than a spec
    can sensibly be, each named by its anchor."""
    try:
        sizes = expanded_sizes(root)
    except _ContainsItself as cycle:
        anchor = anchors.get(id(cycle.node))
        where = str(anchor) if anchor else f"the value on line {cycle.node.start_mark.line + 1}"
        return [
            Problem(
                "",
                f"{where} contains an alias to itself, so it never ends",
                "write the value out instead of aliasing an anchor inside its own value",
            )
        ]
    values, depth = sizes[id(root)]
    if values > MAX_EXPANDED_VALUES:
        # the first anchor past the bound is where the text blows up; else the one aliased most
        culprit_id = next(
            (node_id for node_id in anchors if sizes.get(node_id, (0, 0))[0] > MAX_EXPANDED_VALUES),
            max(anchors, key=lambda node_id: sizes.get(node_id, (0, 0))[0], default=None),
        )
        culprit = f"; {anchors[culprit_id]} alone stands for {_count(sizes[culprit_id][0])} values" if culprit_id in sizes else ""
        return [
            Problem(
                "",
                f"aliases expand the spec to more than {MAX_EXPANDED_VALUES:,} values{culprit}",
                "write the values out, or alias fewer times: a job spec needs a few hundred values",
            )
        ]
    if depth > MAX_DEPTH:
        path = [root]  # down the deepest branch, to the node past the limit
        for _ in range(MAX_DEPTH):
            path.append(max(_children(path[-1]), key=lambda child: sizes[id(child)][1]))
        anchor = next((anchors[id(step)] for step in reversed(path) if id(step) in anchors), None)
        through = f", through {anchor}" if anchor else ""
        return [
            Problem(
                "",
                f"nested {depth} levels deep (line {path[-1].start_mark.line + 1}{through}); "
                f"a spec needs a few levels, at most {MAX_DEPTH}",
                "flatten the nesting",
            )
        ]
    return []


def duplicate_keys(root: yaml.Node | None) -> list[Problem]:
    """Keys written twice in one mapping (YAML loaders silently keep the last), with both lines.

    A node an alias repeats is checked once, under the path where it first appears.
    """
    problems: list[Problem] = []
    seen: set[int] = set()
    stack: list[tuple[yaml.Node | None, str]] = [(root, "")]
    while stack:
        node, path = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, yaml.MappingNode):
            first_line: dict[str, int] = {}
            children = []
            for key_node, value_node in node.value:
                key = str(key_node.value)
                where = f"{path}.{key}" if path else key
                line = key_node.start_mark.line + 1
                if key in first_line:
                    problems.append(
                        Problem(
                            where,
                            f"written twice, on lines {first_line[key]} and {line}; YAML would keep only the second",
                            "keep one of them",
                        )
                    )
                else:
                    first_line[key] = line
                children.append((value_node, where))
            stack.extend(reversed(children))
        elif isinstance(node, yaml.SequenceNode):
            stack.extend(reversed([(item, f"{path}[{index}]") for index, item in enumerate(node.value)]))
    return problems


def _children(node: yaml.Node) -> Iterator[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            yield key_node
            yield value_node
    elif isinstance(node, yaml.SequenceNode):
        yield from node.value


def _count(values: int) -> str:
    return f"more than {MAX_EXPANDED_VALUES:,}" if values > MAX_EXPANDED_VALUES else f"{values:,}"


def _yaml_error(error: yaml.YAMLError) -> Problem:
    mark = getattr(error, "problem_mark", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "somewhere"
    return Problem("", f"not valid YAML at {where}: {getattr(error, 'problem', error)}")


def set_block_keys(text: str, section: str, values: dict[str, Any], where: str = "the spec") -> str | None:
    """``text`` (a spec file, ``where``) with ``section.key: value`` set for each of ``values``,
    keeping every comment and line around them: a key already there gets its value replaced in
    place, a missing one a line of its own at the top of the section. None when the section is not
    a block mapping (``data: {...}`` on one line), which only a rewrite of the file could change.

    Raises UserError, and changes nothing, where an edit in place would change more than the key:
    a value that is an alias (``*cpus``: the edit would land in the anchor's text) or an anchor
    (``&cpus 8``: every alias of it would change, or stop parsing). The result is read back and must
    hold exactly the old values with these set, or nothing is returned but the error."""
    loader = _AnchorRecordingLoader(text)
    try:
        root = loader.get_single_node()
    finally:
        loader.dispose()
    if not isinstance(root, yaml.MappingNode):
        return None
    entry = next(((key, value) for key, value in root.value if isinstance(key, yaml.ScalarNode) and key.value == section), None)
    if entry is None or not isinstance(entry[1], yaml.MappingNode) or entry[1].flow_style or not entry[1].value:
        return None
    _refuse_shared(section, entry[0], entry[1], loader.defined_anchors, where, values, section)
    node = entry[1]
    edits: list[tuple[int, int, str]] = []
    present = {key.value: (key, value) for key, value in node.value if isinstance(key, yaml.ScalarNode)}
    for key, value in values.items():
        found = present.get(key)
        if found is None:
            first = node.value[0][0]
            line_start = first.start_mark.index - first.start_mark.column
            edits.append((line_start, line_start, f"{' ' * first.start_mark.column}{key}: {value}\n"))
            continue
        _refuse_shared(f"{section}.{key}", *found, loader.defined_anchors, where, values, section)
        if not isinstance(found[1], yaml.ScalarNode):
            return None
        edits.append((found[1].start_mark.index, found[1].end_mark.index, str(value)))
    edited = text
    for start, end, replacement in sorted(edits, reverse=True):
        edited = edited[:start] + replacement + edited[end:]
    _check_edit(text, edited, section, values, where)
    return edited


def _refuse_shared(
    path: str,
    key: yaml.Node,
    value: yaml.Node,
    anchors: dict[int, Anchor],
    where: str,
    values: dict[str, Any],
    section: str,
) -> None:
    """Raise UserError when ``value`` (of ``key``, at YAML ``path``) is an alias or an anchor."""
    name = path.rsplit(".", 1)[-1]
    anchor = anchors.get(id(value))
    if value.start_mark.index < key.end_mark.index:  # an alias: its node is the anchor's, written earlier
        alias = f"*{anchor.name}" if anchor else "the alias"
        what = f"is an alias of {anchor or 'an anchor'}: the new value would go into the anchor's text, changing every value that aliases it"
        fix = f"write {name}'s value out in place of {alias} and run again"
    elif anchor is not None:
        what = f"holds {anchor}: writing the new value there would drop the anchor that other values alias"
        fix = f"give {name} a plain value (without &{anchor.name}) and run again"
    else:
        return
    flags = " ".join(f"--set {section}.{option}={setting}" for option, setting in values.items())
    raise UserError(
        f"{path} in {where} {what}; {where} was left as it is\n  fix: {fix}, or keep the file and pass the values: {flags}"
    )


def _check_edit(before: str, after: str, section: str, values: dict[str, Any], where: str) -> None:
    """Read ``after`` back: it must parse, within the bounds, to ``before``'s value with ``values``
    set in ``section`` and nothing else changed."""
    original, _ = parse_yaml(before)
    edited, problems = parse_yaml(after)
    expected = copy.deepcopy(original)
    if isinstance(expected, dict) and isinstance(expected.get(section), dict):
        expected[section].update(values)
    if problems or edited != expected:
        found = edited.get(section) if isinstance(edited, dict) else None
        read = "; ".join(problem.message for problem in problems) or f"{section} reads {found!r}"
        raise UserError(
            f"the edit of {where} did not read back as meant ({read}), so {where} was left as it is\n"
            f"  fix: set {', '.join(f'{section}.{name}: {value}' for name, value in values.items())} by hand"
        )
