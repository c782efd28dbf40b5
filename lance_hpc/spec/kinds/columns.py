"""The spec's half of the kinds that write back to data.uri: ``job: infer`` and ``job: evaluate``
(a model over every row), ``job: map`` (a function of the user's own): the infer section each
needs, and the outputs it may write. Their ranks' half is in :mod:`lance_hpc.kinds`."""

from __future__ import annotations

import difflib
import re
from typing import Any, Mapping

from lance_hpc.errors import UserError
from lance_hpc.spec.kinds.base import JobKindBase
from lance_hpc.spec.problems import Problem

# What an infer section looks like, for the fix when a kind that reads one has none.
MODEL_EXAMPLE = "{checkpoint: checkpoints/<training job>, outputs: {embedding: float16, predicted: int64}}"


class WritebackRules(JobKindBase):
    """A kind that reads the infer section: it needs one, and checks it (:meth:`infer_problems`)."""

    #: the infer section a fix suggests
    example = MODEL_EXAMPLE

    def spec_problems(self, raw: Mapping[str, Any]) -> list[Problem]:
        """The infer section, there and right for this kind."""
        infer = raw.get("infer")
        if not isinstance(infer, Mapping):
            return [Problem("infer", f"job: {self.name} needs an infer section", f"add infer: {self.example}")]
        return self.infer_problems(infer)

    def infer_problems(self, infer: Mapping[str, Any]) -> list[Problem]:
        """What this kind needs of its infer section and refuses in it."""
        return []


class ModelRules(WritebackRules):
    """A model over every row of data.uri (a checkpoint, or infer.function), its rows read as the task reads them."""

    reads_with_workers = True

    def infer_problems(self, infer: Mapping[str, Any]) -> list[Problem]:
        """The task names the columns read; a model to run."""
        problems = []
        if infer.get("columns"):
            problems.append(
                Problem(
                    "infer.columns", f"job: {self.name} reads the columns its task names", "remove the key (job: map reads it)"
                )
            )
        if not infer.get("checkpoint") and not infer.get("function"):
            problems.append(
                Problem(
                    "infer.checkpoint",
                    "no model to run",
                    "name a training job's checkpoint.dir (its latest checkpoint is read), or infer.function",
                )
            )
        return problems


class InferRules(ModelRules):
    """Inference: new columns, each named and typed in infer.outputs."""

    name = "infer"

    def infer_problems(self, infer: Mapping[str, Any]) -> list[Problem]:
        """Besides a model: the outputs it writes, named as Lance allows."""
        problems = super().infer_problems(infer)
        outputs = infer.get("outputs")
        if not outputs:
            problems.append(
                Problem(
                    "infer.outputs",
                    "job: infer writes no column",
                    "name the new columns and their types, e.g. {embedding: float16, predicted: int64}; job: evaluate reports "
                    "metrics without writing",
                )
            )
        elif isinstance(outputs, Mapping):
            problems += output_name_problems([str(name) for name in outputs], infer.get("filter"))
        return problems

    def named_code_problems(self, raw: dict[str, Any], imports: bool) -> list[Problem]:
        """Besides the task and entry: the outputs against the columns the task reads and the outputs it gives."""
        problems = super().named_code_problems(raw, imports)
        return problems + infer_output_problems(raw, imports=imports)


class EvaluateRules(ModelRules):
    """Evaluation: a checkpoint's metrics reported, no column written."""

    name = "evaluate"

    def infer_problems(self, infer: Mapping[str, Any]) -> list[Problem]:
        """Besides a model: a checkpoint, and nothing to write."""
        problems = super().infer_problems(infer)
        if infer.get("outputs"):
            problems.append(Problem("infer.outputs", "job: evaluate writes no column", "use job: infer to write them"))
        if infer.get("refresh"):
            problems.append(
                Problem("infer.refresh", "job: evaluate writes no column to refresh", "use job: infer, or remove the key")
            )
        if not infer.get("checkpoint"):
            problems.append(
                Problem("infer.checkpoint", "job: evaluate needs a checkpoint", "name a training job's checkpoint.dir")
            )
        return problems


class MapRules(WritebackRules):
    """A function over batches of data.uri's columns, no model: the function and the columns it writes."""

    name = "map"
    example = "{function: my_pkg.features:sizes, columns: [image], outputs: {width: int32}}"

    def infer_problems(self, infer: Mapping[str, Any]) -> list[Problem]:
        """A function, no checkpoint, and outputs that are not its own inputs."""
        problems = []
        if not infer.get("function"):
            problems.append(Problem("infer.function", "job: map has no function to run", "name it, e.g. my_pkg.features:sizes"))
        if infer.get("checkpoint"):
            problems.append(
                Problem("infer.checkpoint", "job: map runs no model", "use job: infer to run a checkpoint, or remove the key")
            )
        outputs = infer.get("outputs")
        if not outputs:
            problems.append(
                Problem("infer.outputs", "job: map writes no column", "name the new columns and their types, e.g. {width: int32}")
            )
        elif isinstance(outputs, Mapping):
            problems += output_name_problems([str(name) for name in outputs], infer.get("filter"))
            columns = infer.get("columns") or []
            clash = [name for name in outputs if name in columns]
            if clash:
                problems.append(
                    Problem(
                        "infer.outputs",
                        f"{', '.join(clash)} is a column the function reads (infer.columns): the job would replace its own input",
                        f"write the output under another name, e.g. {clash[0]}_mapped",
                    )
                )
        return problems


