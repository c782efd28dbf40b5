"""Job spec: YAML in, a frozen, validated :class:`JobSpec` out.

Every user mistake becomes one :class:`SpecError` that lists each problem with its YAML path and
a fix, never a traceback. The sections live in :mod:`~lance_hpc.spec.schema` (and the section
modules it names), loading and path resolution in :mod:`~lance_hpc.spec.load`, bounded YAML reading
in :mod:`~lance_hpc.spec.yaml_text`, rules across fields in :mod:`~lance_hpc.spec.rules`, the job
kinds and what each needs of a spec in :mod:`~lance_hpc.spec.kinds`, the task and entry a spec names
in :mod:`~lance_hpc.spec.named_code`, credentials in :mod:`~lance_hpc.spec.secrets`, and error
reporting in :mod:`~lance_hpc.spec.problems`.
"""

from lance_hpc.spec.load import (
    LoadedSpec,
    Resolution,
    apply_overrides,
    expand,
    load_spec,
    load_spec_text,
    validate_spec,
)
from lance_hpc.spec.problems import Problem, SpecError
from lance_hpc.spec.schema import (
    CacheSpec,
    CheckpointSpec,
    ContainerSpec,
    DataSpec,
    IngestSpec,
    JobSpec,
    LoggingSpec,
    MixSource,
    SlurmSpec,
    TaskSpec,
    TrainSpec,
    parse_time_limit,
)
from lance_hpc.spec.secrets import REDACTED, redacted
from lance_hpc.spec.sweep import SweepRun, run_count

__all__ = [
    "CacheSpec",
    "CheckpointSpec",
    "ContainerSpec",
    "DataSpec",
    "IngestSpec",
    "JobSpec",
    "LoadedSpec",
    "LoggingSpec",
    "MixSource",
    "Problem",
    "REDACTED",
    "Resolution",
    "SlurmSpec",
    "SpecError",
    "SweepRun",
    "TaskSpec",
    "TrainSpec",
    "apply_overrides",
    "expand",
    "load_spec",
    "load_spec_text",
    "parse_time_limit",
    "redacted",
    "run_count",
    "validate_spec",
]
