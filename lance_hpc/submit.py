"""Submit a job spec: to SLURM through submitit (default), as a script for your own sbatch
(--render-only), as a dry run that touches nothing (--dry-run), or on this machine (--local).

Every path writes the resolved spec as ``<log_dir>/<name>.spec.yaml`` and the script as
``<log_dir>/<name>.sbatch``; the job's tasks read that spec, so they run exactly what was shown.
Both are written 0600, and a log directory lance_hpc creates is 0700.
A sweep also writes one spec per run, ``<log_dir>/<name>.sweep/<index>.spec.yaml``, and submits
one job array whose task ``<index>`` reads that file; ``--local`` runs them one after another.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

import submitit
from submitit.core import utils as submitit_utils

from lance_hpc import render
from lance_hpc.errors import ExitCode, UserError
from lance_hpc.spec import JobSpec, LoadedSpec, SweepRun, expand, load_spec
from lance_hpc.spec.load import check_owned

# The resolved spec and the script say everything the job does (its paths, its setup lines), and
# the job's tasks run whatever the spec file says: only their owner may read or change them
# (files 0600, see write_private; a directory lance_hpc creates for them 0700).
PRIVATE_DIR_MODE = 0o700
# scontrol states of a job that will not run again.
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}


def job_files(spec: JobSpec) -> tuple[Path, Path]:
    """Where the resolved spec and the rendered script of a job go."""
    log_dir = Path(spec.slurm.log_dir)
    return log_dir / f"{spec.name}.spec.yaml", log_dir / f"{spec.name}.sbatch"


def run_spec_files(spec: JobSpec) -> str:
    """Where a sweep's runs' specs go: a path with ``{index}`` for the run's array index."""
    return f"{spec.slurm.log_dir}/{spec.name}.sweep/{render.ARRAY_INDEX}.spec.yaml"


def run_spec_file(spec: JobSpec, run: SweepRun) -> Path:
    return Path(run_spec_files(spec).replace(render.ARRAY_INDEX, str(run.index)))


def write_job_files(spec: JobSpec, script_path: Path | None = None) -> tuple[Path, Path]:
    """Write the resolved spec (and a sweep's run specs) and the sbatch script; returns the paths
    of the spec and the script."""
    spec_file, default_script = job_files(spec)
    script_path = script_path or default_script
    runs = expand(spec) if spec.sweep else []
    # before writing anything: rendering may refuse
    script = render.render_sbatch(spec, run_spec_files(spec) if runs else str(spec_file))
    files = {spec_file: spec.to_yaml(), **{run_spec_file(spec, run): run.spec.to_yaml() for run in runs}, script_path: script}
    for path, text in files.items():
        try:
            make_private_dirs(path.parent)  # also the log directory: SLURM cannot open logs in a missing one
            write_private(path, text)
        except OSError as error:
            raise UserError(f"cannot write {path}: {error.strerror}\n"
                            f"  fix: make {path.parent} a directory you can write, or set slurm.log_dir to one") from None
    return spec_file, script_path


def make_private_dirs(directory: Path) -> None:
    """Create ``directory`` and its missing parents readable by their owner alone (0700). One that
    exists keeps the mode its owner chose: a group's shared log directory stays shared, while the
    files lance_hpc writes into it are private anyway."""
    missing = [path for path in (directory, *directory.parents) if not path.exists()]
    for path in reversed(missing):
        path.mkdir(mode=PRIVATE_DIR_MODE, exist_ok=True)


def write_private(path: Path, text: str) -> None:
    """Replace ``path`` by a file holding ``text``, readable and writable by its owner alone (0600).

    The text is written to a fresh temporary file (mkstemp: 0600, never an existing file or link)
    and renamed over ``path``: a link planted there is replaced, not followed, and an earlier
    file's mode does not carry over. Another user's file there is refused: in a shared log
    directory it is their job's spec or script, and their requeued job would run ours.
    """
    try:
        check_owned(os.lstat(path), path, "its job reads it when it runs or is requeued, so replacing it "
                    "would make that job run your spec", "set another slurm.log_dir, or give your job another name")
    except FileNotFoundError:
        pass
    descriptor, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(descriptor, "w") as file:
            file.write(text)
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise


def dry_run(loaded: LoadedSpec) -> None:
    """Print what a submission would do; writes nothing and talks to no cluster."""
    spec = loaded.spec
    spec_file, script_path = job_files(spec)
    print(f"# {loaded.source}: valid; {spec.slurm.nodes} node(s) x {spec.slurm.ntasks_per_node} task(s) = "
          f"world size {spec.slurm.world_size}")
    print("# placeholders and relative paths resolved:")
    for item in loaded.resolutions or ():
        print(f"#   {item.path}: {item.before} -> {item.after}")
    if spec.sweep:
        print(describe_sweep(spec))
    print(f"\n# ---- resolved spec (would be written to {spec_file}) ----")
    print(spec.to_yaml(), end="")
    print(f"\n# ---- sbatch script (would be written to {script_path}) ----")
    print(render.render_sbatch(spec, run_spec_files(spec) if spec.sweep else str(spec_file)), end="")
    print("\n# ---- data plan ----")
    print(_data_plan(spec, loaded.source))
    print("\n# dry run: nothing written, nothing submitted")


def describe_sweep(spec: JobSpec) -> str:
    """The runs of a sweep: index, name and the values that set it apart, and where its files go."""
    runs = expand(spec)
    lines = [f"# sweep: {len(runs)} runs as one job array (--array={render.array_range(spec)}: "
             f"at most {spec.slurm.array_parallelism} at once); each run differs only in:"]
    width = max(len(run.spec.name) for run in runs)
    lines += [f"#   [{run.index}] {run.spec.name:<{width}}  {run.describe()}" for run in runs]
    lines += [f"# run specs: {run_spec_files(spec)}",
              f"# checkpoints: {spec.checkpoint.dir}/<run name>; TensorBoard: {spec.logging.tensorboard_dir}/<run name>",
              f"# compare them: tensorboard --logdir {spec.logging.tensorboard_dir}  (HParams tab)"]
    return "\n".join(lines)


def _data_plan(spec: JobSpec, source: str) -> str:
    if "://" in spec.data.uri:
        return f"skipped for object storage in a dry run; see it with: lance-hpc plan {source}"
    try:
        from lance_hpc.data import plan_data

        return str(plan_data(spec.data, spec.slurm.world_size))
    except Exception as error:  # a dry run reports what it cannot show instead of stopping
        return f"unavailable: {error}"


def make_executor(spec: JobSpec, folder: Path) -> submitit.SlurmExecutor:
    """A submitit SlurmExecutor asking for the same resources, setup and srun options as the script."""
    python = shlex.join(render.python_command(spec))  # in the container, if the spec has one
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
        setup=[render.STRICT_MODE, *render.setup_lines(spec)],  # a failing setup line stops the job
        srun_args=[arg for arg in render.srun_args(spec) if arg != "--unbuffered"],  # submitit adds it
        additional_parameters=additional,
        wckey=None,
    )
    return executor


def check_data(spec: JobSpec) -> None:
    """Fail before any GPU hour is spent if the job could not open its data."""
    from lance_hpc.data import preflight

    preflight(spec.data)
    print(f"data preflight ok: {spec.data.uri}" + (f" and {spec.data.val_uri}" if spec.data.val_uri else ""))
    check_task(spec)


def check_task(spec: JobSpec) -> None:
    """The task's columns and types against the datasets, unless ingest has yet to create them."""
    from lance_hpc.data.storage import dataset_exists, storage_options
    from lance_hpc.tasks import load_task

    uris = [uri for uri in (spec.data.uri, spec.data.val_uri) if uri]
    if all(dataset_exists(uri, storage_options(uri, spec.data.storage_options)) for uri in uris):
        load_task(spec)
        print(f"task check ok: {spec.task.name} reads what it needs from the data")


