"""The spec's half of ``job: train``, ``job: ingest`` and ``job: command``: what each needs of a
spec and what it refuses. Their ranks' half is in :mod:`lance_hpc.kinds`; the write-back kinds'
spec half is in :mod:`~lance_hpc.spec.kinds.columns`."""

from __future__ import annotations

from typing import Any, Mapping

from lance_hpc.spec.choices import source_format
from lance_hpc.spec.command_section import NO_DATA, NOT_READ
from lance_hpc.spec.kinds.base import JobKindBase
from lance_hpc.spec.problems import Problem, section_of


class TrainRules(JobKindBase):
    """Training: profiled on USR1, an epoch's rows split over the ranks, read through DataLoader workers."""

    name = "train"
    profiled = True
    trains = True
    reads_with_workers = True


class IngestRules(JobKindBase):
    """Writing a dataset: a source that splits into shards between the ranks."""

    name = "ingest"

    def spec_problems(self, raw: Mapping[str, Any]) -> list[Problem]:
        """data.ingest.source is one of the formats the ranks split into shards, besides what every kind refuses."""
        problems = super().spec_problems(raw)
        ingest = section_of(raw, "data").get("ingest")
        source = ingest.get("source") if isinstance(ingest, Mapping) else None
        if not isinstance(source, str) or source_format(source) is None:
            problems.append(
                Problem(
                    "data.ingest.source",
                    f"job: ingest splits its source into shards between the ranks, which {source!r} is not",
                    "use parquet:<glob>, jsonl:<glob>, webdataset:<glob>, hf:<dir>, imagefolder:<dir>, text:<glob>, "
                    "python-stdlib, or a format of your own: path/to/formats.py:MyFormat:<location>; "
                    "other sources are ingested by a training job's start or by lance-hpc ingest",
                )
            )
        return problems


class CommandRules(JobKindBase):
    """A program of the user's own on every task (:mod:`~lance_hpc.spec.command_section`): it needs
    the command section, which implies it, and refuses the sections of the other kinds."""

    name = "command"
    implied_by = "command"

    def defaults(self, values: dict[str, Any]) -> dict[str, Any]:
        """The data section it never reads stands as a placeholder: every other kind needs one, so data stays required of them."""
        return {"job": self.name, "data": NO_DATA, **values}

    def spec_problems(self, raw: Mapping[str, Any]) -> list[Problem]:
        """No command, or the sections and keys of the other kinds beside it, or job: naming another kind."""
        job, command = raw.get("job"), raw.get("command")
        if command is None:
            return [Problem("command", "job: command has no program to run", "add command: [python, train.py]")]
        problems = [Problem(key, "a command job does not read it", fix) for key, fix in NOT_READ.items() if key in raw]
        if job not in (None, self.name):
            problems.append(
                Problem("job", f"{job} runs its own code, not command:", "remove job: (command: implies job: command)")
            )
        return problems

    def named_code_problems(self, raw: dict[str, Any], imports: bool) -> list[Problem]:
        """None: a command job's task and entry are refused with its other sections."""
        return []
