"""Render a job spec into an sbatch script: spec in, text out, nothing else touched.

The resources, setup lines and launch command are computed here once and used twice: by the
Jinja2 template (``templates/sbatch.sh.j2``, or the site template in ``slurm.template``) and by
:mod:`lance_hpc.submit` for submitit, so both paths ask SLURM for the same job.

Secrets never enter the script: validation refuses credentials in the spec, and the template's
``spec`` is a copy with credential-looking values redacted besides.

Templates get every ``{{ value }}`` shell-quoted on output unless it is :class:`ShellText`: script
text this module built from quoted parts, or the user's own setup lines, which are shell by
design. A value like ``$(touch /tmp/pwned)`` in a partition or path therefore stays a string, and
values that would end a line early (newlines and other control characters) are refused.

A sweep (``spec.sweep``) renders as one job array: ``--array=0-N%slurm.array_parallelism``, a log
file per run (``%A_%a``), and a launch that reads the spec file of ``$SLURM_ARRAY_TASK_ID``. A job
in a container (``slurm.container``) gets the runtime's srun options or command prefix, and a
requeue handler: rank 0 cannot run ``scontrol`` inside the container, so it writes a request file
and the script, outside the container, requeues the job once srun has ended.

With ``slurm.max_restarts`` the allocation survives a failed node (``--no-kill``, and
``slurm.spare_nodes`` more nodes), and srun runs through the restart supervisor
(:mod:`lance_hpc.launch.restarts`, written beside the script by :mod:`lance_hpc.launch.restart_script`),
which starts a failed step again.
"""

from __future__ import annotations

import math
import re
import shlex
from importlib import resources
from pathlib import Path
from typing import Any, Iterator, Mapping

import jinja2

from lance_hpc.errors import UserError
from lance_hpc.imports import SAFE_PATH_FLAG, SAFE_PATH_VARIABLE
from lance_hpc.launch.container import container_launch
from lance_hpc.launch.paths import (
    ARRAY_INDEX,
    JobPaths,
    job_reference,
    make_private_dirs,
    write_private,
)
from lance_hpc.launch.restart_script import restart_supervisor, supervisor_program
from lance_hpc.runtime.ports import master_port_lines
from lance_hpc.runtime.preemption import REQUEUE_FUNCTION, requeue_handler
from lance_hpc.spec import JobSpec, Problem, SpecError, expand, run_count
from lance_hpc.spec.secrets import redact_text

DEFAULT_TEMPLATE = "sbatch.sh.j2"
PYTHON = "python3"
ENTRY_MODULE = "lance_hpc.run"
# The built-in template starts its body with this; submitit's script gets it as its first setup line.
STRICT_MODE = "set -eo pipefail"
# SLURM sends this to every task signal_delay_s before the time limit; submitit uses the same one.
PREEMPT_SIGNAL = "USR2"
# Flags lance_hpc sets from spec fields; extra_flags must not set them a second time.
FLAG_FIELDS = {
    "job-name": "name",
    "nodes": "slurm.nodes",
    "ntasks-per-node": "slurm.tasks_per_node",
    "cpus-per-task": "slurm.cpus_per_task",
    "gpus-per-node": "slurm.gpus_per_node",
    "mem": "slurm.mem_gb",
    "time": "slurm.time",
    "partition": "slurm.partition",
    "account": "slurm.account",
    "qos": "slurm.qos",
    "constraint": "slurm.constraint",
    "exclusive": "slurm.exclusive",
    "requeue": "slurm.max_requeues",
    "no-kill": "slurm.max_restarts",
    "signal": "slurm.signal_delay_s",
    "output": "slurm.log_dir",
    "error": "slurm.log_dir",
    "open-mode": "slurm.log_dir",
    "array": "sweep",
}
RENDERING = "rendering the sbatch script"  # where SpecErrors raised here say they come from
FLAG_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_-]*$")
# sbatch's own #SBATCH parser reads a backslash as an escape even inside single quotes.
UNSAFE_IN_FLAG = re.compile(r"[\x00-\x1f\x7f\\]")
CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")


class ShellText(str):
    """Text a template inserts verbatim: built here from quoted parts, or a user setup line."""


