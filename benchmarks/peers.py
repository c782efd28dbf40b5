"""The peer loaders' own formats of a benchmark data set, written once beside it: MosaicML
streaming's MDS shards, LitData's optimized chunks and a LanceDB table, each holding the data set's
very JPEG bytes and labels in row order. The LanceDB table is the benchmark's Lance dataset
rewritten with the same rows per fragment, less its schema metadata (the class names): lancedb
0.40's permutation builder, which its StreamingDataset and shuffled Permutations need, panics on a
table whose schema carries metadata.

MDS is written twice: with its ``jpeg`` column type (what its documentation shows for images, and
what its reader decodes to a PIL image) and with a ``bytes`` column, so that lance_hpc's decode can
be fed the same bytes through the same reader. LitData needs one copy: its ``jpeg`` serializer can
be swapped at read time for one that returns the bytes undecoded.

Everything lives under ``<data set>/peers/`` with a manifest; a data set that is regenerated takes
its peer formats with it, and a change of :data:`PEER_FORMAT` rebuilds them.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, cast

from benchmarks.datasets import DataSet

# Bump when the layout of the peer formats changes, so old copies are rebuilt.
PEER_FORMAT = 1
LANCEDB_TABLE = "train"  # the data set's train.lance, opened through a LanceDB connection
# LitData's chunk size, as its documentation's examples set it; MDS keeps its default (64 MiB).
LITDATA_CHUNK_BYTES = "64MB"


@dataclass(frozen=True)
class PeerData:
    """Where each peer's copy of one benchmark data set lives (local paths)."""

    lancedb_dir: str  # a LanceDB database directory holding table LANCEDB_TABLE
    mds_jpeg: str  # MDS shards, image column of MDS type "jpeg"
    mds_bytes: str  # MDS shards, image column of MDS type "bytes"
    litdata: str  # LitData chunks, image serialized by its "jpeg" serializer


def peer_paths(data: DataSet) -> PeerData:
    peers = Path(data.lance_uri).parent / "peers"
    return PeerData(str(peers / "lancedb"), str(peers / "mds-jpeg"), str(peers / "mds-bytes"), str(peers / "litdata"))


def rows(data: DataSet) -> Iterator[tuple[Path, int]]:
    """(JPEG file, label) per row in storage order: the ImageFolder copy holds the rows' very bytes."""
    import lance

    from lance_hpc.tasks.base import DatasetInfo
    from lance_hpc.tasks.image import class_names

    dataset = lance.dataset(data.lance_uri)
    names = class_names(DatasetInfo(data.lance_uri, dataset.schema, dataset.count_rows(), dataset), "label")
    row = 0
    for batch in dataset.to_batches(columns=["label"], batch_size=4096):
        for label in batch.column("label").to_pylist():
            yield Path(data.folder) / names[label] / f"{row:06d}.jpg", label
            row += 1


def _write_mds(data: DataSet, out: Path, image_type: str) -> None:
    from PIL import Image
    from streaming import MDSWriter

    with MDSWriter(out=str(out), columns={"image": image_type, "label": "int"}, progress_bar=False) as writer:
        for path, label in rows(data):
            if image_type == "jpeg":
                with Image.open(path) as image:  # an opened JPEG file: MDS stores the file's bytes as they are
                    writer.write({"image": image, "label": label})
            else:
                writer.write({"image": path.read_bytes(), "label": label})


def litdata_item(row: tuple[str, int]) -> dict[str, Any]:
    """LitData's ``optimize`` function: an opened JPEG file (stored byte for byte) and its label."""
    from PIL import Image

    path, label = row
    return {"image": Image.open(path), "label": label}


def _write_litdata(data: DataSet, out: Path) -> None:
    import contextlib
    import io

    from litdata import optimize

    inputs = [(str(path), label) for path, label in rows(data)]
    # One worker and the inputs in order: the chunks hold the rows in storage order, so equal data sets
    # give equal chunks. optimize prints progress; the benchmark says what it is doing itself.
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        optimize(
            fn=litdata_item,
            inputs=inputs,
            output_dir=str(out),
            chunk_bytes=LITDATA_CHUNK_BYTES,
            num_workers=1,
            reorder_files=False,
            keep_data_ordered=True,
            mode="overwrite",
            verbose=False,
        )
    index = json.loads((out / "index.json").read_text())
    written = sum(chunk["chunk_size"] for chunk in index["chunks"])
    if written != data.spec.count:  # optimize reports a failed worker by leaving rows out, not by raising
        raise RuntimeError(f"LitData's optimize wrote {written} of {data.spec.count} rows to {out}")


def _write_lancedb(data: DataSet, out: Path) -> None:
    import lance

    source = lance.dataset(data.lance_uri)
    table = source.to_table(columns=["image", "label"]).replace_schema_metadata(None)
    rows_per_fragment = max(fragment.count_rows() for fragment in source.get_fragments())
    lance.write_dataset(
        table,
        str(out / f"{LANCEDB_TABLE}.lance"),
        max_rows_per_file=rows_per_fragment,
        data_storage_version=cast(Any, source.data_storage_version),
    )


WRITERS: dict[str, Callable[[DataSet, Path], None]] = {
    "lancedb": _write_lancedb,
    "mds-jpeg": lambda data, out: _write_mds(data, out, "jpeg"),
    "mds-bytes": lambda data, out: _write_mds(data, out, "bytes"),
    "litdata": _write_litdata,
}


def prepare_peers(data: DataSet, log: Callable[[str], None] = print) -> PeerData:
    """The peer formats of ``data``, written unless an identical set is there already."""
    paths = peer_paths(data)
    root = Path(paths.mds_jpeg).parent
    manifest_path = root / "manifest.json"
    wanted = {"format": PEER_FORMAT, "count": data.spec.count, "lance_uri": data.lance_uri}
    if manifest_path.is_file() and json.loads(manifest_path.read_text()) == wanted:
        return paths
    log(f"writing the peers' formats of {data.spec.name} (LanceDB table, MDS shards, LitData chunks) in {root} ...")
    staging = root.with_name(root.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    for name, write in WRITERS.items():
        write(data, staging / name)
    (staging / "manifest.json").write_text(json.dumps(wanted, indent=1))
    shutil.rmtree(root, ignore_errors=True)
    staging.rename(root)  # the peer formats are either complete or absent
    return paths
