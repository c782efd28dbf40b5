"""Inference and evaluation jobs: a trained checkpoint over a dataset's fragments on local ranks,
new typed columns in row order committed once, the image files untouched, resume after a killed
rank, columns that exist refused (or replaced in a new version), a dataset that moved on reported,
an evaluation's metrics, and S3 through the loopback server."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import lance
import numpy as np
import pyarrow as pa
import pytest
import yaml

from lance_hpc.checkpoint.stores import open_store
from lance_hpc.ingest import ensure_dataset
from lance_hpc.loading.loader import RowsLoader
from lance_hpc.runtime.environment import detect, select_device
from lance_hpc.spec import DataSpec, IngestSpec, load_spec
from lance_hpc.writeback import column_swap
from lance_hpc.writeback.job import load_model
from tests.support.infer import FAIL_AFTER_BATCHES
from tests.support.jobs import BASE_SPEC, REPO_ROOT, Digits, train_here, write_spec
from tests.support.ranks import launch, rank_pid, read_until

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Digits, Path]:
    """The digits in fragments of 64 rows (the validation set: 6 fragments) and a checkpoint of one epoch."""
    root = tmp_path_factory.mktemp("infer")
    dataset = Digits(str(root / "train.lance"), str(root / "val.lance"))
    ingest = IngestSpec(source="sklearn-digits", val_fraction=0.2, rows_per_fragment=64, seed=0)
    ensure_dataset(DataSpec(uri=dataset.train, val_uri=dataset.val, ingest=ingest))
    spec = write_spec(root / "train", dataset, train={"epochs": 1})
    assert train_here(spec).status == "completed"
    return dataset, root / "train" / "checkpoints"


def infer_spec(tmp_path: Path, uri: str, checkpoint: Path, job: str = "infer", **infer: object) -> Path:
    raw = {
        "name": "digits_infer",
        "job": job,
        "slurm": {"tasks_per_node": 2, "log_dir": str(tmp_path / "logs")},
        "data": {"uri": uri, "batch_size": 32, "num_workers": 0},
        "task": BASE_SPEC["task"],
        "checkpoint": {"dir": str(tmp_path / "checkpoints")},
        "logging": {"tensorboard_dir": str(tmp_path / "runs"), "progress": False},
        "infer": {"checkpoint": str(checkpoint), **infer},
    }
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / f"{job}.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def without_restarts(spec: Path) -> None:
    """slurm.max_restarts: 0 in the job spec at ``spec``: a failed attempt ends the job."""
    raw = yaml.safe_load(spec.read_text())
    raw["slurm"]["max_restarts"] = 0
    spec.write_text(yaml.safe_dump(raw, sort_keys=False))


def copy_of(uri: str, tmp_path: Path) -> str:
    target = tmp_path / "data.lance"
    shutil.copytree(uri, target)
    return str(target)


def function_spec(tmp_path: Path, uri: str, function: str, **infer: object) -> Path:
    """An inference job with ``infer.function`` and no checkpoint (no model at all)."""
    spec = infer_spec(tmp_path, uri, Path("unused"), function=function, **infer)
    raw = yaml.safe_load(spec.read_text())
    raw["infer"].pop("checkpoint")
    spec.write_text(yaml.safe_dump(raw))
    return spec


def run_local(spec: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "lance_hpc.submit", str(spec), "--local"]
    return subprocess.run(
        command, capture_output=True, text=True, cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": str(REPO_ROOT), **(env or {})}
    )


def data_files(uri: str) -> dict[str, int]:
    return {path.name: path.stat().st_size for path in (Path(uri) / "data").glob("*.lance")}


def kill_rank_1_after_its_first_fragment(spec: Path) -> subprocess.Popen:
    """Two local ranks; rank 1 killed once it has recorded a fragment; returns the launcher."""
    launcher = launch(spec)
    read_until(launcher, "rank 1: fragment")
    os.kill(rank_pid(launcher, 1), signal.SIGKILL)
    return launcher


OUTPUTS = {"embedding": "float16", "predicted": "int64", "score": "float32", "logits": "float32", "loss": "float64"}


def test_two_ranks_write_typed_columns_in_row_order_once_and_leave_the_images_alone(trained, tmp_path: Path) -> None:
    dataset, checkpoint = trained
    uri = copy_of(dataset.val, tmp_path)
    before = data_files(uri)
    spec = infer_spec(tmp_path, uri, checkpoint, outputs=OUTPUTS)
    dry = subprocess.run([sys.executable, "-m", "lance_hpc.submit", str(spec), "--dry-run"], capture_output=True, text=True)
    assert dry.returncode == 0 and "359 rows in 6 fragments" in dry.stdout, dry.stdout + dry.stderr
    done = run_local(spec)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("committed:") == 1 and "for 359 rows" in done.stdout
    table = lance.dataset(uri)
    assert table.version == 2
    types = {field.name: field.type for field in table.schema}
    assert types["embedding"] == pa.list_(pa.float16(), 128) and types["logits"] == pa.list_(pa.float32(), 10)
    assert (types["predicted"], types["score"], types["loss"]) == (pa.int64(), pa.float32(), pa.float64())
    # the same model over the rows in order, in this process: the columns are each row's own
    loaded = load_spec(spec).spec
    from lance_hpc.loading import load_task

    task = load_task(loaded)
    model, _ = load_model(loaded, task, select_device(detect({})))
    rows = np.arange(table.count_rows())
    loader = RowsLoader(loaded.data, task.decoder(train=False), 0, uri, 1, [rows[i : i + 50] for i in range(0, len(rows), 50)])
    import torch

    with torch.inference_mode():
        expected = [task.infer(model, task.to_device(batch, torch.device("cpu"))) for batch in loader]
    predicted = np.concatenate([batch["predicted"].numpy() for batch in expected])
    embedding = np.concatenate([batch["embedding"].numpy() for batch in expected])
    written = table.to_table(columns=["predicted", "embedding", "label"])
    assert (written.column("predicted").to_numpy() == predicted).all()
    found = np.stack(written.column("embedding").to_numpy(zero_copy_only=False)).astype(np.float32)
    assert np.allclose(found, embedding, rtol=1e-2, atol=1e-2)
    assert (predicted == written.column("label").to_numpy()).mean() > 0.8
    # the image files are the same files; the new ones hold only the new columns
    after = data_files(uri)
    assert {name: after[name] for name in before} == before
    per_row = 128 * 2 + 8 + 4 + 10 * 4 + 8
    assert sum(size for name, size in after.items() if name not in before) < 1.5 * per_row * 359
    # run again: already committed, nothing written
    again = run_local(spec)
    assert again.returncode == 0 and "already committed" in again.stdout and lance.dataset(uri).version == 2


def test_a_killed_rank_restarts_the_job_which_writes_only_its_missing_fragments_and_equals_an_uninterrupted_run(
    trained, tmp_path: Path
) -> None:
    dataset, checkpoint = trained
    uri = copy_of(dataset.val, tmp_path)
    spec = infer_spec(tmp_path, uri, checkpoint, outputs={"predicted": "int64"}, function="tests.support.infer:slow_predict")
    launcher = kill_rank_1_after_its_first_fragment(spec)
    output = launcher.communicate(timeout=300)[0]
    assert launcher.returncode == 0, output
    assert (
        "restart 1 of at most 2, resuming from what the job saved, after: rank 1 on localhost was killed by SIGKILL" in output
    ), output
    assert "rank 1: 2 fragment(s) written, 1 written before" in output and output.count("committed:") == 1, output
    whole = copy_of(dataset.val, tmp_path / "whole")
    assert run_local(infer_spec(tmp_path / "whole", whole, checkpoint, outputs={"predicted": "int64"})).returncode == 0
    assert lance.dataset(uri).to_table(columns=["predicted"]) == lance.dataset(whole).to_table(columns=["predicted"])


def test_an_existing_column_is_refused_then_replaced_in_a_new_version_when_asked(trained, tmp_path: Path) -> None:
    dataset, _ = trained
    uri = copy_of(dataset.val, tmp_path)
    spec = function_spec(tmp_path, uri, "tests.support.infer:label_twice", outputs={"twice": "int64"})
    assert run_local(spec).returncode == 0
    table = lance.dataset(uri).to_table(columns=["label", "twice"])
    assert (table.column("twice").to_numpy() == 2 * table.column("label").to_numpy()).all()
    again = run_local(spec)  # the same job again: its run is committed, nothing is written
    assert again.returncode == 0 and "already committed" in again.stdout and lance.dataset(uri).version == 2
    raw = yaml.safe_load(spec.read_text())
    raw["infer"]["filter"] = "label >= 0"  # another run (every row), over the column the first one wrote
    spec.write_text(yaml.safe_dump(raw))
    refused = run_local(spec)
    assert refused.returncode == 2 and "already has the column(s) twice" in refused.stderr and "infer.overwrite" in refused.stderr
    raw["infer"]["overwrite"] = True
    spec.write_text(yaml.safe_dump(raw))
    assert run_local(spec).returncode == 0
    assert lance.dataset(uri).version == 3  # the column replaced in the commit that wrote it again
    assert lance.dataset(uri).schema.names == ["image", "label", "twice"]
    assert "twice" in lance.dataset(uri, version=2).schema.names


def with_minus_ones(uri: str) -> int:
    """The user's own column ``twice`` (-1 in every row) added to the dataset; its new version."""
    dataset = lance.dataset(uri)
    dataset.add_columns({"twice": "label * 0 - 1"})
    return lance.dataset(uri).version


