"""Ingest by many workers: Parquet, JSON Lines, WebDataset and image-folder sources, the column
mapping, image checks, a split that does not depend on the worker count, resume after an interrupted run, one
commit, and S3 through the loopback server."""

from __future__ import annotations

import gzip
import io
import json
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import lance
import pyarrow as pa
import pytest

from lance_hpc.cli.ingest import main as ingest_main
from lance_hpc.ingest import ensure_dataset
from lance_hpc.ingest.commit import commit
from lance_hpc.ingest.plan import make_plan
from lance_hpc.ingest.shards import split_of
from lance_hpc.ingest.status import progress_lines
from lance_hpc.ingest.target import COMMAND_LINE_NAMES, targets
from lance_hpc.ingest.write import run_worker
from lance_hpc.loading.plan import plan_data
from lance_hpc.spec import load_spec, load_spec_text
from tests.support.jobs import Digits, train_here, write_spec
from tests.support.shards import digit_rows, ingest_job_spec, write_parquet, write_webdataset


def ingest(*args: str) -> int:
    return ingest_main([str(arg) for arg in args])


def rows_of(uri: str | Path) -> list[dict]:
    return lance.dataset(str(uri)).to_table().to_pylist()


def test_webdataset_to_lance_with_checked_images_kept_keys_and_extra_fields(tmp_path: Path, capsys) -> None:
    rows = digit_rows()
    truncated = rows[3]["jpg"][: len(rows[3]["jpg"]) - 40]
    write_webdataset(tmp_path / "wds", rows, per_tar=16, broken={3: b"", 7: truncated, 11: b"not an image"})
    code = ingest(f"webdataset:{tmp_path}/wds/*.tar", tmp_path / "train.lance", "--rows-per-fragment", "10")
    printed = capsys.readouterr()
    assert code == 0, printed.err
    found = rows_of(tmp_path / "train.lance")
    assert [row["key"] for row in found] == [row["id"] for index, row in enumerate(rows) if index not in (3, 7, 11)]
    assert all(row["width"] == 16 and row["height"] == 16 for row in found)
    assert [row["label"] for row in found][:3] == [rows[0]["cls"], rows[1]["cls"], rows[2]["cls"]]
    assert found[0]["quality"] == rows[0]["quality"] and found[0]["image"] == rows[0]["jpg"]
    assert "skipped 1 empty, 1 truncated, 1 unreadable" in printed.out
    # Fragments of rows_per_fragment rows, the rest of each shard in one more: 13, 16, 16, 12 rows.
    fragments = lance.dataset(str(tmp_path / "train.lance")).get_fragments()
    assert [fragment.count_rows() for fragment in fragments] == [10, 3, 10, 6, 10, 6, 10, 2]

    write_webdataset(tmp_path / "bad", rows[:8], per_tar=8, broken={2: b""})
    code = ingest(f"webdataset:{tmp_path}/bad/*.tar", tmp_path / "strict.lance", "--on-corrupt", "fail")
    assert code == 2 and "d0002 is empty" in capsys.readouterr().err
    with pytest.raises(ValueError):  # nothing committed
        lance.dataset(str(tmp_path / "strict.lance"))


def test_parquet_row_groups_are_shards_and_the_column_mapping_renames_fields(tmp_path: Path, capsys) -> None:
    rows = digit_rows()
    write_parquet(tmp_path / "pq", rows, per_file=25, row_group=10)
    mapping = ["--column", "image=image_bytes", "--column", "label=class_id", "--column", "key=uid"]
    code = ingest(f"parquet:{tmp_path}/pq/*.parquet", tmp_path / "train.lance", *mapping, "--dry-run", "--nproc", "2")
    printed = capsys.readouterr().out
    assert code == 0 and "7 shards" in printed and "worker 1:" in printed  # row groups: 3 + 3 + 1
    assert not (tmp_path / "train.lance").exists()
    code = ingest(f"parquet:{tmp_path}/pq/*.parquet", tmp_path / "train.lance", *mapping)
    assert code == 0, capsys.readouterr().err
    table = lance.dataset(str(tmp_path / "train.lance")).to_table()
    assert table.schema.field("label").type == pa.int64() and table.schema.field("quality").type == pa.float64()
    assert table.column("key").to_pylist() == [row["id"] for row in rows]

    code = ingest(f"parquet:{tmp_path}/pq/*.parquet", tmp_path / "wrong.lance", "--column", "image=picture")
    assert code == 2 and "columns.image names 'picture'" in capsys.readouterr().err


