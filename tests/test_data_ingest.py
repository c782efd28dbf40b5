"""Ingest: every source kind, the schema contract, train/val split, fragment size, atomicity, and
what is already at a target (other files refused and left alone, datasets kept or written over as
new versions, concurrent ingests committing once), locally and on S3."""

import errno
import json
import os
import re
import threading
import time
from pathlib import Path

import lance
import numpy as np
import pyarrow as pa
import pytest
from pyarrow import fs

from lance_hpc.cli.ingest import main
from lance_hpc.errors import UserError
from lance_hpc.ingest import dataset as ingest_module
from lance_hpc.ingest.dataset import ensure_dataset, ingest, resolve_source
from lance_hpc.ingest.sources import PHOTO_NAMES, encode_image, skimage_photo_crops
from lance_hpc.ingest.target import Ingested
from lance_hpc.spec import DataSpec, IngestSpec, SpecError, validate_spec
from lance_hpc.storage.options import filesystem_arguments, storage_options


def class_names(uri):
    return json.loads(lance.dataset(uri).schema.metadata[b"class_names"])


def test_sklearn_digits_train_val_split_schema_and_fragments(tmp_path):
    train, val = tmp_path / "train.lance", tmp_path / "val.lance"
    written = ingest("sklearn-digits", str(train), str(val), val_fraction=0.25, rows_per_fragment=300, seed=3)
    assert written == Ingested(train=1348, val=449)
    dataset = lance.dataset(str(train))
    assert dataset.schema.field("image").type.equals("binary") and str(dataset.schema.field("label").type) == "int64"
    assert class_names(str(train)) == [str(d) for d in range(10)] == class_names(str(val))
    assert [f.count_rows() for f in dataset.get_fragments()] == [300, 300, 300, 300, 148]
    # Rows are written in a shuffled order: neighbours are not all one class.
    labels = dataset.to_table(columns=["label"]).column("label").to_numpy()
    assert len(set(labels[:30].tolist())) > 3
    # Train and val are disjoint and together the whole source.
    images = dataset.to_table(columns=["image"]).column("image").to_pylist()
    val_images = lance.dataset(str(val)).to_table(columns=["image"]).column("image").to_pylist()
    assert len(images) + len(val_images) == 1797
    assert not any(name.startswith(".") for name in os.listdir(tmp_path))


def test_skimage_photos_with_options(tmp_path):
    ingest("skimage-photos:count=26,size=48", str(tmp_path / "p.lance"), rows_per_fragment=10)
    dataset = lance.dataset(str(tmp_path / "p.lance"))
    assert dataset.count_rows() == 26 and len(dataset.get_fragments()) == 3
    assert class_names(str(tmp_path / "p.lance")) == list(PHOTO_NAMES)


def make_fake_food101(root: Path) -> None:
    base = root / "food-101"
    meta = {"train": {}, "test": {}}
    for cls in ("apple_pie", "sushi"):
        (base / "images" / cls).mkdir(parents=True)
        for index, (data, _) in enumerate(skimage_photo_crops(5, seed=len(cls), size=24)):
            (base / "images" / cls / f"{index}.jpg").write_bytes(data)
            meta["train" if index < 3 else "test"].setdefault(cls, []).append(f"{cls}/{index}")
    (base / "meta").mkdir()
    for split, content in meta.items():
        (base / "meta" / f"{split}.json").write_text(json.dumps(content))


def test_torchvision_food101_on_disk_uses_its_official_test_split(tmp_path):
    make_fake_food101(tmp_path / "data")
    written = ingest(f"torchvision:Food101:{tmp_path / 'data'}", str(tmp_path / "t.lance"), str(tmp_path / "v.lance"))
    assert written == Ingested(train=6, val=4)
    assert class_names(str(tmp_path / "t.lance")) == ["apple_pie", "sushi"]
    # Files are stored as their bytes, not re-encoded.
    stored = lance.dataset(str(tmp_path / "t.lance")).to_table().column("image").to_pylist()
    on_disk = {p.read_bytes() for p in (tmp_path / "data").rglob("*.jpg")}
    assert set(stored) <= on_disk


def test_torchvision_missing_dataset_is_a_clear_error_without_download(tmp_path):
    with pytest.raises(UserError, match="lance-hpc never downloads"):
        resolve_source(f"torchvision:CIFAR10:{tmp_path}")
    with pytest.raises(UserError, match="no dataset 'Nope'"):
        resolve_source(f"torchvision:Nope:{tmp_path}")


