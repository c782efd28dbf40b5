"""The ``command`` section of a job spec: a program of your own that every task runs instead of a
built-in kind (``job: command``, implied by the section), with torchrun's variables.

``command`` is a list of arguments, one string split as a shell would split it (:func:`shlex.split`;
it never runs through a shell), or a mapping ``{argv: [...], signal: USR1, options: {lr: 0.1}}``.
An argument may name a value of the spec as ``${...}``: ``${lr}`` is ``command.options.lr`` (which
a sweep varies as ``command.options.lr``), ``${checkpoint.dir}`` any field by its path; ``$${``
is a literal ``${``. A command job reads no data, task, train or infer section, and no entry: each
is refused (:class:`~lance_hpc.spec.kinds.builtin.CommandRules`) rather than silently ignored.
"""

from __future__ import annotations

import re
import shlex
from typing import Any, Mapping

from pydantic import Field, field_validator, model_validator

from lance_hpc.spec.problems import Problem, section_of
from lance_hpc.spec.section import Section, choice

# What the program may be sent when SLURM warns of the time limit (USR2 to the task): TERM, as
# torchrun passes a stop on, unless the program saves on another signal.
COMMAND_SIGNALS = ("TERM", "INT", "USR1", "USR2")
# The sections of the built-in kinds, which a command job does not read: key -> what to do instead.
NOT_READ = {
    "data": "your program opens its own data; remove the section",
    "task": "your program builds its own model; remove the section",
    "train": "your program trains as it likes; remove the section (its settings go in command.options or argv)",
    "infer": "remove the section, or use job: infer without command:",
    "entry": "a command job runs a program, not a function: remove entry, or remove command: for script mode",
    "entry_options": "pass your program's settings in command.options or argv; remove the key",
}
# ${name} or ${dotted.path}; $${ escapes it.
REFERENCE = re.compile(r"(?<!\$)\$\{([^{}]*)\}")
# The spec that a command job's data section stands for: nothing reads it (see CommandRules.defaults).
NO_DATA = {"uri": "none://command-job"}


class CommandSpec(Section):
    argv: list[str] = Field(
        ...,
        description="The program and its arguments, run in every task from the directory submit ran in; ${lr} is "
        "command.options.lr, ${checkpoint.dir} any field of the spec.",
    )
    signal: str = Field(
        "TERM",
        description="What the program gets when SLURM warns of the time limit (USR2): TERM, INT, USR1 or USR2; it saves, "
        "exits, and the job is requeued (slurm.max_requeues).",
    )
    options: dict[str, Any] = Field(
        default_factory=dict,
        description="Values for ${name} in argv, sweepable as command.options.NAME; each also reaches the program as "
        "LANCE_HPC_OPTION_NAME.",
    )

    check_signal = field_validator("signal")(choice(lambda: COMMAND_SIGNALS))

    @model_validator(mode="before")
    @classmethod
    def from_short_form(cls, value: Any) -> Any:
        return as_mapping(value)

    @field_validator("argv")
    @classmethod
    def check_program(cls, argv: list[str]) -> list[str]:
        if not argv or not argv[0].strip():
            raise ValueError("no program to run: the first argument is empty\n  fix: name a program, e.g. [python, train.py]")
        return argv


def as_mapping(value: Any) -> Any:
    """``command``'s short forms as the mapping: a string split with shlex, a list as argv."""
    if isinstance(value, str):
        try:
            return {"argv": shlex.split(value)}
        except ValueError as error:  # an unclosed quote
            raise ValueError(f"cannot split {value!r} into arguments: {error}\n  fix: close the quote, or write a list") from None
    if isinstance(value, list):
        return {"argv": value}
    return value


def reference_problems(spec: Mapping[str, Any]) -> list[Problem]:
    """The ``${...}`` in a command's arguments that name no value of ``spec`` (a dumped JobSpec, defaults filled in)."""
    problems = []
    for index, argument in enumerate(section_of(spec, "command").get("argv") or []):
        for name in REFERENCE.findall(argument):
            if lookup(spec, name) is None:
                fix = (
                    "name a field of the spec by its path, e.g. ${checkpoint.dir}"
                    if "." in name
                    else f"set command.options.{name}, or name a field by its path, e.g. ${{checkpoint.dir}}"
                )
                problems.append(
                    Problem(f"command.argv[{index}]", f"${{{name}}} names no value of the spec", f"{fix}; $${{ is a literal ${{")
                )
    return problems


def lookup(spec: Mapping[str, Any], name: str) -> Any:
    """The value ``${name}`` stands for: command.options.NAME, else the field at that dotted path; None if neither."""
    options = section_of(section_of(spec, "command"), "options")
    if name in options:
        return options[name]
    node: Any = spec
    for part in name.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return None if isinstance(node, (Mapping, list)) else node


def expand_argv(spec: Mapping[str, Any]) -> list[str]:
    """The program's arguments with every ``${...}`` replaced from ``spec`` (a dumped JobSpec)."""
    argv = section_of(spec, "command")["argv"]

    def value(match: re.Match[str]) -> str:
        found = lookup(spec, match.group(1))
        return "" if found is None else str(found)

    return [REFERENCE.sub(value, argument).replace("$${", "${") for argument in argv]