def test_a_failed_overwrite_leaves_the_latest_version_as_it_was_and_a_rerun_replaces_it_in_one_version(
    trained, tmp_path: Path
) -> None:
    dataset, _ = trained
    uri = copy_of(dataset.val, tmp_path)
    before = with_minus_ones(uri)
    spec = function_spec(tmp_path, uri, "tests.support.infer:label_twice_failing", outputs={"twice": "int64"}, overwrite=True)
    without_restarts(spec)
    failed = run_local(spec, {FAIL_AFTER_BATCHES: "4"})  # two fragments per rank written, then it fails
    assert failed.returncode != 0 and "failing at batch" in failed.stdout + failed.stderr, failed.stdout + failed.stderr
    latest = lance.dataset(uri)
    assert latest.version == before, f"the failed job committed version {latest.version}: {latest.schema}"
    assert latest.to_table(columns=["twice"]).column("twice").to_pylist() == [-1] * 359
    done = run_local(spec)
    assert done.returncode == 0, done.stdout + done.stderr
    latest = lance.dataset(uri)
    assert latest.version == before + 1 and latest.schema.names == ["image", "label", "twice"], latest.schema
    table = latest.to_table(columns=["label", "twice"])
    assert (table.column("twice").to_numpy() == 2 * table.column("label").to_numpy()).all()
    assert lance.dataset(uri, version=before).to_table(columns=["twice"]).column("twice").to_pylist() == [-1] * 359