def test_cifar_style_arrays_are_encoded(tmp_path):
    class FakeCifar:
        classes = ["a", "b", "c"]
        data = np.random.default_rng(0).integers(0, 255, size=(7, 32, 32, 3), dtype=np.uint8)
        targets = [0, 1, 2, 0, 1, 2, 0]

        def __len__(self):
            return 7

    items = ingest_module.torchvision_items(FakeCifar(), "torchvision:FakeCifar")
    data, label = items[2]
    assert data[:3] == b"\xff\xd8\xff" and label == 2 and items.class_names == ("a", "b", "c")


def test_unknown_source_lists_the_valid_ones():
    with pytest.raises(UserError, match="sklearn-digits, skimage-photos"):
        resolve_source("mnist")
    with pytest.raises(UserError, match="KEY=INTEGER"):
        resolve_source("skimage-photos:count=many")


def test_interrupted_ingest_leaves_nothing_that_looks_complete(tmp_path, monkeypatch):
    uri = tmp_path / "train.lance"
    real_batches = ingest_module._batches

    def failing_batches(items, indices, schema, progress):
        for number, batch in enumerate(real_batches(items, indices, schema, progress)):
            if number == 3:
                raise KeyboardInterrupt("node lost")
            yield batch

    monkeypatch.setattr(ingest_module, "_batches", failing_batches)
    monkeypatch.setattr(ingest_module, "WRITE_CHUNK_ROWS", 100)
    # Lance hands an exception raised in the batch reader back wrapped in an OSError that quotes it
    with pytest.raises((KeyboardInterrupt, OSError), match="node lost"):
        ingest("sklearn-digits", str(uri), rows_per_fragment=100)
    assert not uri.exists() and os.listdir(tmp_path) == []
    monkeypatch.undo()
    spec = DataSpec(uri=str(uri), ingest=IngestSpec(source="sklearn-digits", rows_per_fragment=500))
    ensure_dataset(spec)
    assert lance.dataset(str(uri)).count_rows() == 1797
    ensure_dataset(spec)  # already there: nothing to do
    assert lance.dataset(str(uri)).version == 1


SMALL_SOURCE = "skimage-photos:count=4,size=16"


def test_a_symlink_to_an_empty_directory_is_written_through(tmp_path):
    (tmp_path / "scratch" / "real.lance").mkdir(parents=True)
    link = tmp_path / "project" / "train.lance"
    link.parent.mkdir()
    link.symlink_to(tmp_path / "scratch" / "real.lance")
    assert ingest(SMALL_SOURCE, str(link)) == Ingested(train=4)
    assert link.is_symlink() and lance.dataset(str(link)).count_rows() == 4
    assert lance.dataset(str(tmp_path / "scratch" / "real.lance")).count_rows() == 4
    assert os.listdir(tmp_path / "scratch") == ["real.lance"] and os.listdir(tmp_path / "project") == ["train.lance"]
    assert ingest(SMALL_SOURCE, str(link)) == Ingested(kept=(str(link),))


def test_a_target_that_cannot_be_replaced_is_a_user_error_and_the_partial_copy_is_removed(tmp_path, monkeypatch, capsys):
    target = tmp_path / "mnt"
    target.mkdir()  # stands for an empty mount point, which rename cannot replace
    real_rename = os.rename

    def busy(source, destination, *args, **kwargs):  # fault injection: what rename onto a mount point does
        if Path(destination) == target:
            raise OSError(errno.EBUSY, os.strerror(errno.EBUSY), str(source), None, str(destination))
        return real_rename(source, destination, *args, **kwargs)

    monkeypatch.setattr(os, "rename", busy)
    with pytest.raises(
        UserError,
        match=rf"URI {target}: cannot move it into place \(Device or resource busy: "
        rf".*\.mnt\.partial-\w+\); its partial copy .* was removed\n"
        rf"  fix: point URI at a new path inside it \(e\.g\. {target}/dataset\.lance\)",
    ):
        ingest(SMALL_SOURCE, str(target))
    assert os.listdir(tmp_path) == ["mnt"] and os.listdir(target) == []
    # The command line prints it, without a traceback.
    assert main([SMALL_SOURCE, str(target)]) == 2
    error = capsys.readouterr().err
    assert f"error: URI {target}: cannot move it into place" in error and "Traceback" not in error