# Columns Lance computes for a scan (a stored column of such a name breaks every later scan); every
# name beginning with "_" is left to Lance, which adds such names over time.
LANCE_RESERVED = (
    "_rowid",
    "_rowaddr",
    "_rowoffset",
    "_row_created_at_version",
    "_row_last_updated_at_version",
    "_distance",
    "_score",
)


def output_name_problems(outputs: list[str], filter: Any) -> list[Problem]:
    """An output named like a column Lance computes (or any name beginning with "_"), and a filter
    that names an output: it would choose rows by the values the job writes."""
    problems = []
    for name in outputs:
        if name.startswith("_"):
            why = (
                "Lance computes a column of this name for its scans"
                if name.lower() in LANCE_RESERVED
                else ("names beginning with _ are Lance's own (" + ", ".join(LANCE_RESERVED[:3]) + ", ...)")
            )
            problems.append(
                Problem(
                    f"infer.outputs.{name}",
                    f"{why}: a stored column of that name breaks every scan of the dataset",
                    f"name the output without the leading _, e.g. {name.lstrip('_') or 'output'}",
                )
            )
    named = filter_columns(filter) if isinstance(filter, str) else set()
    written = sorted(name for name in outputs if name.lower() in named)
    if written:
        problems.append(
            Problem(
                "infer.filter",
                f"names {', '.join(written)}, which this job writes (infer.outputs): it would choose the rows by the values "
                "the job replaces",
                "filter on columns the job does not write, or write the outputs under other names",
            )
        )
    return problems


def filter_columns(filter: str) -> set[str]:
    """The identifiers a SQL predicate names, lower-cased: bare words and quoted (\"x\", `x`) names
    outside string literals. Keywords and functions are among them, which only matters for an
    output named like one."""
    without_strings = re.sub(r"'(?:[^']|'')*'", " ", filter)
    quoted = re.findall(r'"((?:[^"]|"")*)"|`([^`]*)`', without_strings)
    bare = re.findall(r"[A-Za-z_][A-Za-z0-9_]*", re.sub(r'"(?:[^"]|"")*"|`[^`]*`', " ", without_strings))
    return {name.lower() for name in bare} | {(double or back).lower() for double, back in quoted}


def infer_output_problems(raw: dict[str, Any], imports: bool = True) -> list[Problem]:
    """No output of job: infer is a column the task reads (a ``*_column`` of its options), and without
    infer.function each is one the task's class declares it gives: known before any rank starts,
    with no model built. Without ``imports``, a task of one's own is not imported to ask."""
    from lance_hpc.tasks.registry import OUTPUTS, task_outputs

    infer, task = raw.get("infer"), raw.get("task")
    if not isinstance(infer, Mapping) or not isinstance(infer.get("outputs"), Mapping):
        return []
    task = task if isinstance(task, Mapping) else {}
    name, options = str(task.get("name", "image_classification")), task.get("options")
    read = {
        value: key
        for key, value in (options if isinstance(options, Mapping) else {}).items()
        if str(key).endswith("_column") and isinstance(value, str)  # another type is the options' own problem
    }
    outputs = [str(output) for output in infer["outputs"]]
    problems = [
        Problem(
            "infer.outputs",
            f"{output} is a column task {name} reads (task.options.{read[output]}): the job would replace its own input",
            f"write the output under another name, e.g. {output}_predicted",
        )
        for output in outputs
        if output in read
    ]
    if infer.get("function") or (not imports and name not in OUTPUTS):
        return problems
    try:
        offered = task_outputs(name)
    except UserError:
        return problems  # task_problems says what is wrong with task.name
    if not offered:
        return problems  # a task that declares none: what its infer() gives is known when it runs
    for output in outputs:
        if output not in offered and output not in read:
            close = difflib.get_close_matches(output, offered, n=1, cutoff=0.5)
            problems.append(
                Problem(
                    f"infer.outputs.{output}",
                    f"task {name} gives no output {output!r} (it gives {', '.join(offered)})",
                    (f"did you mean {close[0]}? " if close else "")
                    + "name outputs the task gives, or write your own with infer.function",
                )
            )
    return problems
