"""Sources in the formats ingest reads, built from scikit-learn's digits: WebDataset tars and
Parquet files, each sample with an id, its JPEG, its class and a float field."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from lance_hpc.ingest.sources import sklearn_digits

DIGITS = 60


def digit_rows(count: int = DIGITS) -> list[dict]:
    images = sklearn_digits(size=16)
    return [
        {"id": f"d{index:04d}", "jpg": images[index][0], "cls": images[index][1], "quality": index / count}
        for index in range(count)
    ]


def write_webdataset(directory: Path, rows: list[dict], per_tar: int, broken: dict[int, bytes] | None = None) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for start in range(0, len(rows), per_tar):
        with tarfile.open(directory / f"shard-{start // per_tar:04d}.tar", "w") as tar:
            for index in range(start, min(start + per_tar, len(rows))):
                row = rows[index]
                members = {
                    "jpg": (broken or {}).get(index, row["jpg"]),
                    "cls": str(row["cls"]).encode(),
                    "json": json.dumps({"quality": row["quality"]}).encode(),
                }
                for extension, data in members.items():
                    info = tarfile.TarInfo(f"{row['id']}.{extension}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))


def write_parquet(directory: Path, rows: list[dict], per_file: int, row_group: int) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for start in range(0, len(rows), per_file):
        part = rows[start : start + per_file]
        table = pa.table(
            {
                "uid": [row["id"] for row in part],
                "image_bytes": [row["jpg"] for row in part],
                "class_id": [row["cls"] for row in part],
                "quality": [row["quality"] for row in part],
            }
        )
        pq.write_table(table, directory / f"part-{start // per_file:03d}.parquet", row_group_size=row_group)


def ingest_job_spec(directory: Path, val_fraction: float) -> Path:
    """A ``job: ingest`` spec over the WebDataset tars in ``directory/wds``, on 1 node x 2 tasks,
    writing ``train.lance`` and ``val.lance`` beside them."""
    job = directory / "ingest.yaml"
    job.write_text(
        f"""
name: ingest-digits
job: ingest
slurm: {{nodes: 1, tasks_per_node: 2, log_dir: {directory / "logs"}}}
data:
  uri: {directory / "train.lance"}
  val_uri: {directory / "val.lance"}
  ingest: {{source: "webdataset:{directory}/wds/*.tar", val_fraction: {val_fraction}}}
"""
    )
    return job