def array_range(spec: JobSpec) -> str | None:
    """``--array`` of a sweep: one task per run, at most slurm.array_parallelism at once."""
    if not spec.sweep:
        return None
    runs = run_count(spec)
    return f"0-{runs - 1}%{min(runs, spec.slurm.array_parallelism)}"


def resource_flags(spec: JobSpec) -> dict[str, str | int | bool]:
    """sbatch flags (long name -> value, True for a bare flag) shared by sbatch and submitit.

    Log paths are left out: each path writes its own (submitit keeps its files in its folder).
    """
    slurm = spec.slurm
    optional = {
        "partition": slurm.partition,
        "account": slurm.account,
        "qos": slurm.qos,
        "constraint": slurm.constraint,
        "gpus-per-node": slurm.gpus_per_node or None,
        "mem": f"{slurm.mem_gb}GB" if slurm.mem_gb else None,
    }
    flags: dict[str, str | int | bool] = {
        "job-name": spec.name,
        "nodes": slurm.nodes + slurm.spare_nodes,
        "ntasks-per-node": slurm.ntasks_per_node,
        "cpus-per-task": slurm.cpus_per_task,
        # minutes, as submitit needs them for its requeue logic: both paths then write the same flag
        "time": math.ceil(slurm.time_seconds / 60),
        "requeue": True,
        "signal": f"{PREEMPT_SIGNAL}@{slurm.signal_delay_s}",
        "open-mode": "append",
        **{flag: value for flag, value in optional.items() if value is not None},
    }
    if spec.sweep:
        flags["array"] = str(array_range(spec))
    if slurm.exclusive:
        flags["exclusive"] = True
    if slurm.max_restarts:
        flags["no-kill"] = True  # a failed node leaves the allocation, which the job's next attempt uses
    problems = []
    for key, value in slurm.extra_flags.items():
        flag = key.replace("_", "-")
        if not FLAG_NAME.match(key):
            fix = "use the long name without dashes, e.g. reservation"
            problems.append(Problem(f"slurm.extra_flags.{key!r}", "is not an sbatch flag name", fix))
        elif flag in FLAG_FIELDS:
            field = FLAG_FIELDS[flag]
            problems.append(Problem(f"slurm.extra_flags.{key}", f"--{flag} is set from {field}", f"set {field}"))
        elif value is True or (value is not None and value is not False):
            flags[flag] = True if value is True else str(value)
    _refuse_unreadable(flags, problems)
    return dict(sorted(flags.items()))


def environment(spec: JobSpec) -> dict[str, str]:
    """Variables every task needs; MASTER_ADDR is derived by each rank (lance_hpc.runtime.environment)."""
    return {
        "PYTHONUNBUFFERED": "1",  # rank output reaches the log as it happens, not at exit
        "OMP_NUM_THREADS": str(spec.slurm.cpus_per_task),  # torch would otherwise use every core per task
        SAFE_PATH_VARIABLE: "1",  # no Python of the job imports from the working directory (see lance_hpc.imports)
    }


def export_lines(spec: JobSpec) -> list[str]:
    """The exports of :func:`environment`, and for ranks that meet, a MASTER_PORT picked free on
    this node (the batch step runs on rank 0's), see :mod:`lance_hpc.runtime.ports`."""
    exports = [f"export {key}={shlex.quote(value)}" for key, value in environment(spec).items()]
    return [*exports, *(master_port_lines() if spec.slurm.world_size > 1 else [])]


def setup_lines(spec: JobSpec) -> list[str]:
    """What runs before srun: the user's setup lines (shell, run as written), the exports, and a
    container's requeue handler."""
    return [*_user_setup(spec), *export_lines(spec), *requeue_handler(spec.slurm)]


def srun_args(spec: JobSpec) -> list[str]:
    """srun options: one task per GPU, and a crashed rank stops the job instead of hanging the rest."""
    # SLURM 22.05 stopped passing the batch job's --cpus-per-task on to srun; say it again.
    # --label prefixes each line with its rank ("3: ..."), which `lance-hpc logs --rank` filters on.
    # No --unbuffered: with it slurmstepd passes on whatever it has read, cut anywhere, and --label
    # ends each piece as a line of its own; without it, whole lines (a rank writes each line as it
    # ends, see lance_hpc.output, so nothing waits).
    own = ["--label", "--kill-on-bad-exit=1", f"--cpus-per-task={spec.slurm.cpus_per_task}"]
    return [*own, *container_launch(spec.slurm).srun_args]


