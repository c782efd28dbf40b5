"""Submit a job to SLURM through submitit: check its data and task first, write its files
(:func:`lance_hpc.launch.render.write_job_files`), submit one job (or one job array for a sweep,
whose task ``<index>`` reads that run's spec), record it for status/logs/cancel, and with
``--wait`` follow it to its end."""

from __future__ import annotations

import contextlib
import io
import shlex
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import submitit
from submitit.core import utils as submitit_utils

from lance_hpc.errors import ExitCode, UserError
from lance_hpc.kinds import job_kind
from lance_hpc.kinds.rank import SubmititJob
from lance_hpc.launch import render
from lance_hpc.launch.container import container_launch
from lance_hpc.launch.paths import JobPaths
from lance_hpc.launch.render import write_job_files
from lance_hpc.launch.restart_script import srun_through_restarts
from lance_hpc.slurm.queue import FINAL_STATES, show_job
from lance_hpc.slurm.records import record_submission
from lance_hpc.spec import JobSpec, expand

# A submitit task imports numpy and unpickles the job (lance_hpc, submitit) before lance_hpc can
# take USR1 over, and USR1's default action ends a process: `scancel --signal=USR1` (a profiler
# trace) reaching the task then would kill it. The shell ignores USR1 and execs Python, which keeps
# it ignored until lance_hpc.kinds.rank installs its own handler (the sbatch path's
# lance_hpc.run holds it from its first line).
IGNORE_USR1 = 'trap "" USR1; exec "$0" "$@"'


def submitit_python(spec: JobSpec) -> str:
    """The command submitit's tasks start Python with (it appends ``-u -m submitit.core._submit
    FOLDER``): ``python3 -P`` started by a shell that ignores USR1, in the container if the spec has one."""
    prefix = container_launch(spec.slurm).command_prefix
    python = render.python_command(spec)[len(prefix) :]
    return shlex.join([*prefix, "sh", "-c", IGNORE_USR1, *python])


def make_executor(spec: JobSpec, folder: Path) -> submitit.SlurmExecutor:
    """A submitit SlurmExecutor asking for the same resources, setup and srun options as the script."""
    python = submitit_python(spec)
    executor = submitit.SlurmExecutor(folder=folder, max_num_timeout=spec.slurm.max_requeues, python=python)
    named: dict[str, Any] = {"array_parallelism": spec.slurm.array_parallelism}
    additional: dict[str, Any] = {}
    valid = submitit.SlurmExecutor._valid_parameters()
    for flag, value in render.resource_flags(spec).items():
        key = flag.replace("-", "_")
        if key in ("signal", "open_mode", "array"):
            continue  # submitit writes these itself (the same USR2 signal, append mode, array range)
        (named if key in valid else additional)[key] = value
    executor.update_parameters(
        **named,
        signal_delay_s=spec.slurm.signal_delay_s,
        # a failing setup line stops the job; submitit's srun line then runs through the restart supervisor
        setup=[render.STRICT_MODE, *render.setup_lines(spec), *srun_through_restarts(spec)],
        # each task writes a file of its own, so no --label: submitit's srun runs --unbuffered, with
        # which --label would cut lines where slurmstepd's reads end (see render.srun_args)
        srun_args=[arg for arg in render.srun_args(spec) if arg != "--label"],
        additional_parameters=additional,
        wckey=None,
    )
    return executor


def check_data(spec: JobSpec) -> None:
    """Fail before any GPU hour is spent if the job could not open its data."""
    for line in job_kind(spec.job).check(spec, None):  # None: the ranks run elsewhere, under SLURM
        print(line)


def submit(spec: JobSpec, wait: bool = False, check: bool = True) -> int:
    """Submit through submitit; print the job id, log paths and how to watch it."""
    _check_slurm_commands()
    if check:
        check_data(spec)
    spec_file, script_path = write_job_files(spec)

    executor = make_executor(spec, JobPaths.of(spec).submitit_folder)
    if spec.sweep:
        return submit_sweep(spec, executor, script_path, wait)
    try:
        with contextlib.redirect_stderr(io.StringIO()):  # submitit prints sbatch's stderr; we explain it below
            job = executor.submit(SubmititJob(str(spec_file)))
    except (submitit_utils.FailedJobError, submitit_utils.FailedSubmissionError, OSError) as error:
        raise UserError(_explain_sbatch_failure(str(error))) from None
    record_submission(spec, job.job_id, via="submitit")  # lets status/logs/cancel find the job from its spec
    print(f"submitted job {job.job_id} ({spec.name}, {spec.slurm.world_size} tasks on {spec.slurm.nodes} node(s))")
    print(f"  spec     {spec_file}")
    print(f"  script   {script_path}  (the same job for your own sbatch)")
    print(f"  stdout   {job.paths.stdout}")
    print(f"  stderr   {job.paths.stderr}")
    print(f"  status   squeue -j {job.job_id}")
    print(f"  watch    tensorboard --logdir {spec.logging.tensorboard_dir}")
    if not wait:
        return 0
    return wait_for(job)