def submit(spec: JobSpec, wait: bool = False, check: bool = True) -> int:
    """Submit through submitit; print the job id, log paths and how to watch it."""
    _check_slurm_commands()
    if check:
        check_data(spec)
    try:
        from lance_hpc.run import SubmititJob
    except ImportError as error:
        raise UserError(f"cannot load the job entry point lance_hpc.run: {error}") from None
    spec_file, script_path = write_job_files(spec)

    executor = make_executor(spec, Path(spec.slurm.log_dir) / "submitit")
    if spec.sweep:
        return submit_sweep(spec, executor, script_path, wait)
    try:
        with contextlib.redirect_stderr(io.StringIO()):  # submitit prints sbatch's stderr; we explain it below
            job = executor.submit(SubmititJob(str(spec_file)))
    except (submitit_utils.FailedJobError, submitit_utils.FailedSubmissionError, OSError) as error:
        raise UserError(_explain_sbatch_failure(str(error))) from None
    from lance_hpc.manage.records import record_submission  # imported here: lance_hpc.manage imports this module

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
    from lance_hpc.run import SubmititJob

    runs = expand(spec)
    try:
        with contextlib.redirect_stderr(io.StringIO()), executor.batch():  # one array: submitit's map_count
            jobs = [executor.submit(SubmititJob(str(run_spec_file(spec, run)))) for run in runs]
    except (submitit_utils.FailedJobError, submitit_utils.FailedSubmissionError, OSError) as error:
        raise UserError(_explain_sbatch_failure(str(error))) from None
    array_id = jobs[0].job_id.split("_")[0]
    from lance_hpc.manage.records import record_submission  # imported here: lance_hpc.manage imports this module

    record_submission(spec, array_id, via="submitit")
    print(f"submitted job array {array_id} ({spec.name}: {len(runs)} runs, at most {spec.slurm.array_parallelism} "
          f"at once, {spec.slurm.world_size} tasks each)")
    for run, job in zip(runs, jobs):
        print(f"  {job.job_id:<12} {run.spec.name}  ({run.describe()})")
    print(f"  specs    {run_spec_files(spec)}")
    print(f"  script   {script_path}  (the same array for your own sbatch)")
    print(f"  logs     {Path(jobs[0].paths.stdout).parent}/{array_id}_<index>_0_log.out")
    print(f"  status   squeue -j {array_id}")
    print(f"  compare  tensorboard --logdir {spec.logging.tensorboard_dir}  (HParams tab)")
    if not wait:
        return 0
    return max(wait_for(job) for job in jobs)


def run_sweep_locally(spec: JobSpec, nproc: int | None) -> int:
    """Run a sweep's runs here one after another. A failed run does not stop the others (each is
    its own experiment); an interrupted one (Ctrl-C) stops the sweep. Returns the first non-zero
    exit code, or 0."""
    from lance_hpc.launch import run_local

    runs = expand(spec)
    write_job_files(spec)
    results: list[tuple[SweepRun, int]] = []
    for run in runs:
        print(f"==== sweep run {run.index + 1}/{len(runs)}: {run.spec.name} ({run.describe()})", flush=True)
        code = run_local(run_spec_file(spec, run), nproc or run.spec.slurm.world_size)
        results.append((run, code))
        if code in (ExitCode.STOPPED, ExitCode.INTERRUPTED):
            break
    print(f"==== sweep {spec.name}: {sum(code == 0 for _, code in results)} of {len(runs)} runs finished")
    for run, code in results:
        stopped = "stopped; run the same command again to continue"
        outcome = {ExitCode.OK: "finished", ExitCode.STOPPED: stopped, ExitCode.INTERRUPTED: stopped}.get(
            code, f"failed (exit {int(code)})")
        print(f"  [{run.index}] {run.spec.name}: {outcome}")
    for run in runs[len(results):]:
        print(f"  [{run.index}] {run.spec.name}: not started")
    return next((code for _, code in results if code != 0), 0)


def wait_for(job: submitit.Job) -> int:
    """Wait for a submitit job to end; print its result, or its exit status and where its logs are."""
    tasks = [job.task(index) for index in range(job.num_tasks)]
    state, exit_code = "PENDING", "?"
    # Our own loop: submitit's wait() asks sacct, which clusters without accounting do not have.
    while not all(task.paths.result_pickle.exists() for task in tasks):
        state, exit_code = job_state(job.job_id)
        if state in FINAL_STATES:
            break
        time.sleep(2)
    if all(task.paths.result_pickle.exists() for task in tasks):
        failed = [(index, task) for index, task in enumerate(tasks) if task.exception() is not None]
        if not failed:
            print(f"job {job.job_id} finished: {job.results()[0]}")
            return 0
        # The task that failed first holds the cause; the others usually just lost contact with it.
        first_index, first = min(failed, key=lambda item: item[1].paths.result_pickle.stat().st_mtime)
        print(f"job {job.job_id} failed; task {first_index} failed first: {first.exception()}", file=sys.stderr)
        others = [str(index) for index, _ in failed if index != first_index]
        if others:
            print(f"tasks {', '.join(others)} failed too; their logs are in {job.paths.folder}", file=sys.stderr)
        return ExitCode.FAILED
    print(f"job {job.job_id} ended {state} with exit code {exit_code} and no result; the end of its log:",
          file=sys.stderr)
    print(_tail(Path(job.paths.stderr)), file=sys.stderr)
    print(f"  logs: {job.paths.stderr}\n        {job.paths.stdout}", file=sys.stderr)
    return ExitCode.FAILED