def test_a_function_raising_on_a_row_fails_naming_it_or_with_skip_leaves_it_null(trained, tmp_path: Path) -> None:
    dataset, _ = trained
    uri = copy_of(dataset.val, tmp_path)
    labels = lance.dataset(uri).to_table(columns=["label"]).column("label").to_pylist()
    sevens = [row for row, label in enumerate(labels) if label == 7]
    spec = function_spec(tmp_path, uri, "tests.support.infer:label_twice_but_not_sevens", outputs={"twice": "int64"})
    failed = run_local(spec)
    assert failed.returncode == 1, failed.stdout + failed.stderr
    assert "Traceback" not in failed.stderr and "restart" not in failed.stderr, failed.stderr
    named = [line for line in failed.stderr.splitlines() if line.startswith("lance_hpc.run: infer.function raised on row")]
    assert named and all("ValueError: no twice for a 7" in line for line in named), failed.stderr
    assert all(int(line.split("row ")[1].split()[0]) in sevens for line in named), failed.stderr
    skip = function_spec(
        tmp_path, uri, "tests.support.infer:label_twice_but_not_sevens", outputs={"twice": "int64"}, on_error="skip"
    )
    done = run_local(skip)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"{len(sevens)} row(s) skipped (infer.on_error: skip)" in done.stdout, done.stdout
    assert all(f"row {row} of fragment {row // 64} skipped" in done.stdout for row in sevens), done.stdout
    doubled = lance.dataset(uri).to_table(columns=["twice"]).column("twice").to_pylist()
    assert doubled == [None if label == 7 else 2 * label for label in labels]