def test_jsonl_gz_and_zst_text_with_extra_fields(tmp_path: Path, capsys) -> None:
    documents = [{"text": f"document {index} " * (index % 5 + 1), "lang": "en", "score": index} for index in range(40)]
    (tmp_path / "text").mkdir()
    lines = "".join(json.dumps(document) + "\n" for document in documents[:20]).encode()
    (tmp_path / "text" / "a.jsonl.gz").write_bytes(gzip.compress(lines))
    with pa.CompressedOutputStream(str(tmp_path / "text" / "b.jsonl.zst"), "zstd") as stream:
        stream.write("".join(json.dumps(document) + "\n" for document in documents[20:]).encode())
    assert ingest(f"jsonl:{tmp_path}/text/*", tmp_path / "docs.lance") == 0, capsys.readouterr().err
    found = rows_of(tmp_path / "docs.lance")
    assert [row["text"] for row in found] == [document["text"] for document in documents]
    assert [row["score"] for row in found] == list(range(40)) and found[0]["lang"] == "en"
    assert found[0]["key"].endswith("a.jsonl.gz:0")


def test_split_by_key_hash_and_rows_are_the_same_for_any_worker_count(tmp_path: Path, capsys) -> None:
    rows = digit_rows()
    write_webdataset(tmp_path / "wds", rows, per_tar=7)
    outputs = {}
    for workers in (1, 3):
        train, val = tmp_path / f"train{workers}.lance", tmp_path / f"val{workers}.lance"
        code = ingest(f"webdataset:{tmp_path}/wds/*.tar", train, "--val-uri", val, "--val-fraction", "0.3", "--nproc", workers)
        assert code == 0, capsys.readouterr().err
        outputs[workers] = (rows_of(train), rows_of(val))
    assert outputs[1] == outputs[3]
    train_keys, val_keys = ([row["key"] for row in split] for split in outputs[1])
    assert sorted(train_keys + val_keys) == sorted(row["id"] for row in rows)
    assert all(split_of(key, 0.3) == "val" for key in val_keys) and 0 < len(val_keys) < len(train_keys)


def test_an_interrupted_ingest_resumes_with_only_the_missing_shards_and_equals_an_uninterrupted_one(
    tmp_path: Path, capsys
) -> None:
    rows = digit_rows()
    write_webdataset(tmp_path / "wds", rows, per_tar=8)
    source = f"webdataset:{tmp_path}/wds/*.tar"
    assert ingest(source, tmp_path / "whole.lance") == 0

    train, _ = targets(str(tmp_path / "part.lance"), None, {}, None, COMMAND_LINE_NAMES)
    plan = make_plan(source, train, None)
    calls = iter([False, False, True])  # worker 0 of 2 stops after two of its shards
    report = run_worker(plan, 0, 2, stop=lambda: next(calls))
    assert report.stopped and len(report.done) == 2
    with pytest.raises(ValueError):  # written fragments are not a dataset before the commit
        lance.dataset(str(tmp_path / "part.lance"))
    assert len(plan.shard_records().finished()) == 2
    progress = progress_lines(source, train, world_size=2)
    assert progress[0] == "2 of 8 shards written (train 16 rows; skipped none)" and "left:" in progress[1], progress
    capsys.readouterr()
    assert ingest(source, tmp_path / "part.lance", "--nproc", "2") == 0
    printed = capsys.readouterr().out
    assert "resuming: 2 of 8 shards were written by an earlier run" in printed
    assert rows_of(tmp_path / "part.lance") == rows_of(tmp_path / "whole.lance")
    assert lance.dataset(str(tmp_path / "part.lance")).version == 1  # one commit
    # Run again: nothing is written twice.
    capsys.readouterr()
    assert ingest(source, tmp_path / "part.lance", "--nproc", "2") == 0
    assert "already committed" in capsys.readouterr().out
    assert commit(plan).already
    assert progress_lines(source, train, world_size=2) == [
        "8 of 8 shards written (train 60 rows; skipped none)",
        "committed: train version 1",
    ]


