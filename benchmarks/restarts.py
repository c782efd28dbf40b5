"""The restarts section: what a dead rank costs a job on the SLURM test cluster (two emulated nodes
on this machine, tests/support/slurm_cluster.py; root and Debian's SLURM packages), restarted
inside its allocation against the same job through a requeue.

The job: the digits, 4 ranks on 2 nodes (gloo), every step logged. Each mode runs in its own worker
process with a cluster of its own. Once the job is well under way (restart: its next attempt's ranks
are started and waiting, as they are from an attempt's first steps on), rank 1 is SIGKILLed:

- restart: ``slurm.max_restarts: 2``: the supervisor starts the job again in the same allocation;
- requeue: ``slurm.max_restarts: 0``, and ``scontrol requeue`` at once, the quickest a requeue can
  come (the test cluster holds a requeued job 5 s; a real queue adds its wait to this path only).

Measured from the kill to the first step logged after it, and the steps done again (the steps since
the checkpoint the job resumed from). ``python -m benchmarks --sections restarts --tiny`` measures it
with the benchmark; ``python -m benchmarks.restarts`` alone.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.report import Target
from benchmarks.sections import Context, SectionReport, Summaries
from lance_hpc.bench.configs import Measurement, Result

KIND = "restarts"
DATASET = "digits"
MODES = ("restart", "requeue")
TARGET = 0.5  # restart / requeue, from the kill to the first step after it
KILL_AFTER_STEP = 30
STEP = re.compile(r"^0: step (\d+)/", re.MULTILINE)
RESUMED = re.compile(r"resuming from \S+ at step (\d+)")


def configs(context: Context) -> list[Measurement]:
    return [Measurement(mode, KIND, DATASET, data={"mode": mode}) for mode in MODES]


def measure(config: Measurement) -> Result:
    """One mode on a test cluster of its own: the seconds from the kill to the first step after it."""
    from tests.support import slurm_cluster

    with tempfile.TemporaryDirectory(prefix="lance_hpc-restarts-") as work:
        Path(work).chmod(0o755)  # munged wants every directory above its socket searchable
        started = time.perf_counter()
        cluster = slurm_cluster.start(Path(work) / "cluster")
        try:
            figures = _kill_and_time(cluster, Path(work), config.data["mode"])
        finally:
            slurm_cluster.stop(cluster)
    return Result(
        label=config.label,
        dataset=config.dataset,
        images_per_s=0.0,
        first_batch_s=figures["seconds"],
        images=0,
        batches=int(figures["steps_redone"]),
        seconds=time.perf_counter() - started,
        main_rss_mib=0.0,
        worker_rss_mib=0.0,
        worker_growth_mib=0.0,
        store=figures,
    )


def _kill_and_time(cluster: Any, work: Path, mode: str) -> dict[str, float]:
    from lance_hpc.ingest import ensure_dataset
    from lance_hpc.spec import DataSpec, IngestSpec, load_spec
    from tests.support.jobs import Digits, write_spec
    from tests.support.slurm import environ, sbatch

    digits = Digits(str(work / "train.lance"), str(work / "val.lance"))
    ingest = IngestSpec(source="sklearn-digits", val_fraction=0.2, rows_per_fragment=256, seed=0)
    ensure_dataset(DataSpec(uri=digits.train, val_uri=digits.val, ingest=ingest))
    slurm = {
        "partition": cluster.partition, "nodes": 2, "tasks_per_node": 2, "cpus_per_task": 1, "time": "00:30:00",
        "max_restarts": 2 if mode == "restart" else 0, "restart_standby": mode == "restart", "log_dir": str(work / "logs"),
    }  # fmt: skip
    sections = {"slurm": slurm, "train": {"epochs": 100}, "logging": {"log_every_steps": 1, "progress": False}}
    spec = load_spec(write_spec(work / "job", digits, name="restarts", checkpoint={"every_steps": 10}, **sections)).spec
    job = sbatch(cluster, spec)
    out = Path(spec.slurm.log_dir) / f"restarts-{job}.out"
    ready = "are started and waiting" if mode == "restart" else f"0: step {KILL_AFTER_STEP}/"
    _wait(lambda: ready in _read(out) and _last_step(_read(out)) >= KILL_AFTER_STEP, f"{ready!r} in {out}")
    killed_at = time.monotonic()
    os.kill(_rank_pid(job, 1), signal.SIGKILL)
    if mode == "requeue":
        subprocess.run(["scontrol", "requeue", job], env=environ(cluster), check=True, capture_output=True)
    marker = "lance_hpc: attempt 2 of" if mode == "restart" else "(restart 1) on"
    _wait(lambda: marker in _read(out) and STEP.search(_read(out).split(marker, 1)[1]) is not None, f"a step after {marker!r}")
    seconds = time.monotonic() - killed_at
    text = _read(out)
    before, after = text.split(marker, 1)
    match = RESUMED.search(after)
    resumed = int(match.group(1)) if match else 0
    subprocess.run(["scancel", job], env=environ(cluster), capture_output=True)
    return {"seconds": seconds, "steps_redone": float(max(_last_step(before) - resumed, 0)), "resumed_at": float(resumed)}


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def _last_step(text: str) -> int:
    return max((int(step) for step in STEP.findall(text)), default=0)


def _wait(condition: Any, what: str, timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} within {timeout_s:.0f} s")
        time.sleep(0.05)


def _rank_pid(job: str, rank: int) -> int:
    """The running (not standby) rank ``rank`` of ``job``: the emulated nodes are this machine."""
    from tests.support.slurm import is_rank_command, is_standby

    for entry in Path("/proc").iterdir():
        try:
            command = (entry / "cmdline").read_bytes().split(b"\0")
            environ = set((entry / "environ").read_bytes().split(b"\0"))
        except OSError:
            continue
        wanted = {f"SLURM_JOB_ID={job}".encode(), f"SLURM_PROCID={rank}".encode()}
        if entry.name.isdigit() and is_rank_command(command) and wanted <= environ and not is_standby(environ):
            return int(entry.name)
    raise LookupError(f"rank {rank} of job {job} not found")


def _median(summary: Any, key: str) -> float:
    values = sorted(run[0].store[key] for run in summary.ok_runs)
    return values[len(values) // 2] if values else 0.0


def section_report(context: Context, summaries: Summaries) -> SectionReport:
    found = {label: summary for (dataset, label), summary in summaries.items() if dataset == DATASET}
    header = ["path", "kill to first step s", "steps redone", "runs"]
    rows = []
    for mode in MODES:
        summary = found.get(mode)
        if summary is None or not summary.ok_runs:
            rows.append([mode, "failed", "-", "0"])
            continue
        rows.append(
            [mode, f"{_median(summary, 'seconds'):.1f}", f"{_median(summary, 'steps_redone'):.0f}", str(len(summary.ok_runs))]
        )
    restart = found.get("restart")
    requeue = found.get("requeue")
    targets = []
    if restart and requeue and restart.ok_runs and requeue.ok_runs:
        ratio = _median(restart, "seconds") / _median(requeue, "seconds")
        detail = f"{ratio:.2f}x ({_median(restart, 'seconds'):.1f} s vs {_median(requeue, 'seconds'):.1f} s; wanted <= {TARGET}x)"
        targets.append(Target("a dead rank, restart in the allocation vs requeue (kill to first step)", ratio <= TARGET, detail))
    title = (
        "restarts on the SLURM test cluster: rank 1 of 4 (2 nodes x 2) SIGKILLed, restarted inside the allocation "
        "(its next ranks started ahead) against a requeue issued at once (the cluster holds a requeued job 5 s)"
    )
    widths = [max(len(row[index]) for row in [header, *rows]) for index in range(len(header))]
    text = [title, "  ".join(cell.ljust(width) for cell, width in zip(header, widths))]
    text += ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)) for row in rows]
    text += [target.line() for target in targets]
    markdown = [f"## Restarts\n\n{title}\n", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    markdown += ["| " + " | ".join(row) + " |" for row in rows] + [""] + [f"- {target.line()}" for target in targets] + [""]
    return SectionReport(text=text, markdown=markdown, targets=targets)


def main() -> int:
    """Both modes here, one after the other; prints each and the ratio."""
    figures = {}
    for mode in MODES:
        result = measure(Measurement(mode, KIND, DATASET, data={"mode": mode}))
        figures[mode] = result.store
        print(
            f"{mode:8} {result.store['seconds']:6.1f} s from the kill to the first step, {result.store['steps_redone']:.0f} steps redone"
        )
    ratio = figures["restart"]["seconds"] / figures["requeue"]["seconds"]
    print(f"restart / requeue: {ratio:.2f}x (wanted <= {TARGET}x)")
    return 0 if ratio <= TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