def test_a_failed_write_is_a_user_error_that_says_what_became_of_the_partial_copy(tmp_path, monkeypatch):
    def disk_full(reader, uri, **kwargs):  # fault injection: the disk fills up halfway through
        (Path(uri) / "data").mkdir()
        (Path(uri) / "data" / "half.lance").write_bytes(b"x")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(lance, "write_dataset", disk_full)
    target = tmp_path / "t.lance"
    with pytest.raises(
        UserError,
        match=rf"URI {target}: cannot write it \(No space left on device\); its partial "
        rf"copy {tmp_path}/\.t\.lance\.partial-\w+ was removed\n  fix: free space",
    ):
        ingest(SMALL_SOURCE, str(target))
    assert os.listdir(tmp_path) == []


def test_partial_directories_of_killed_ingests_are_named_not_deleted(tmp_path, caplog):
    old, recent = tmp_path / ".t.lance.partial-0badc0de", tmp_path / ".t.lance.partial-12345678"
    for partial in (old, recent):
        (partial / "data").mkdir(parents=True)
    hours_ago = time.time() - 2 * 3600
    os.utime(old, (hours_ago, hours_ago))
    with caplog.at_level("WARNING", logger="lance_hpc.data"):
        assert ingest(SMALL_SOURCE, str(tmp_path / "t.lance")) == Ingested(train=4)
    warnings = [record.getMessage() for record in caplog.records if "partial" in record.getMessage()]
    assert len(warnings) == 1 and str(old) in warnings[0] and str(recent) not in warnings[0]
    assert "delete it once no ingest of" in warnings[0]
    assert old.is_dir() and recent.is_dir()  # an ingest on another node may still be writing either


def test_ensure_dataset_without_ingest_says_how_to_fix(tmp_path):
    with pytest.raises(UserError, match="data.ingest is not set"):
        ensure_dataset(DataSpec(uri=str(tmp_path / "none.lance")))


def test_ensure_dataset_writes_validation_first_and_train_marks_completion(tmp_path):
    spec = DataSpec(
        uri=str(tmp_path / "t.lance"),
        val_uri=str(tmp_path / "v.lance"),
        ingest=IngestSpec(source="skimage-photos:count=20,size=16", val_fraction=0.25),
    )
    (tmp_path / "v.lance").mkdir()  # an empty directory holds nothing to lose: the dataset goes there
    ensure_dataset(spec)
    assert lance.dataset(str(tmp_path / "t.lance")).count_rows() == 15
    assert lance.dataset(str(tmp_path / "v.lance")).count_rows() == 5


def test_command_line(tmp_path, capsys):
    assert (
        main(
            [
                "skimage-photos:count=12,size=16",
                str(tmp_path / "t.lance"),
                "--val-uri",
                str(tmp_path / "v.lance"),
                "--val-fraction",
                "0.25",
                "--rows-per-fragment",
                "4",
            ]
        )
        == 0
    )
    assert "wrote 9 training rows" in capsys.readouterr().out
    assert len(lance.dataset(str(tmp_path / "t.lance")).get_fragments()) == 3
    assert main(["nonsense", str(tmp_path / "x.lance")]) == 2
    assert "unknown ingest source" in capsys.readouterr().err
    spec = tmp_path / "job.yaml"
    spec.write_text(f"name: j\ndata:\n  uri: {tmp_path / 'j.lance'}\n  ingest: {{source: sklearn-digits}}\n")
    assert main(["--spec", str(spec)]) == 0
    assert lance.dataset(str(tmp_path / "j.lance")).count_rows() == 1797


def test_python_dash_m_shim():
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "lance_hpc.ingest", "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "imagefolder" in result.stdout
    help_text = " ".join(result.stdout.split())
    assert "--overwrite write the source over Lance datasets already at the URIs, as a new version of each" in help_text
    assert "refused either way, and nothing is deleted" in help_text


def test_encode_image_rejects_unknown_formats():
    with pytest.raises(ValueError, match="jpeg or png"):
        encode_image(np.zeros((2, 2, 3), np.uint8), "tiff")