def _tail(path: Path, lines: int = 15) -> str:
    if not path.exists():
        return f"    ({path} was not written)"
    return "\n".join(f"    | {line}" for line in path.read_text(errors="replace").splitlines()[-lines:])


def job_state(job_id: str) -> tuple[str, str]:
    """(state, exit code) from scontrol, which needs no accounting database; sacct as fallback."""
    shown = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True)
    fields = dict(word.split("=", 1) for word in shown.stdout.split() if "=" in word)
    if "JobState" in fields:
        return fields["JobState"], fields.get("ExitCode", "?")
    accounted = subprocess.run(
        ["sacct", "-n", "-X", "-P", "-o", "State,ExitCode", "-j", job_id], capture_output=True, text=True
    )
    line = accounted.stdout.strip().splitlines()[:1]
    if accounted.returncode == 0 and line:
        state, _, exit_code = line[0].partition("|")
        return state.split()[0], exit_code
    return "UNKNOWN", "?"


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


def build_parser(prog: str = "python -m lance_hpc.submit") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Validate a job spec, render its sbatch script and submit it to SLURM through submitit; "
        "or only render it, dry-run it, or run it on this machine.",
        epilog="examples:\n"
        "  %(prog)s jobs/quickstart.yaml --local            # train here, 2 processes\n"
        "  %(prog)s jobs/map_gpu.yaml --dry-run             # show spec, script and data plan\n"
        "  %(prog)s jobs/map_gpu.yaml --set slurm.nodes=4   # submit with an override\n"
        "  %(prog)s jobs/map_gpu.yaml --sweep train.lr=0.1,0.05 --sweep data.batch_size=64,128\n"
        "                                                   # 4 runs as one job array\n"
        "  %(prog)s jobs/map_gpu.yaml --render-only -o job.sbatch && sbatch job.sbatch",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("spec", help="job spec YAML file")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a spec field, e.g. --set train.lr=0.05 (repeatable)")
    parser.add_argument("--sweep", action="append", default=[], metavar="KEY=V1,V2",
                        help="sweep a spec field over values, e.g. --sweep train.lr=0.1,0.05 (repeatable: every "
                        "combination is one run of one job array; adds to the spec's sweep section)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--render-only", action="store_true",
                      help="write the sbatch script and the resolved spec; submit nothing")
    mode.add_argument("--dry-run", action="store_true",
                      help="print the resolved spec, the script and the data plan; write and submit nothing")
    mode.add_argument("--local", action="store_true", help="run the job on this machine without SLURM "
                      "(a sweep's runs one after another; a failed run does not stop the rest)")
    parser.add_argument("-o", "--output", type=Path, metavar="FILE",
                        help="with --render-only: script path [<log_dir>/<name>.sbatch]")
    parser.add_argument("--nproc", type=int, metavar="N", help="with --local: processes [the spec's world size]")
    parser.add_argument("--no-preflight", action="store_true",
                        help="submit without first checking that the dataset (and bucket, credentials) can be opened")
    parser.add_argument("--wait", action="store_true",
                        help="after submitting, wait for the job and report how it ended (exit 1 if it failed)")
    return parser


def main(argv: Sequence[str] | None = None, prog: str = "python -m lance_hpc.submit") -> int:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    if args.output and not args.render_only:
        parser.error("-o/--output goes with --render-only")
    if args.nproc is not None and not args.local:
        parser.error("--nproc goes with --local")
    try:
        loaded = load_spec(args.spec, args.set, sweeps=args.sweep)
        if args.dry_run:
            dry_run(loaded)
            return 0
        if args.render_only:
            spec_file, script_path = write_job_files(loaded.spec, args.output)
            reads = run_spec_files(loaded.spec) if loaded.spec.sweep else spec_file
            print(f"wrote {script_path}\n  (its tasks read {reads})\nsubmit it with: sbatch {script_path}")
            return 0
        if args.local and loaded.spec.sweep:
            return run_sweep_locally(loaded.spec, args.nproc)
        if args.local:
            from lance_hpc.launch import run_local

            spec_file, _ = write_job_files(loaded.spec)
            return run_local(spec_file, args.nproc or loaded.spec.slurm.world_size)
        return submit(loaded.spec, wait=args.wait, check=not args.no_preflight)
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        return ExitCode.USER_ERROR


if __name__ == "__main__":
    sys.exit(main())
