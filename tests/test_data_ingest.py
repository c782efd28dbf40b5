"""Ingest: every source kind, the schema contract, train/val split, fragment size, atomicity."""

import json
import os
from pathlib import Path

import lance
import numpy as np
import pytest

from lance_hpc.data import ingest as ingest_module
from lance_hpc.data.ingest import ensure_dataset, ingest, main, resolve_source
from lance_hpc.data.sources import PHOTO_NAMES, encode_image, skimage_photo_crops
from lance_hpc.errors import UserError
from lance_hpc.spec import DataSpec, IngestSpec


def class_names(uri):
    return json.loads(lance.dataset(uri).schema.metadata[b"class_names"])


def test_sklearn_digits_train_val_split_schema_and_fragments(tmp_path):
    train, val = tmp_path / "train.lance", tmp_path / "val.lance"
    written = ingest("sklearn-digits", str(train), str(val), val_fraction=0.25, rows_per_fragment=300, seed=3)
    assert written == {"train": 1348, "val": 449}
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


def test_imagefolder_source(tmp_path):
    for index, (data, label) in enumerate(skimage_photo_crops(6, size=16)):
        folder = tmp_path / "images" / ("cat" if label % 2 else "dog")
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{index}.jpg").write_bytes(data)
    (tmp_path / "images" / "dog" / "notes.txt").write_text("not an image")
    written = ingest(f"imagefolder:{tmp_path / 'images'}", str(tmp_path / "t.lance"), str(tmp_path / "v.lance"), val_fraction=0.5)
    assert written == {"train": 3, "val": 3}
    assert class_names(str(tmp_path / "t.lance")) == ["cat", "dog"]


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
    assert written == {"train": 6, "val": 4}
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
    with pytest.raises(BaseException):
        ingest("sklearn-digits", str(uri), rows_per_fragment=100)
    assert not uri.exists() and os.listdir(tmp_path) == []
    monkeypatch.undo()
    spec = DataSpec(uri=str(uri), ingest=IngestSpec(source="sklearn-digits", rows_per_fragment=500))
    ensure_dataset(spec)
    assert lance.dataset(str(uri)).count_rows() == 1797
    ensure_dataset(spec)  # already there: nothing to do
    assert lance.dataset(str(uri)).version == 1


def test_ensure_dataset_without_ingest_says_how_to_fix(tmp_path):
    with pytest.raises(UserError, match="data.ingest is not set"):
        ensure_dataset(DataSpec(uri=str(tmp_path / "none.lance")))


def test_ensure_dataset_writes_validation_first_and_train_marks_completion(tmp_path):
    spec = DataSpec(
        uri=str(tmp_path / "t.lance"), val_uri=str(tmp_path / "v.lance"),
        ingest=IngestSpec(source="skimage-photos:count=20,size=16", val_fraction=0.25),
    )
    (tmp_path / "v.lance").mkdir()  # a leftover of an earlier interrupted run is replaced
    ensure_dataset(spec)
    assert lance.dataset(str(tmp_path / "t.lance")).count_rows() == 15
    assert lance.dataset(str(tmp_path / "v.lance")).count_rows() == 5


def test_command_line(tmp_path, capsys):
    assert main(["skimage-photos:count=12,size=16", str(tmp_path / "t.lance"), "--val-uri", str(tmp_path / "v.lance"),
                 "--val-fraction", "0.25", "--rows-per-fragment", "4"]) == 0
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


def test_encode_image_rejects_unknown_formats():
    with pytest.raises(ValueError, match="jpeg or png"):
        encode_image(np.zeros((2, 2, 3), np.uint8), "tiff")