@pytest.mark.parametrize(
    ("infer", "expected"),
    [
        (
            {"outputs": {"label": "int64"}, "overwrite": True},
            ["infer.outputs: label is a column task image_classification reads", "fix: write the output under another name"],
        ),
        (
            {"outputs": {"_rowid": "int64"}},
            ["infer.outputs._rowid: Lance computes a column of this name", "fix: name the output"],
        ),
        ({"outputs": {"_rowoffset": "int64"}}, ["infer.outputs._rowoffset: Lance computes a column of this name"]),
        ({"outputs": {"_mine": "int64"}}, ["infer.outputs._mine: names beginning with _ are Lance's own", "e.g. mine"]),
        (
            {"outputs": {"twice": "int64"}, "overwrite": True, "filter": "twice > 4"},
            ["infer.filter: names twice, which this job writes", "fix: filter on columns the job does not write"],
        ),
    ],
)
def test_outputs_that_would_break_the_dataset_are_refused_before_anything_is_written(
    trained, tmp_path: Path, infer: dict[str, object], expected: list[str]
) -> None:
    dataset, _ = trained
    uri = copy_of(dataset.val, tmp_path)
    before = with_minus_ones(uri)
    spec = function_spec(tmp_path, uri, "tests.support.infer:label_twice_under_many_names", **infer)
    refused = run_local(spec)
    output = refused.stdout + refused.stderr
    assert refused.returncode == 2 and "Traceback" not in output, output
    assert all(text in refused.stderr for text in expected), f"expected {expected} in:\n{refused.stderr}"
    assert lance.dataset(uri).version == before and lance.dataset(uri).schema.names == ["image", "label", "twice"]
    assert lance.dataset(uri).to_table().num_rows == 359
    assert not (tmp_path / ".data.lance.infer").exists(), "a refused job wrote records"


def test_a_commit_whose_columns_were_dropped_since_does_not_count_and_the_run_starts_over(trained, tmp_path: Path) -> None:
    dataset, _ = trained
    uri = copy_of(dataset.val, tmp_path)
    spec = function_spec(tmp_path, uri, "tests.support.infer:label_twice", outputs={"twice": "int64"})
    assert run_local(spec).returncode == 0
    lance.dataset(uri).drop_columns(["twice"])  # by hand: version 3 has no column twice
    again = run_local(spec)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "already committed" not in again.stdout and again.stdout.count("starting over") == 1, again.stdout
    assert "has no column twice" in again.stdout, again.stdout
    latest = lance.dataset(uri)
    assert latest.version == 4, latest.version
    table = latest.to_table(columns=["label", "twice"])
    assert (table.column("twice").to_numpy() == 2 * table.column("label").to_numpy()).all()
    third = run_local(spec)  # now the record holds again
    assert third.returncode == 0 and "already committed" in third.stdout and lance.dataset(uri).version == 4, third.stdout
    shutil.rmtree(uri)
    shutil.copytree(dataset.val, uri)  # the dataset made again: version 1, without the column
    fourth = run_local(spec)
    assert fourth.returncode == 0 and "starting over" in fourth.stdout and "recreated" in fourth.stdout, fourth.stdout
    assert lance.dataset(uri).version == 2 and "twice" in lance.dataset(uri).schema.names


def test_a_dataset_that_moved_on_is_reported_nothing_is_mixed_and_the_rerun_continues_with_the_appended_rows(
    trained, tmp_path: Path
) -> None:
    dataset, checkpoint = trained
    uri = copy_of(dataset.val, tmp_path)
    spec = infer_spec(tmp_path, uri, checkpoint, outputs={"predicted": "int64"}, function="tests.support.infer:slow_predict")
    without_restarts(spec)  # the killed job stays dead until it is run again
    assert kill_rank_1_after_its_first_fragment(spec).wait(timeout=120) != 0
    more = lance.dataset(uri).to_table().slice(0, 10)
    lance.write_dataset(more, uri, mode="append")  # another writer adds rows meanwhile
    refused = run_local(spec)
    output = refused.stdout + refused.stderr
    assert refused.returncode != 0 and "rows were appended to" in output and "were not committed" in output, output
    assert "predicted" not in lance.dataset(uri).schema.names
    assert "the next run continues from version 2, keeping the 6 fragment(s) written" in output, output
    done = run_local(spec)  # no step by hand: the run goes on from the version with the appended rows
    assert done.returncode == 0 and "7 fragments" in done.stdout, done.stdout + done.stderr
    # one fragment computed; the other rank, with none of its own, says so unless it starts after the commit
    written = sorted(re.findall(r"(\d+) fragment\(s\) written, \d+ written before", done.stdout))
    assert written in (["0", "1"], ["1"]), done.stdout
    table = lance.dataset(uri).to_table(columns=["predicted"])
    assert table.num_rows == lance.dataset(uri, version=2).count_rows() and table.column("predicted").null_count == 0


def test_an_evaluation_job_reports_the_checkpoint_metrics_to_the_terminal_tensorboard_and_json(trained, tmp_path: Path) -> None:
    dataset, checkpoint = trained
    spec = infer_spec(tmp_path, dataset.val, checkpoint, job="evaluate", metrics_file=str(tmp_path / "metrics.json"))
    done = run_local(spec)
    assert done.returncode == 0, done.stdout + done.stderr
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["rows"] == 359 and 0.8 < metrics["metrics"]["eval/accuracy"] <= 1.0
    assert f"accuracy {metrics['metrics']['eval/accuracy']:.4f}" in done.stdout
    assert any((tmp_path / "runs").glob("events.out.tfevents.*"))
    assert "predicted" not in lance.dataset(dataset.val).schema.names


