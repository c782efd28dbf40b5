"""The benchmark's peer loaders on a tiny data set: each reads every row once, with the shape and type
its decode gives, from its own format of the same bytes; locally and over the S3 benchmark server."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from pathlib import Path

import lance
import pytest
import torch

from benchmarks.datasets import DataSetSpec, prepare
from benchmarks.peers import prepare_peers
from benchmarks.pipelines import LanceHpcDecode, build_pipeline
from lance_hpc.bench.configs import Measurement
from lance_hpc.bench.pipeline import batch_images

SPEC = DataSetSpec("small", count=96, image_size=32, batch_size=16, size=48, rows_per_fragment=40)
KINDS = ("lancedb_streaming", "lancedb_permutation", "mosaic_streaming", "litdata")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench-peers")
    data = prepare(SPEC, root / "data", log=lambda _: None)
    return root, data, prepare_peers(data, log=lambda _: None)


def _location(paths, kind: str, decode: str) -> str:
    if kind.startswith("lancedb"):
        return f"{paths.lancedb_dir}/train"
    if kind == "mosaic_streaming":
        return paths.mds_bytes if decode == "lance_hpc" else paths.mds_jpeg
    return paths.litdata


def _digest(image) -> str:
    return hashlib.blake2b(image.contiguous().numpy().tobytes(), digest_size=8).hexdigest()


def _read_all(kind: str, data_fields: dict) -> list:
    config = Measurement(
        "peer", kind, "small", image_size=SPEC.image_size, batch_size=SPEC.batch_size, num_workers=2, data=data_fields
    )
    return [image for batch in build_pipeline(config) for image in batch_images(batch)]


def _expected(data) -> Counter:
    """lance_hpc's decode of every row of the Lance dataset, straight from its bytes."""
    decode = LanceHpcDecode(SPEC.image_size)
    images = lance.dataset(data.lance_uri).to_table(columns=["image"]).column("image").to_pylist()
    return Counter(_digest(decode(image)) for image in images)


def test_peer_formats_hold_the_lance_rows_bytes_and_are_written_once(tiny):
    _, data, paths = tiny
    lance_rows = lance.dataset(data.lance_uri).to_table(columns=["image", "label"]).to_pylist()
    from streaming import StreamingDataset

    mds = StreamingDataset(local=paths.mds_bytes, batch_size=SPEC.batch_size)
    assert [mds[index]["image"] for index in range(mds.num_samples)] == [row["image"] for row in lance_rows]
    assert [int(mds[index]["label"]) for index in range(mds.num_samples)] == [row["label"] for row in lance_rows]
    index = json.loads((Path(paths.litdata) / "index.json").read_text())
    assert sum(chunk["chunk_size"] for chunk in index["chunks"]) == SPEC.count
    table = lance.dataset(f"{paths.lancedb_dir}/train.lance").to_table()
    assert table.column("image").to_pylist() == [row["image"] for row in lance_rows]
    assert not table.schema.metadata  # lancedb 0.40's permutation builder panics on schema metadata
    messages: list[str] = []
    assert prepare_peers(data, log=messages.append) == paths and messages == []


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_peer_fed_lance_hpc_decode_reads_every_row_once_with_its_pixels(tiny, kind):
    root, data, paths = tiny
    images = _read_all(
        kind, {"uri": _location(paths, kind, "lance_hpc"), "decode": "lance_hpc", "cache_dir": str(root / "cache" / kind)}
    )
    assert {(tuple(image.shape), image.dtype) for image in images} == {((3, 32, 32), torch.uint8)}
    assert Counter(_digest(image) for image in images) == _expected(data)


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_peer_out_of_the_box_reads_every_row_as_float_images(tiny, kind):
    root, _, paths = tiny
    images = _read_all(kind, {"uri": _location(paths, kind, "peer"), "decode": "peer", "cache_dir": str(root / "cache" / kind)})
    assert len(images) == SPEC.count
    assert {(tuple(image.shape), image.dtype) for image in images} == {((3, 32, 32), torch.float32)}
    assert all(0.0 <= float(image.min()) and float(image.max()) <= 1.0 for image in images)


@pytest.mark.slow
@pytest.mark.s3
@pytest.mark.parametrize("kind", KINDS)
def test_peer_reads_every_row_over_the_s3_server_from_a_cold_cache(tiny, kind):
    from benchmarks.s3_server import start_server

    root, data, paths = tiny
    cache = root / "cache-s3" / kind
    cache.mkdir(parents=True)
    (cache / "stale").write_text("left by an earlier run")
    with start_server(root / "data", latency_ms=5) as server:
        local = Path(_location(paths, kind, "lance_hpc")).resolve()
        uri = server.uri(local.relative_to((root / "data").resolve()).as_posix())
        images = _read_all(
            kind, {"uri": uri, "decode": "lance_hpc", "cache_dir": str(cache), "storage_options": server.storage_options()}
        )
        assert server.counters()["gets"] > 0  # read from the server, not from a local path
    assert Counter(_digest(image) for image in images) == _expected(data)
    if kind in ("mosaic_streaming", "litdata"):  # the peers that keep a local copy of what they fetched
        assert not (cache / "stale").exists()  # every measurement starts from an empty cache