def python_command(spec: JobSpec) -> list[str]:
    """How a task starts Python: ``python3 -P`` (the working directory off sys.path), after the
    container runtime's prefix if there is one."""
    return [*container_launch(spec.slurm).command_prefix, PYTHON, SAFE_PATH_FLAG]


def launch_command(spec: JobSpec, spec_file: str) -> ShellText:
    """What srun starts in every task: ``python3 -P -m lance_hpc.run SPEC_FILE`` (in the container)."""
    return ShellText(f"{shlex.join([*python_command(spec), '-m', ENTRY_MODULE])} {_spec_file_word(spec, spec_file)}")


def render_sbatch(spec: JobSpec, spec_file: str) -> str:
    """The sbatch script for ``spec``, whose tasks run ``python3 -P -m lance_hpc.run spec_file``.

    For a sweep, ``spec_file`` holds ``{index}`` where each run's array task id goes.
    """
    if CONTROL.search(str(spec_file)):
        raise UserError(f"spec file path {spec_file!r} has a control character; use a plain path")
    paths = JobPaths.of(spec)
    stdout, stderr = paths.stdout, paths.stderr
    log_flags = {"output": stdout, "error": stderr}
    _refuse_unreadable(log_flags, [])
    _refuse_unreadable_container(spec)
    flags = {**resource_flags(spec), **log_flags}
    srun = ShellText(shlex.join(["srun", *srun_args(spec)]))
    command = launch_command(spec, spec_file)
    supervisor = ShellText(restart_supervisor(spec))
    variables = {
        # a site template may print any field: it gets the spec with credential-looking values redacted
        "spec": JobSpec.model_validate(spec.redacted_dict()),
        "spec_file": str(spec_file),
        # validation refuses credentials in setup lines and flags; redacting here keeps one that
        # slipped past it out of the script, which SLURM keeps and shows to others
        "sbatch_lines": [ShellText(redact_text(sbatch_line(name, value))) for name, value in sorted(flags.items())],
        "setup": [ShellText(redact_text(line)) for line in _user_setup(spec)],
        "exports": [ShellText(line) for line in export_lines(spec)],
        "requeue_handler": [ShellText(line) for line in requeue_handler(spec.slurm)],
        "job_ref": ShellText(job_reference(spec)),
        "array": array_range(spec) or "",
        "srun": srun,
        "command": command,
        "restarts": supervisor,
        "launch": ShellText(f"{supervisor} \\\n    {srun} {command}" if supervisor else f"{srun} {command}"),
        "log_out": stdout,
        "log_err": stderr,
    }
    try:
        script = _template(spec).render(variables)
    except jinja2.TemplateError as error:
        raise UserError(f"sbatch template {_template_name(spec)}: {error}") from None
    if spec.slurm.container is not None and f"trap {REQUEUE_FUNCTION} EXIT" not in script:
        raise UserError(
            f"sbatch template {_template_name(spec)} leaves out the requeue handler a container job needs\n"
            "  fix: add {% for line in requeue_handler %}{{ line }}{% endfor %} before the srun line"
        )
    if supervisor and supervisor not in script:
        raise UserError(
            f"sbatch template {_template_name(spec)} runs srun without the restart supervisor that slurm.max_restarts "
            f"({spec.slurm.max_restarts}) needs\n"
            "  fix: write {{ launch }} for the srun line (or {{ restarts }} {{ srun }} {{ command }}), "
            "or set slurm.max_restarts: 0"
        )
    return script


def sbatch_line(name: str, value: str | int | bool) -> str:
    """``#SBATCH --name=value`` with the value shell-quoted (as submitit writes them)."""
    return f"#SBATCH --{name}" if value is True else f"#SBATCH --{name}={shlex.quote(str(value))}"


def sbatch_directives(script: str) -> Iterator[tuple[str, str | bool]]:
    """The (flag, value) pairs sbatch reads from a script: #SBATCH lines before the first command."""
    for line in script.split("\n")[1:]:  # not splitlines(): sbatch and bash end lines at \n only
        stripped = line.strip()
        if stripped and not stripped.startswith("#"):
            return
        if stripped.startswith("#SBATCH"):
            for word in shlex.split(stripped[len("#SBATCH") :]):
                name, sep, value = word.lstrip("-").partition("=")
                yield name, value if sep else True