@pytest.mark.s3
def test_columns_written_to_a_dataset_on_s3_equal_the_same_job_on_local_disk(trained, tmp_path: Path, s3_env) -> None:
    dataset, checkpoint = trained
    options = {**s3_env.storage_options, "access_key_id": s3_env.access_key_id, "secret_access_key": s3_env.secret_access_key}
    uri = s3_env.uri("infer/val.lance")
    lance.write_dataset(lance.dataset(dataset.val).to_table(), uri, max_rows_per_file=64, storage_options=options)
    spec = infer_spec(tmp_path, uri, checkpoint, outputs={"predicted": "int64", "score": "float32"})
    raw = yaml.safe_load(spec.read_text())
    raw["data"]["storage_options"] = s3_env.storage_options
    spec.write_text(yaml.safe_dump(raw))
    done = run_local(spec)
    assert done.returncode == 0, done.stdout + done.stderr
    local = copy_of(dataset.val, tmp_path / "local")
    assert (
        run_local(
            infer_spec(tmp_path / "local", local, checkpoint, outputs={"predicted": "int64", "score": "float32"})
        ).returncode
        == 0
    )
    remote = lance.dataset(uri, storage_options=options)
    assert remote.version == 2
    assert remote.to_table(columns=["predicted"]) == lance.dataset(local).to_table(columns=["predicted"])


def test_a_filter_writes_values_for_its_rows_only_and_evaluates_only_them(trained, tmp_path: Path) -> None:
    dataset, checkpoint = trained
    uri = str(tmp_path / "sorted.lance")
    table = lance.dataset(dataset.val).to_table().sort_by("label")  # the first fragments hold low labels only
    lance.write_dataset(table, uri, max_rows_per_file=64)
    spec = infer_spec(tmp_path, uri, checkpoint, outputs={"twice": "int64"}, function="tests.support.infer:label_twice")
    raw = yaml.safe_load(spec.read_text())
    raw["infer"]["filter"] = "label >= 5"
    spec.write_text(yaml.safe_dump(raw))
    done = run_local(spec)
    assert done.returncode == 0, done.stdout + done.stderr
    chosen = int((table.column("label").to_numpy() >= 5).sum())
    assert f"for {chosen:,} rows" in done.stdout and f"{chosen:,} of 359 rows (infer.filter)" in done.stdout
    # each fragment's line counts the rows the filter selected in it (none in the first ones)
    labels = table.column("label").to_numpy()
    shown = dict(re.findall(r"rank \d: fragment (\d+): (.+) in [0-9.]+ s", done.stdout))
    expected = {
        str(index): f"{int((labels[start : start + 64] >= 5).sum()):,} of {len(labels[start : start + 64]):,} rows (infer.filter)"
        for index, start in enumerate(range(0, len(labels), 64))
    }
    assert shown == expected and shown["0"].startswith("0 of 64"), done.stdout
    written = lance.dataset(uri).to_table(columns=["label", "twice"]).to_pylist()
    assert all(row["twice"] == 2 * row["label"] if row["label"] >= 5 else row["twice"] is None for row in written)
    evaluation = infer_spec(tmp_path / "eval", uri, checkpoint, job="evaluate", metrics_file=str(tmp_path / "m.json"))
    raw = yaml.safe_load(evaluation.read_text())
    raw["infer"]["filter"] = "label = 3"
    evaluation.write_text(yaml.safe_dump(raw))
    assert run_local(evaluation).returncode == 0
    assert json.loads((tmp_path / "m.json").read_text())["rows"] == int((table.column("label").to_numpy() == 3).sum())
    raw["infer"]["filter"] = "nope > 1"
    evaluation.write_text(yaml.safe_dump(raw))
    refused = run_local(evaluation)
    assert (
        refused.returncode == 2
        and "infer.filter 'nope > 1' does not run on" in refused.stderr
        and "Traceback" not in refused.stderr
    )


