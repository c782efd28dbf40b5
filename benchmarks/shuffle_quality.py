"""How well each training strategy mixes a dataset written in class order (the worst case for
strategies that read neighbouring rows together), in two ways:

- from the planned batches alone (pure planning, :func:`lance_hpc.loading.sampling.epoch_batches`
  with the options the loader passes): the mean number of distinct labels per batch against what a
  full random permutation gives, and the spread of each batch's rows over the dataset (the standard
  deviation of their positions over the row count) against a random batch's;
- from training: the quickstart model (``jobs/quickstart.yaml``: digits, small_cnn at 16 px) trained
  for a few epochs as a real local job (``python -m lance_hpc.submit SPEC --local --nproc 1``) on the
  digits' training split sorted by label, one job per strategy, and its validation accuracy.

The class-ordered digits are lance_hpc's own ingest of ``sklearn-digits`` (the quickstart's split,
validation untouched), its training split written again sorted by label; cached in the data
directory like the benchmark's other data sets.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import yaml

from benchmarks.ingest import timed
from lance_hpc.bench.configs import Measurement, Result
from lance_hpc.loading.sampling import FragmentTable, epoch_batches

REPO_ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = REPO_ROOT / "jobs" / "quickstart.yaml"
# Bump when the class-ordered digits' layout changes, so an old copy is rebuilt.
ORDERED_FORMAT = 1
ROWS_PER_FRAGMENT = 256  # the quickstart's ingest
# sampler: block on the digits (about 1,438 training rows): runs of about this many rows, this many
# runs shuffled together, so the set has many runs and a window holds a few of the ten classes.
DIGITS_RUN_ROWS = 12
DIGITS_WINDOW_RUNS = 16
# (sampler, style) of every training strategy, and those trained for accuracy.
STRATEGIES = (("distributed", "map"), ("block", "map"), ("sharded_batch", "iterable"), ("sharded_fragment", "iterable"))
TRAINED = ("distributed", "block", "sharded_fragment")
EPOCHS = 4
TINY_MAX_STEPS = 12  # --tiny: a few steps per job, enough to run the whole path
PLANNED_EPOCHS = 3  # batch statistics average over this many epochs' plans
RANDOM_BATCHES = 2000  # random batches drawn for a random permutation's position spread
FINAL_LINE = re.compile(r"final validation accuracy: ([0-9.]+) \(loss ([0-9.]+)\) after (\d+) steps")
TRAIN_KIND = "choose_train"


def digits_batch_size() -> int:
    """The quickstart's per-rank batch, which the trainings keep."""
    return int(yaml.safe_load(QUICKSTART.read_text())["data"]["batch_size"])


def train_label(sampler: str) -> str:
    return f"train quickstart model, {sampler}"


# ---- the class-ordered digits -------------------------------------------------------------------


@dataclass(frozen=True)
class OrderedDigits:
    """The digits' training split sorted by label, and the untouched validation split."""

    train_uri: str
    val_uri: str
    rows: int
    bytes_per_row: float

    @property
    def block_kb(self) -> int:
        """data.block_kb for runs of about DIGITS_RUN_ROWS rows on this set."""
        return max(1, round(DIGITS_RUN_ROWS * self.bytes_per_row / 1024))

    @property
    def run_rows(self) -> int:
        """Rows of one block read at :attr:`block_kb`, as the loader computes them."""
        return max(1, math.ceil(self.block_kb * 1024 / max(self.bytes_per_row, 1.0)))


def prepare_ordered_digits(data_dir: Path, log: Any = print) -> OrderedDigits:
    """The class-ordered digits under ``data_dir/digits-ordered``, written unless already there."""
    import lance

    from lance_hpc.ingest.dataset import ingest
    from lance_hpc.loading.selection import bytes_per_row

    directory = data_dir / "digits-ordered"
    manifest_path = directory / "manifest.json"
    train, val = directory / "train_by_label.lance", directory / "val.lance"
    if not (manifest_path.is_file() and json.loads(manifest_path.read_text()).get("format") == ORDERED_FORMAT):
        log(f"writing the digits sorted by label in {directory} ...")
        staging = directory.with_name(directory.name + ".tmp")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        ingest("sklearn-digits", str(staging / "train.lance"), str(staging / val.name), rows_per_fragment=ROWS_PER_FRAGMENT)
        table = lance.dataset(str(staging / "train.lance")).to_table()
        table = table.take(np.argsort(table.column("label").to_numpy(), kind="stable"))
        lance.write_dataset(table, str(staging / train.name), max_rows_per_file=ROWS_PER_FRAGMENT)
        shutil.rmtree(staging / "train.lance")
        (staging / "manifest.json").write_text(json.dumps({"format": ORDERED_FORMAT}))
        shutil.rmtree(directory, ignore_errors=True)
        staging.rename(directory)
    dataset = lance.dataset(str(train))
    rows = dataset.count_rows()
    return OrderedDigits(str(train), str(val), rows, bytes_per_row(dataset, rows))


# ---- batch statistics from the plan --------------------------------------------------------------


@dataclass(frozen=True)
class BatchOrder:
    """What one strategy's planned batches look like on a class-ordered dataset."""

    sampler: str
    batches: int  # over the planned epochs
    distinct_labels: float  # mean distinct labels per batch
    random_distinct_labels: float  # the same for batches of those sizes from a random permutation
    spread: float  # mean over batches of the std of the rows' positions / rows
    random_spread: float  # the same for random batches

    @property
    def distinct_ratio(self) -> float:
        return self.distinct_labels / self.random_distinct_labels if self.random_distinct_labels else 0.0

    @property
    def spread_ratio(self) -> float:
        return self.spread / self.random_spread if self.random_spread else 0.0