def submit_sweep(spec: JobSpec, executor: submitit.SlurmExecutor, script_path: Path, wait: bool) -> int:
    """Submit a sweep's runs as one job array through submitit; print each run's job id."""
    runs = expand(spec)
    try:
        with contextlib.redirect_stderr(io.StringIO()), executor.batch():  # one array: submitit's map_count
            jobs = [executor.submit(SubmititJob(str(JobPaths.of(spec).run_spec(run.index)))) for run in runs]
    except (submitit_utils.FailedJobError, submitit_utils.FailedSubmissionError, OSError) as error:
        raise UserError(_explain_sbatch_failure(str(error))) from None
    array_id = jobs[0].job_id.split("_")[0]
    record_submission(spec, array_id, via="submitit")
    print(
        f"submitted job array {array_id} ({spec.name}: {len(runs)} runs, at most {spec.slurm.array_parallelism} "
        f"at once, {spec.slurm.world_size} tasks each)"
    )
    for run, job in zip(runs, jobs):
        print(f"  {job.job_id:<12} {run.spec.name}  ({run.describe()})")
    print(f"  specs    {JobPaths.of(spec).run_specs}")
    print(f"  script   {script_path}  (the same array for your own sbatch)")
    print(f"  logs     {Path(jobs[0].paths.stdout).parent}/{array_id}_<index>_0_log.out")
    print(f"  status   squeue -j {array_id}")
    print(f"  compare  tensorboard --logdir {spec.logging.tensorboard_dir}  (HParams tab)")
    if not wait:
        return 0
    return max(wait_for(job) for job in jobs)


def wait_for(job: submitit.Job) -> int:
    """Wait for a submitit job to end; print its result, or its exit status and where its logs are."""
    tasks = [job.task(index) for index in range(job.num_tasks)]
    state, exit_code = "PENDING", "?"
    # Our own loop: submitit's wait() asks sacct, which clusters without accounting do not have. A
    # failed attempt leaves results that the job's next attempt in the allocation replaces: while
    # SLURM shows the job, its end is what counts.
    while True:
        shown = show_job(job.job_id)
        state, exit_code = (shown.state, shown.exit_code or "?") if shown else ("UNKNOWN", "?")
        if state in FINAL_STATES or (shown is None and all(task.paths.result_pickle.exists() for task in tasks)):
            break
        time.sleep(2)
    if all(task.paths.result_pickle.exists() for task in tasks):
        failed = [(index, task) for index, task in enumerate(tasks) if task.exception() is not None]
        if not failed:
            print(f"job {job.job_id} finished: {job.results()[0]}")
            return 0
        # The task whose own error came first holds the cause; the others usually just lost contact with it.
        first_index, first = min(
            failed,
            key=lambda item: (
                "lost contact with another rank" in str(item[1].exception()),
                item[1].paths.result_pickle.stat().st_mtime,
            ),
        )
        print(f"job {job.job_id} failed; task {first_index} failed first: {first.exception()}", file=sys.stderr)
        others = [str(index) for index, _ in failed if index != first_index]
        if others:
            print(f"tasks {', '.join(others)} failed too; their logs are in {job.paths.folder}", file=sys.stderr)
        return ExitCode.FAILED
    print(f"job {job.job_id} ended {state} with exit code {exit_code} and no result; the end of its log:", file=sys.stderr)
    print(_tail(Path(job.paths.stderr)), file=sys.stderr)
    print(f"  logs: {job.paths.stderr}\n        {job.paths.stdout}", file=sys.stderr)
    return ExitCode.FAILED


def _tail(path: Path, lines: int = 15) -> str:
    if not path.exists():
        return f"    ({path} was not written)"
    return "\n".join(f"    | {line}" for line in path.read_text(errors="replace").splitlines()[-lines:])


def _check_slurm_commands() -> None:
    missing = [command for command in ("sbatch", "srun") if shutil.which(command) is None]
    if missing:
        raise UserError(
            f"cannot submit: {' and '.join(missing)} not found on PATH, so this machine is not a SLURM login node\n"
            "  fix: run this on your cluster's login node, or use --local to run here, "
            "or --render-only -o job.sbatch and sbatch it elsewhere"
        )


def _explain_sbatch_failure(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if "error" in line.lower() and line.strip()]
    summary = "\n    ".join(dict.fromkeys(lines[-3:])) or text.strip()
    if any(hint in text for hint in ("Unable to contact slurm controller", "Connection refused", "connect failure")):
        fix = "the SLURM controller is not reachable: check `scontrol ping` and SLURM_CONF, or ask your admins"
    elif "Invalid partition" in text:
        fix = "set slurm.partition to one that `sinfo` lists"
    elif "Invalid account" in text or "Invalid qos" in text:
        fix = "check slurm.account / slurm.qos with `sacctmgr show assoc user=$USER`"
    elif "Requested node configuration is not available" in text:
        fix = "ask for fewer nodes, GPUs, CPUs or memory per node (see `sinfo -o '%P %D %c %m %G'`)"
    else:
        fix = "read sbatch's message above; `lance-hpc submit --dry-run` shows the script that was sent"
    return f"sbatch refused the job:\n    {summary}\n  fix: {fix}"