def test_the_commit_schema_removes_a_replaced_column_with_its_children_and_keeps_the_field_ids(tmp_path: Path) -> None:
    """A dataset that dropped a column (its field ids have a gap) and whose replaced column is a
    struct (a field with children): the commit's schema names each new column, and nothing else moved."""
    uri = str(tmp_path / "nested.lance")
    struct = pa.array([{"a": i, "b": -i} for i in range(6)])
    lance.write_dataset(pa.table({"gone": range(6), "keep": range(6), "score": struct}), uri, max_rows_per_file=3)
    lance.dataset(uri).drop_columns(["gone"])
    pinned = lance.dataset(uri)
    outputs = {"score": "float32", "fresh": "int64"}
    stored = column_swap.stored_names(pinned.schema.names, outputs)
    assert stored == {"score": "lance_hpc_new_score", "fresh": "fresh"}
    fragments, schema = [], None
    for fragment in pinned.get_fragments():
        keep = fragment.to_table(columns=["keep"]).column("keep").to_numpy()
        batch = pa.record_batch([pa.array(keep * 0.5, pa.float32()), pa.array(keep * 10)], names=list(stored.values()))
        metadata, schema = fragment.merge_columns(pa.RecordBatchReader.from_batches(batch.schema, [batch]))
        fragments.append(metadata)
    committed = column_swap.committed_schema(column_swap.encode(schema), stored)
    operation = lance.LanceOperation.Merge(fragments, committed)
    done = lance.LanceDataset.commit(uri, operation, read_version=pinned.version, max_retries=0)
    assert done.schema == pa.schema([("keep", pa.int64()), ("score", pa.float32()), ("fresh", pa.int64())]), done.schema
    assert done.to_table().to_pydict() == {
        "keep": list(range(6)),
        "score": [i * 0.5 for i in range(6)],
        "fresh": [10 * i for i in range(6)],
    }
    assert [field.id() for field in done.lance_schema.fields()] == [1, 5, 6]  # "keep" as it was; the new ones after every old id
    done.add_columns({"later": "keep + 1"})  # a column added afterwards gets an id of its own
    assert lance.dataset(uri).to_table(columns=["score", "later"]).column("later").to_pylist() == list(range(1, 7))


def lineage(target: str | Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "lance_hpc", "lineage", str(target)], capture_output=True, text=True, cwd=REPO_ROOT
    )


def test_a_column_records_its_checkpoint_and_lineage_warns_when_it_scored_the_checkpoints_own_training_rows(
    trained, tmp_path: Path
) -> None:
    from lance_hpc.checkpoint.manifests import latest
    from lance_hpc.lineage.provenance import PROVENANCE_KEY

    dataset, checkpoint = trained
    spec = infer_spec(tmp_path, dataset.train, checkpoint, outputs={"predicted": "int64"})
    try:
        done = run_local(spec)
        assert done.returncode == 0, done.stdout + done.stderr
        table = lance.dataset(dataset.train)
        document = json.loads(table.schema.field("predicted").metadata[PROVENANCE_KEY.encode()])
        step = latest(open_store(checkpoint)).step
        assert document["checkpoint"]["dir"] == str(checkpoint) and document["checkpoint"]["step"] == step, document
        assert document["checkpoint"]["weights"].startswith("blake2b:") and document["function"] is None, document
        assert document["dataset"] == {"uri": dataset.train, "version": table.version - 1} and document["rows"] == 1438
        trained_on = document["checkpoint"]["lineage"]["trained_on"]
        assert [(source["uri"], source["version"]) for source in trained_on] == [(dataset.train, 1)], document
        shown = lineage(dataset.train)
        assert shown.returncode == 0, shown.stdout + shown.stderr
        chain = f"{dataset.train} version 1 -> checkpoint {checkpoint} step {step}, weights {document['checkpoint']['weights']}"
        assert chain in shown.stdout and "-> predicted: read version 1" in shown.stdout, shown.stdout
        assert "warning: predicted was computed by a checkpoint trained on" in shown.stdout, shown.stdout
        assert "validation leakage" in shown.stdout and "other columns (no provenance): image, label" in shown.stdout
    finally:
        if "predicted" in lance.dataset(dataset.train).schema.names:  # the module's training set as it was
            lance.dataset(dataset.train).drop_columns(["predicted"])
    shown = lineage(checkpoint)
    assert shown.returncode == 0 and f"step {step}, saved at" in shown.stdout, shown.stdout + shown.stderr
    assert f"trained on {dataset.train} version 1" in shown.stdout and f"validated on {dataset.val}" in shown.stdout
    refused = lineage(tmp_path / "nothing.lance")
    assert refused.returncode == 2 and "is neither a checkpoint directory nor a Lance dataset" in refused.stderr