def _refuse_unreadable(flags: Mapping[str, str | int | bool], problems: list[Problem]) -> None:
    """Raise every problem so far, plus each flag value sbatch could not read back as written."""
    for flag, value in flags.items():
        if isinstance(value, str) and UNSAFE_IN_FLAG.search(value):
            path = FLAG_FIELDS.get(flag, f"slurm.extra_flags.{flag}")
            problems.append(Problem(path, f"{value!r} has a control character or backslash", "remove it"))
    if problems:
        raise SpecError(RENDERING, problems)


def _spec_file_word(spec: JobSpec, spec_file: str) -> str:
    """The spec file as one shell word; a sweep's ``{index}`` becomes the array task id."""
    if not spec.sweep:
        return shlex.quote(str(spec_file))
    before, found, after = str(spec_file).partition(ARRAY_INDEX)
    if not found:
        raise UserError(f"a sweep's spec file path must hold {ARRAY_INDEX} for the array task id; got {spec_file!r}")
    return "".join([shlex.quote(before) if before else "", '"$SLURM_ARRAY_TASK_ID"', shlex.quote(after) if after else ""])


def _refuse_unreadable_container(spec: JobSpec) -> None:
    container = spec.slurm.container
    if container is None:
        return
    values = {
        "image": container.image,
        "workdir": container.workdir or "",
        **{f"mounts[{i}]": m for i, m in enumerate(container.mounts)},
    }
    problems = [
        Problem(f"slurm.container.{key}", f"{value!r} has a control character", "remove it")
        for key, value in values.items()
        if CONTROL.search(value)
    ]
    if problems:
        raise SpecError(RENDERING, problems)


def _user_setup(spec: JobSpec) -> list[str]:
    for index, line in enumerate(spec.slurm.setup):
        if "\x00" in line:
            raise SpecError(RENDERING, [Problem(f"slurm.setup[{index}]", "contains a NUL byte", "remove it")])
    return list(spec.slurm.setup)


def _quote_unless_shell_text(value: Any) -> str:
    if isinstance(value, ShellText):
        return value
    text = str(value)
    if CONTROL.search(text):
        raise UserError(f"template value {text!r} has a control character that could end a script line")
    return shlex.quote(text)


def _template_name(spec: JobSpec) -> str:
    return spec.slurm.template or f"(built-in) {DEFAULT_TEMPLATE}"


def _template(spec: JobSpec) -> jinja2.Template:
    if spec.slurm.template:
        source = Path(spec.slurm.template).read_text()
    else:
        source = (resources.files("lance_hpc") / "templates" / DEFAULT_TEMPLATE).read_text()
    environment_ = jinja2.Environment(
        undefined=jinja2.StrictUndefined,
        finalize=_quote_unless_shell_text,
        autoescape=False,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    environment_.filters["quote"] = lambda value: ShellText(shlex.quote(str(value)))
    try:
        return environment_.from_string(source)
    except jinja2.TemplateSyntaxError as error:
        where = f"sbatch template {_template_name(spec)}, line {error.lineno}"
        raise UserError(f"{where}: {error.message}") from None


def write_job_files(spec: JobSpec, script_path: Path | None = None) -> tuple[Path, Path]:
    """Write the resolved spec (and a sweep's run specs), the sbatch script and the restart
    supervisor it runs; returns the paths of the spec and the script."""
    paths = JobPaths.of(spec)
    spec_file, script_path = paths.spec_file, script_path or paths.script
    runs = expand(spec) if spec.sweep else []
    # before writing anything: rendering may refuse
    script = render_sbatch(spec, paths.task_spec(bool(runs)))
    files: dict[Path, str | bytes] = {
        spec_file: spec.to_yaml(),
        **{paths.run_spec(run.index): run.spec.to_yaml() for run in runs},
        script_path: script,
    }
    if spec.slurm.max_restarts:
        files[paths.restarts_program] = supervisor_program()
    for path, text in files.items():
        try:
            make_private_dirs(path.parent)  # also the log directory: SLURM cannot open logs in a missing one
            write_private(path, text)
        except OSError as error:
            raise UserError(
                f"cannot write {path}: {error.strerror}\n"
                f"  fix: make {path.parent} a directory you can write, or set slurm.log_dir to one"
            ) from None
    return spec_file, script_path