def test_a_path_holding_files_ingest_did_not_write_is_refused_and_left_alone(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "rv" / "important" / "sub").mkdir(parents=True)
    (tmp_path / "rv" / "important" / "sub" / "notes.txt").write_text("my notes")
    spec = tmp_path / "job.yaml"
    spec.write_text("name: j\ndata:\n  uri: rv/new.lance\n  val_uri: rv/important\n  ingest: {source: sklearn-digits}\n")
    for overwrite in ([], ["--overwrite"]):
        assert main(["--spec", str(spec), *overwrite]) == 2
        error = capsys.readouterr().err
        important = tmp_path / "rv" / "important"  # the spec's relative paths, resolved
        assert f"data.val_uri {important} exists and is not a Lance dataset (it holds sub/)" in error
        assert f"fix: point data.val_uri at a new path, or move {important} away yourself" in error
    assert (tmp_path / "rv" / "important" / "sub" / "notes.txt").read_text() == "my notes"
    assert os.listdir(tmp_path / "rv") == ["important"]  # refused before anything was written
    # A file, and a directory of many entries, on the command line: named as the command line names them.
    (tmp_path / "notes.lance").write_text("not a dataset")
    for index in range(7):
        (tmp_path / "rv" / "important" / f"{index}.txt").write_text("mine")
    assert main(["sklearn-digits", "notes.lance", "--val-uri", "v.lance"]) == 2
    assert "URI notes.lance exists and is not a Lance dataset (it is not a directory)" in capsys.readouterr().err
    assert main(["sklearn-digits", "t.lance", "--val-uri", "rv/important"]) == 2
    assert "--val-uri rv/important exists and is not a Lance dataset (it holds 0.txt, 1.txt, 2.txt, 3.txt, 4.txt and 3 more)" in (
        capsys.readouterr().err
    )
    assert (tmp_path / "notes.lance").read_text() == "not a dataset" and not (tmp_path / "t.lance").exists()


def test_a_dataset_already_there_is_kept_and_overwrite_writes_a_new_version_of_it(tmp_path, capsys):
    train, val = str(tmp_path / "t.lance"), str(tmp_path / "v.lance")
    arguments = [train, "--val-uri", val, "--val-fraction", "0.25"]
    assert main(["skimage-photos:count=12,size=16", *arguments]) == 0
    assert main(["sklearn-digits", *arguments]) == 0
    assert f"kept the Lance dataset already at {train}; to write the source over it as a new version, pass --overwrite" in (
        capsys.readouterr().out
    )
    assert lance.dataset(train).version == 1 and lance.dataset(train).count_rows() == 9
    assert main(["sklearn-digits", *arguments, "--overwrite"]) == 0
    assert "wrote 1,348 training rows" in capsys.readouterr().out
    for uri, before, after in ((train, 9, 1348), (val, 3, 449)):
        assert lance.dataset(uri).version == 2 and lance.dataset(uri).count_rows() == after
        assert lance.dataset(uri, version=1).count_rows() == before  # the version written over is still there
        assert class_names(uri) == [str(digit) for digit in range(10)]


def test_a_validation_set_of_an_unfinished_ingest_is_kept_one_from_another_source_is_refused(tmp_path):
    train, val = tmp_path / "t.lance", tmp_path / "v.lance"
    photos = "skimage-photos:count=20,size=16"
    ingest(photos, str(tmp_path / "other.lance"), str(val), val_fraction=0.25)  # val written, train elsewhere
    spec = DataSpec(uri=str(train), val_uri=str(val), ingest=IngestSpec(source=photos, val_fraction=0.25))
    assert ensure_dataset(spec) == Ingested(train=15, kept=(str(val),))
    assert lance.dataset(str(val)).version == 1 and lance.dataset(str(train)).count_rows() == 15
    assert ensure_dataset(spec) == Ingested(kept=(str(train),))  # complete: nothing to do
    digits = DataSpec(uri=str(tmp_path / "d.lance"), val_uri=str(val), ingest=IngestSpec(source="sklearn-digits"))
    with pytest.raises(
        UserError,
        match=r"(?s)data.val_uri .*v.lance already holds a Lance dataset ingested from "
        r"skimage-photos, not from sklearn-digits.*fix: to write sklearn-digits over it as a new version, "
        r"set data.ingest.overwrite: true",
    ):
        ensure_dataset(digits)
    assert not (tmp_path / "d.lance").exists()
    overwriting = digits.model_copy(update={"ingest": IngestSpec(source="sklearn-digits", overwrite=True)})
    assert ensure_dataset(overwriting) == Ingested(train=1438, val=359)
    assert lance.dataset(str(val)).version == 2