def test_a_worker_starting_after_rank_0_committed_finds_its_shards_recorded_not_a_foreign_dataset(tmp_path: Path) -> None:
    """Rank 0 may commit before a slower rank has even planned: between Lance's commit and the
    commit record, that rank sees a dataset at the target and must not take it for another's."""
    write_webdataset(tmp_path / "wds", digit_rows(16), per_tar=8)
    source = f"webdataset:{tmp_path}/wds/*.tar"
    train, _ = targets(str(tmp_path / "t.lance"), None, {}, None, COMMAND_LINE_NAMES)
    plan = make_plan(source, train, None)
    run_worker(plan, 0, 1)
    commit(plan)
    records = plan.shard_records()
    records.store.delete_file(f"{records.path}/committed.json")  # the moment before rank 0 records its commit
    late = make_plan(source, train, None, check_targets=False)  # a rank: the launcher checked the target
    assert run_worker(late, 1, 2).already == late.assignment(2)[1]
    # the launcher run again: the dataset is this ingest's own commit (its transaction says so), recorded now
    again = make_plan(source, train, None)
    assert again.landed == {"train": 1} and commit(again).found == {"train": 1}
    assert records.committed() == {"train": 1} and lance.dataset(str(tmp_path / "t.lance")).version == 1


def test_append_adds_a_version_and_keeps_the_rows_before(tmp_path: Path, capsys) -> None:
    rows = digit_rows()
    write_webdataset(tmp_path / "first", rows[:30], per_tar=10)
    write_webdataset(tmp_path / "second", rows[30:], per_tar=10)
    target = tmp_path / "train.lance"
    assert ingest(f"webdataset:{tmp_path}/first/*.tar", target) == 0
    assert ingest(f"webdataset:{tmp_path}/second/*.tar", target) == 2
    assert "already holds a Lance dataset" in capsys.readouterr().err
    assert ingest(f"webdataset:{tmp_path}/second/*.tar", target, "--append") == 0
    dataset = lance.dataset(str(target))
    assert dataset.version == 2 and dataset.count_rows() == len(rows)
    assert lance.dataset(str(target), version=1).count_rows() == 30


def test_a_worker_process_that_fails_fails_the_ingest_and_keeps_what_others_wrote(tmp_path: Path) -> None:
    rows = digit_rows(24)
    write_webdataset(tmp_path / "wds", rows, per_tar=6)
    (tmp_path / "wds" / "shard-0003.tar").write_bytes(b"this is not a tar file" * 20)
    done = subprocess.run(
        [sys.executable, "-m", "lance_hpc.ingest", f"webdataset:{tmp_path}/wds/*.tar", str(tmp_path / "t.lance"), "--nproc", "2"],
        capture_output=True,
        text=True,
    )
    assert done.returncode != 0
    assert "failed" in done.stderr and "writes only the missing shards" in done.stderr
    with pytest.raises(ValueError):
        lance.dataset(str(tmp_path / "t.lance"))


@pytest.mark.s3
def test_ingest_from_and_to_s3(tmp_path: Path, s3_env, capsys) -> None:
    import pyarrow.fs as pafs

    rows = digit_rows(30)
    write_parquet(tmp_path / "pq", rows, per_file=10, row_group=10)
    store = pafs.S3FileSystem(
        endpoint_override=s3_env.endpoint.split("://")[1],
        scheme="http",
        region=s3_env.region,
        access_key=s3_env.access_key_id,
        secret_key=s3_env.secret_access_key,
    )
    for path in sorted((tmp_path / "pq").iterdir()):
        with store.open_output_stream(f"{s3_env.bucket}/shard-src/{path.name}") as handle:
            handle.write(path.read_bytes())
    options = [arg for key, value in s3_env.storage_options.items() for arg in ("--storage-option", f"{key}={value}")]
    uri = s3_env.uri("shard-ingest/train.lance")
    code = ingest(
        f"parquet:{s3_env.uri('shard-src/*.parquet')}",
        uri,
        "--column",
        "image=image_bytes",
        "--column",
        "label=class_id",
        "--column",
        "key=uid",
        "--nproc",
        "2",
        *options,
    )
    assert code == 0, capsys.readouterr().err
    dataset = lance.dataset(
        uri,
        storage_options={
            **s3_env.storage_options,
            "access_key_id": s3_env.access_key_id,
            "secret_access_key": s3_env.secret_access_key,
        },
    )
    assert dataset.to_table().column("key").to_pylist() == [row["id"] for row in rows]


