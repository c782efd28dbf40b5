"""``--dry-run``: what a submission would do, printed; nothing written, no cluster asked."""

from __future__ import annotations

from lance_hpc.kinds import job_kind
from lance_hpc.launch import render
from lance_hpc.launch.paths import JobPaths
from lance_hpc.spec import JobSpec, LoadedSpec, expand
from lance_hpc.spec.schema import entry_note


def dry_run(loaded: LoadedSpec) -> None:
    """Print what a submission would do; writes nothing and talks to no cluster."""
    spec = loaded.spec
    paths = JobPaths.of(spec)
    spec_file, script_path = paths.spec_file, paths.script
    print(
        f"# {loaded.source}: valid; {spec.slurm.nodes} node(s) x {spec.slurm.ntasks_per_node} task(s) = "
        f"world size {spec.slurm.world_size}"
    )
    print("# placeholders and relative paths resolved:")
    for item in loaded.resolutions or ():
        print(f"#   {item.path}: {item.before} -> {item.after}")
    note = entry_note(spec)
    if note:
        print(f"# {note}")
    if spec.sweep:
        print(describe_sweep(spec))
    print(f"\n# ---- resolved spec (would be written to {spec_file}) ----")
    print(spec.to_yaml(), end="")
    print(f"\n# ---- sbatch script (would be written to {script_path}) ----")
    print(render.render_sbatch(spec, paths.task_spec(bool(spec.sweep))), end="")
    print("\n# ---- data plan ----")
    print(_data_plan(spec, loaded.source))
    print("\n# dry run: nothing written, nothing submitted")


def describe_sweep(spec: JobSpec) -> str:
    """The runs of a sweep: index, name and the values that set it apart, and where its files go."""
    runs = expand(spec)
    lines = [
        f"# sweep: {len(runs)} runs as one job array (--array={render.array_range(spec)}: "
        f"at most {spec.slurm.array_parallelism} at once); each run differs only in:"
    ]
    width = max(len(run.spec.name) for run in runs)
    lines += [f"#   [{run.index}] {run.spec.name:<{width}}  {run.describe()}" for run in runs]
    lines += [
        f"# run specs: {JobPaths.of(spec).run_specs}",
        f"# checkpoints: {spec.checkpoint.dir}/<run name>; TensorBoard: {spec.logging.tensorboard_dir}/<run name>",
        f"# compare them: tensorboard --logdir {spec.logging.tensorboard_dir}  (HParams tab)",
    ]
    return "\n".join(lines)


def _data_plan(spec: JobSpec, source: str) -> str:
    """The job's kind says what its ranks would read or write."""
    try:
        return job_kind(spec.job).plan(spec, source)
    except Exception as error:  # a dry run reports what it cannot show instead of stopping
        return f"unavailable: {error}"