def start_together(count, run):
    """Run ``run(index)`` in ``count`` threads at once; returns their results in order."""
    results, errors = [None] * count, []

    def target(index):
        try:
            results[index] = run(index)
        except BaseException as error:  # noqa: BLE001 - reported by the assertion below
            errors.append(error)

    threads = [threading.Thread(target=target, args=(index,)) for index in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    return results


def writes_meet_before_committing(monkeypatch, count):
    """Each write hands over its last rows only once every one of ``count`` writers has read all of
    its own: every ingest has written its files before any commits."""
    barrier, real_batches = threading.Barrier(count), ingest_module._batches

    def batches(items, indices, schema, progress):
        yield from real_batches(items, indices, schema, progress)
        barrier.wait(timeout=120)

    monkeypatch.setattr(ingest_module, "_batches", batches)


def test_concurrent_ingests_of_one_dataset_commit_once_and_the_others_use_it(tmp_path, monkeypatch):
    train, val = str(tmp_path / "t.lance"), str(tmp_path / "v.lance")
    writes_meet_before_committing(monkeypatch, 3)
    results = start_together(3, lambda _: ingest("sklearn-digits", train, val, val_fraction=0.25, rows_per_fragment=500))
    # One ingest wrote each dataset (not always the same one); every other kept what it found.
    assert sorted(result.train for result in results) == [0, 0, 1348] and sorted(result.val for result in results) == [0, 0, 449]
    assert all((train in result.kept) == (result.train == 0) and (val in result.kept) == (result.val == 0) for result in results)
    assert lance.dataset(train).version == 1 == lance.dataset(val).version
    assert lance.dataset(train).count_rows() == 1348 and lance.dataset(val).count_rows() == 449
    assert sorted(os.listdir(tmp_path)) == ["t.lance", "v.lance"]  # the losers' temporary directories are gone


@pytest.mark.s3
def test_on_s3_other_objects_are_refused_and_concurrent_creates_commit_once(s3_server, monkeypatch):
    for key, value in s3_server.env.items():
        monkeypatch.setenv(key, value)
    options = storage_options(s3_server.uri("x"), s3_server.storage_options)
    store = fs.S3FileSystem(**filesystem_arguments(options))
    notes = f"{s3_server.bucket}/ingest-safety/important/sub/notes.txt"
    with store.open_output_stream(notes) as stream:
        stream.write(b"my notes")
    train, important = s3_server.uri("ingest-safety/t.lance"), s3_server.uri("ingest-safety/important")
    with pytest.raises(UserError, match=r"--val-uri s3://\S+/important exists and is not a Lance dataset \(it holds sub/\)"):
        ingest("sklearn-digits", train, important, options=options, overwrite=True)
    with store.open_input_stream(notes) as stream:
        assert stream.read() == b"my notes"
    assert store.get_file_info(f"{s3_server.bucket}/ingest-safety/t.lance").type == fs.FileType.NotFound

    # An interrupted create leaves only Lance's own uncommitted files: a later ingest goes on beside them.
    interrupted = s3_server.uri("ingest-safety/interrupted.lance")
    lance.fragment.write_fragments(pa.table({"label": [1, 2]}), interrupted, storage_options=options)
    assert ingest("sklearn-digits", interrupted, options=options).train == 1797
    assert lance.dataset(interrupted, storage_options=options).count_rows() == 1797

    writes_meet_before_committing(monkeypatch, 2)
    results = start_together(2, lambda _: ingest("sklearn-digits", train, options=options, rows_per_fragment=900))
    assert sorted((result.train, result.kept) for result in results) == [(0, (train,)), (1797, ())]
    assert lance.dataset(train, storage_options=options).version == 1


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        (["--rows-per-fragment", "0"], "--rows-per-fragment 0: must be >= 1, got 0"),
        (["--sequence-length", "2147483647"], "--sequence-length 2147483647: must be <= 1048576"),
        (["--val-fraction", "1.5"], "--val-fraction 1.5: must be < 1.0, got 1.5"),
        (["--val-fraction", "nan"], "--val-fraction nan: must be a finite number"),
        (["--val-fraction", "-0.1"], "--val-fraction -0.1: must be >= 0.0"),
        (["--max-pixels", "178956970"], "--max-pixels 178956970: must be <= 89478485"),
        (["--max-record-mb", "0"], "--max-record-mb 0: must be >= 1, got 0"),
    ],
)
def test_command_line_numbers_are_held_to_the_specs_bounds(tmp_path, capsys, options, expected):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("a document " * 100)
    source = f"text:{tmp_path}/docs/*.txt"
    assert main([source, str(tmp_path / "t.lance"), "--val-uri", str(tmp_path / "v.lance"), *options]) == 2
    err = capsys.readouterr().err
    assert expected in err and ("fix: set a value" in err or "fix: write a number" in err), err
    assert not (tmp_path / "t.lance").exists() and not (tmp_path / ".t.lance.ingest").exists()
    field = options[0][2:].replace("-", "_")
    value = int(options[1]) if options[1].isdigit() else float(options[1])
    spec = {"name": "bounds", "data": {"uri": "/d", "ingest": {"source": source, field: value}}}
    with pytest.raises(SpecError, match=re.escape(f"data.ingest.{field}: {expected.split(': ', 1)[1]}")):
        validate_spec(spec)