def test_an_ingest_job_spec_runs_locally_on_two_ranks_and_its_dry_run_shows_the_shard_plan(tmp_path: Path) -> None:
    write_webdataset(tmp_path / "wds", digit_rows(40), per_tar=5)
    job = ingest_job_spec(tmp_path, 0.25)
    command = [sys.executable, "-m", "lance_hpc.submit", str(job)]
    dry = subprocess.run([*command, "--dry-run"], capture_output=True, text=True)
    assert dry.returncode == 0, dry.stderr
    assert "8 shards of webdataset:" in dry.stdout and "worker 1: 4 shards" in dry.stdout
    estimate = re.search(r"rows, estimated from the first shard: train about (\d+), val about (\d+)", dry.stdout)
    assert estimate and 20 <= int(estimate[1]) + int(estimate[2]) <= 60, dry.stdout  # 40 rows, from one tar of 5
    assert not (tmp_path / "train.lance").exists()
    run = subprocess.run([*command, "--local", "--nproc", "2"], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "rank 1: 4 shard(s) written" in run.stdout and run.stdout.count("committed:") == 1
    train, val = rows_of(tmp_path / "train.lance"), rows_of(tmp_path / "val.lance")
    assert len(train) + len(val) == 40 and all(split_of(row["key"], 0.25) == "val" for row in val)


def test_an_ingest_job_takes_only_sources_written_by_shards(tmp_path: Path) -> None:
    from lance_hpc.spec import SpecError

    job = tmp_path / "ingest.yaml"
    job.write_text(f"name: x\njob: ingest\ndata: {{uri: {tmp_path / 't.lance'}, ingest: {{source: sklearn-digits}}}}\n")
    with pytest.raises(SpecError, match="data.ingest.source: job: ingest splits its source into shards"):
        load_spec(job)
    job.write_text(f"name: x\njob: export\ndata: {{uri: {tmp_path / 't.lance'}}}\n")
    with pytest.raises(SpecError, match="train, ingest, infer, evaluate"):
        load_spec(job)
    job.write_text(f"name: x\njob: infer\ndata: {{uri: {tmp_path / 't.lance'}}}\n")
    with pytest.raises(SpecError, match="infer: job: infer needs an infer section"):
        load_spec(job)
    job.write_text(f"name: x\njob: evaluate\ndata: {{uri: {tmp_path / 't.lance'}}}\ninfer: {{outputs: {{p: int64}}}}\n")
    with pytest.raises(SpecError, match=r"(?s)infer.checkpoint: no model to run.*infer.outputs: job: evaluate writes no column"):
        load_spec(job)
    job.write_text(f"name: x\ndata: {{uri: {tmp_path / 't.lance'}}}\ninfer: {{checkpoint: c, outputs: {{p: int8}}}}\n")
    with pytest.raises(SpecError, match=r"(?s)int8: an output's type is one of.*infer: job: train does not read it"):
        load_spec(job)


def test_a_hugging_face_dataset_saved_to_disk_keeps_its_class_names_and_image_bytes(tmp_path: Path, capsys) -> None:
    datasets = pytest.importorskip("datasets")
    rows = digit_rows(30)
    features = datasets.Features(
        {
            "image": datasets.Image(),
            "label": datasets.ClassLabel(names=[f"digit-{index}" for index in range(10)]),
            "quality": datasets.Value("float32"),
        }
    )
    saved = datasets.Dataset.from_dict(
        {
            "image": [{"bytes": row["jpg"], "path": None} for row in rows],
            "label": [row["cls"] for row in rows],
            "quality": [row["quality"] for row in rows],
        },
        features=features,
    )
    saved.save_to_disk(str(tmp_path / "hf"), max_shard_size="20KB")  # several Arrow files: several shards
    datasets.DatasetDict({"train": saved}).save_to_disk(str(tmp_path / "hf_splits"))

    assert ingest(f"hf:{tmp_path / 'hf'}", tmp_path / "train.lance", "--nproc", "2") == 0, capsys.readouterr().err
    dataset = lance.dataset(str(tmp_path / "train.lance"))
    assert len(dataset.get_fragments()) > 1
    found = dataset.to_table().to_pylist()
    assert [row["image"] for row in found] == [row["jpg"] for row in rows]
    assert [row["label"] for row in found] == [row["cls"] for row in rows]
    names = json.loads(dataset.schema.metadata[b"class_names"])
    assert names[:2] == ["digit-0", "digit-1"] and len(names) == 10

    assert ingest(f"hf:{tmp_path / 'hf_splits'}", tmp_path / "x.lance") == 2
    assert "holds several splits (train): name one" in capsys.readouterr().err


def test_a_training_job_ingests_its_webdataset_source_at_start_and_trains_on_it(tmp_path: Path) -> None:
    write_webdataset(tmp_path / "wds", digit_rows(120), per_tar=20)
    dataset = Digits(str(tmp_path / "train.lance"), str(tmp_path / "val.lance"))
    spec = write_spec(
        tmp_path / "job",
        dataset,
        data={"ingest": {"source": f"webdataset:{tmp_path}/wds/*.tar", "val_fraction": 0.25}, "batch_size": 16},
        train={"epochs": 1},
    )
    planned = plan_data(load_spec(spec).spec.data, world_size=2)  # the dry run's plan, before the ingest
    assert 60 <= planned.rows <= 120 and not Path(dataset.train).exists()
    done = ensure_dataset(load_spec(spec).spec.data)  # what a job's start does, on rank 0
    assert done.train + done.val == 120
    summary = train_here(spec)
    assert summary.status == "completed" and "val/accuracy" in summary.metrics
    train, val = rows_of(dataset.train), rows_of(dataset.val)
    assert len(train) + len(val) == 120 and all(split_of(row["key"], 0.25) == "val" for row in val)


def test_samples_with_different_fields_keep_them_all_and_source_sizes_give_way_to_measured_ones(tmp_path: Path) -> None:
    """A tar whose first sample lacks a caption still keeps the others' captions; LAION-style JSON
    width/height fields are replaced by the sizes measured from the image."""
    rows = digit_rows(4)
    (tmp_path / "wds").mkdir()
    with tarfile.open(tmp_path / "wds" / "a.tar", "w") as tar:
        for index, row in enumerate(rows):
            members = {"jpg": row["jpg"], "json": json.dumps({"width": 999, "height": 999}).encode()}
            if index:
                members["txt"] = f"caption {index}".encode()
            for extension, data in members.items():
                info = tarfile.TarInfo(f"{row['id']}.{extension}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    assert ingest(f"webdataset:{tmp_path}/wds/*.tar", tmp_path / "t.lance") == 0
    found = rows_of(tmp_path / "t.lance")
    assert [row["text"] for row in found] == [None, "caption 1", "caption 2", "caption 3"]
    assert {(row["width"], row["height"]) for row in found} == {(16, 16)}


def test_unreadable_sources_are_one_clear_error_naming_the_file(tmp_path: Path, capsys) -> None:
    (tmp_path / "j").mkdir()
    (tmp_path / "j" / "bad.jsonl").write_bytes(b'{"text": "a\xff\xfe"}\n')
    assert ingest(f"jsonl:{tmp_path}/j/*.jsonl", tmp_path / "j.lance") == 2
    assert "bad.jsonl: cannot read it as jsonl" in capsys.readouterr().err
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "x.parquet").write_bytes(b"not parquet at all")
    assert ingest(f"parquet:{tmp_path}/p/*.parquet", tmp_path / "p.lance") == 2
    assert "x.parquet is not a Parquet file, or is damaged" in capsys.readouterr().err


def test_a_glob_star_stays_in_its_directory_and_a_relative_target_works(tmp_path: Path, monkeypatch, capsys) -> None:
    rows = digit_rows(20)
    write_parquet(tmp_path / "pq", rows[:10], per_file=10, row_group=10)
    write_parquet(tmp_path / "pq" / "old", rows[10:], per_file=10, row_group=10)
    monkeypatch.chdir(tmp_path)
    mapping = ["--column", "image=image_bytes", "--column", "label=class_id", "--column", "key=uid"]
    assert ingest("parquet:pq/*.parquet", "out.lance", *mapping) == 0, capsys.readouterr().err
    assert [row["key"] for row in rows_of(tmp_path / "out.lance")] == [row["id"] for row in rows[:10]]
    assert ingest("parquet:pq/**/*.parquet", "all.lance", *mapping) == 0
    assert len(rows_of(tmp_path / "all.lance")) == 20


@pytest.mark.parametrize("glob", ["./*.jsonl", "*.jsonl", "../docs/*.jsonl"])
def test_a_relative_glob_is_taken_from_the_working_directory_or_the_specs_base(tmp_path: Path, monkeypatch, glob) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.jsonl").write_text('{"text": "one", "id": 1}\n{"text": "two", "id": 2}\n')
    monkeypatch.chdir(tmp_path / "docs")
    assert ingest(f"jsonl:{glob}", tmp_path / "cli.lance") == 0
    assert [row["text"] for row in rows_of(tmp_path / "cli.lance")] == ["one", "two"]
    monkeypatch.chdir(tmp_path)  # a spec's relative paths resolve against its base directory
    spec = f"name: rel\njob: ingest\ndata:\n  uri: {tmp_path}/spec.lance\n  ingest: {{source: 'jsonl:{glob}'}}\n"
    loaded = load_spec_text(spec, base_dir=tmp_path / "docs")
    assert loaded.spec.data.ingest.source == f"jsonl:{tmp_path}/docs/*.jsonl"
    assert ensure_dataset(loaded.spec.data).train == 2


def test_an_append_run_again_after_its_commit_writes_nothing_and_another_schema_is_refused(tmp_path: Path, capsys) -> None:
    rows = digit_rows(24)
    write_webdataset(tmp_path / "first", rows[:12], per_tar=6)
    write_webdataset(tmp_path / "second", rows[12:], per_tar=6)
    target = tmp_path / "t.lance"
    assert ingest(f"webdataset:{tmp_path}/first/*.tar", target) == 0
    assert ingest(f"webdataset:{tmp_path}/second/*.tar", target, "--append") == 0
    capsys.readouterr()
    assert ingest(f"webdataset:{tmp_path}/second/*.tar", target, "--append") == 0
    assert "already committed" in capsys.readouterr().out
    assert lance.dataset(str(target)).count_rows() == 24 and lance.dataset(str(target)).version == 2

    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "a.jsonl").write_text('{"text": "hello", "n": 1}\n')
    assert ingest(f"jsonl:{tmp_path}/text/*.jsonl", target, "--append") == 2
    assert "do not have the dataset's columns" in capsys.readouterr().err
    assert ingest(f"jsonl:{tmp_path}/text/*.jsonl", target, "--overwrite") == 0  # a new version with other columns
    assert sorted(lance.dataset(str(target)).to_table().column_names) == ["key", "n", "text"]


def test_an_image_folder_is_ingested_by_many_workers_with_checked_images_keys_and_mixed_classes(tmp_path: Path, capsys) -> None:
    rows = digit_rows(40)
    folder = tmp_path / "images"
    for index, row in enumerate(rows):
        name = f"digit-{row['cls']}"
        path = folder / name / ("nested" if index % 3 == 0 else "") / f"{row['id']}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"" if index == 5 else row["jpg"])
    (folder / "digit-0" / "notes.txt").write_text("not an image")
    (folder / "loose.jpg").write_bytes(rows[0]["jpg"])  # not in a class directory
    args = ["--val-uri", tmp_path / "v.lance", "--val-fraction", "0.25", "--files-per-shard", "7", "--rows-per-fragment", "4"]
    assert ingest(f"imagefolder:{folder}", tmp_path / "one.lance", *args) == 0
    assert "skipped 1 empty" in capsys.readouterr().out
    train, val = rows_of(tmp_path / "one.lance"), rows_of(tmp_path / "v.lance")
    assert len(train) + len(val) == 39 and val
    classes = sorted({f"digit-{row['cls']}" for row in rows})
    names = json.loads(lance.dataset(str(tmp_path / "one.lance")).schema.metadata[b"class_names"])
    assert names == classes
    by_id = {row["id"]: row for row in rows}
    for row in train + val:
        source = by_id[row["key"].rsplit("/", 1)[1].removesuffix(".jpg")]
        assert row["key"].startswith(f"digit-{source['cls']}/") and names[row["label"]] == f"digit-{source['cls']}"
        assert row["image"] == source["jpg"] and (row["width"], row["height"]) == (16, 16)
        assert split_of(row["key"], 0.25) == ("val" if row in val else "train")
    # rows in an order mixed by key, not class by class: a contiguous read sees several classes
    assert len({row["label"] for row in train[:8]}) >= 3
    # two workers write the same rows in the same order
    args[1] = tmp_path / "v2.lance"
    assert ingest(f"imagefolder:{folder}", tmp_path / "two.lance", *args, "--nproc", "2") == 0
    assert rows_of(tmp_path / "two.lance") == train and rows_of(tmp_path / "v2.lance") == val
    assert ingest(f"imagefolder:{tmp_path / 'nowhere'}", tmp_path / "x.lance") == 2
    assert "has no images in class sub-directories" in capsys.readouterr().err