def _log_choose(n: int, k: int) -> float:
    return math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)


def expected_distinct_labels(class_counts: Sequence[int], batch_size: int) -> float:
    """Distinct labels in ``batch_size`` rows drawn without replacement (hypergeometric): each class
    is absent with probability C(N - n_c, B) / C(N, B)."""
    total = sum(class_counts)
    found = 0.0
    for count in class_counts:
        if total - count >= batch_size:
            found += 1.0 - math.exp(_log_choose(total - count, batch_size) - _log_choose(total, batch_size))
        else:
            found += 1.0
    return found


def random_spread(rows: int, batch_size: int, draws: int = RANDOM_BATCHES) -> float:
    """Mean std of positions / rows of ``batch_size`` rows drawn at random (seeded, so reproducible)."""
    rng = np.random.default_rng(0)
    spreads = [np.std(rng.choice(rows, size=batch_size, replace=False)) / rows for _ in range(draws)]
    return float(np.mean(spreads))


def batch_order(
    labels: np.ndarray, table: FragmentTable, sampler: str, batch_size: int, epochs: int = PLANNED_EPOCHS, **options: Any
) -> BatchOrder:
    """Statistics of ``sampler``'s batches on one rank (world size 1) over ``epochs`` epochs of a
    dataset whose row ``i`` has ``labels[i]``; ``options`` as :func:`epoch_batches` takes them."""
    rows = table.total_rows
    counts = np.bincount(labels).tolist()
    distinct, reference, spreads = [], [], []
    for epoch in range(epochs):
        for batch in epoch_batches(table, sampler, 0, 1, batch_size, epoch=epoch, **options):
            distinct.append(len(np.unique(labels[batch])))
            reference.append(expected_distinct_labels(counts, len(batch)))
            spreads.append(float(np.std(batch)) / rows)
    return BatchOrder(
        sampler,
        len(distinct),
        float(np.mean(distinct)),
        float(np.mean(reference)),
        float(np.mean(spreads)),
        random_spread(rows, batch_size),
    )


def ordered_labels(uri: str) -> np.ndarray:
    """The labels of ``uri`` sorted: the labels of the same rows written in class order."""
    import lance

    return np.sort(lance.dataset(uri).to_table(columns=["label"]).column("label").to_numpy())


# ---- training on the class-ordered digits ------------------------------------------------------


def training_configs(digits: OrderedDigits, records: Path, tiny: bool) -> list[Measurement]:
    """One real local training job per trained strategy, measured whole."""
    found = []
    for sampler in TRAINED:
        overrides = [f"data.sampler={sampler}", f"data.style={dict(STRATEGIES)[sampler]}"]
        if sampler == "block":
            overrides += [f"data.block_kb={digits.block_kb}", f"data.block_window={DIGITS_WINDOW_RUNS}"]
        data = {
            "out": str(records.parent / "train_work"),
            "records": str(records),
            "train_uri": digits.train_uri,
            "val_uri": digits.val_uri,
            "sets": overrides,
            "epochs": EPOCHS if not tiny else 1,
            "max_steps": TINY_MAX_STEPS if tiny else None,
        }
        found.append(Measurement(train_label(sampler), TRAIN_KIND, "digits-by-label", num_workers=0, data=data))
    return found


def _spec(config: Measurement, out: Path) -> Path:
    """jobs/quickstart.yaml on the class-ordered digits, one rank, its outputs under ``out``."""
    raw = yaml.safe_load(QUICKSTART.read_text())
    raw["name"] = "choose_" + config.label.rsplit(" ", 1)[-1]
    raw["slurm"].update(tasks_per_node=1, log_dir=str(out / "logs"))
    raw["data"].update(uri=config.data["train_uri"], val_uri=config.data["val_uri"])
    raw["data"].pop("ingest", None)
    raw["train"].update(epochs=config.data["epochs"], seed=0, deterministic=True)
    if config.data["max_steps"]:
        raw["train"]["max_steps"] = config.data["max_steps"]
    raw["checkpoint"].update(dir=str(out / "checkpoints"), every_steps=10_000)
    raw["logging"].update(tensorboard_dir=str(out / "runs"), progress=False)
    path = out / "job.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def run_training(config: Measurement, out: Path) -> int:
    """The job, from a fresh checkpoint directory; appends its validation accuracy to the records
    file and returns the samples it trained on."""
    command = [sys.executable, "-m", "lance_hpc.submit", str(_spec(config, out)), "--local", "--nproc", "1"]
    for override in config.data["sets"]:
        command += ["--set", override]
    done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True)
    print(done.stdout + done.stderr)  # into the measurement's log
    found = FINAL_LINE.search(done.stdout)
    if done.returncode != 0 or found is None:
        raise RuntimeError(f"the training job failed (exit {done.returncode}): {(done.stderr or done.stdout)[-800:]}")
    accuracy, loss, steps = float(found.group(1)), float(found.group(2)), int(found.group(3))
    record = {"label": config.label, "accuracy": accuracy, "loss": loss, "steps": steps, "epochs": config.data["epochs"]}
    with open(config.data["records"], "a") as records:
        records.write(json.dumps(record) + "\n")
    return steps * digits_batch_size()


def measure(config: Measurement) -> Result:
    """One training job timed whole, samples trained per second (its accuracy goes to the records file)."""
    return timed(config, run_training)


def read_records(path: Path) -> dict[str, list[dict[str, Any]]]:
    """The training records by label, in the order they were written."""
    found: dict[str, list[dict[str, Any]]] = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            record = json.loads(line)
            found.setdefault(record["label"], []).append(record)
    return found
