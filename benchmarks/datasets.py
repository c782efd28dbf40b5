"""The benchmark's data sets: deterministic JPEG crops of scikit-image's sample photos, written
once as Lance (through lance_hpc's own ingest) and, from the Lance rows, as an ImageFolder
directory of the same bytes; cached in the output directory so that reruns start measuring at once."""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

# Bump when the layout of a cached data set changes, so old caches are rebuilt.
CACHE_FORMAT = 1


@dataclass(frozen=True)
class DataSetSpec:
    """How to generate one benchmark data set; equal specs give byte-identical data sets."""

    name: str  # "photos" or "small"
    count: int
    image_size: int  # side the pipelines resize to
    batch_size: int
    seed: int = 0
    min_side: int = 300
    max_side: int = 400
    size: int | None = None  # fixed square side instead of min_side..max_side
    quality: int = 90
    rows_per_fragment: int = 1024


@dataclass(frozen=True)
class DataSet:
    spec: DataSetSpec
    lance_uri: str
    folder: str
    mean_bytes: float
    mean_width: float
    mean_height: float

    def describe(self) -> str:
        return (
            f"{self.spec.count:,} JPEGs (q{self.spec.quality}), mean {self.mean_width:.0f}x{self.mean_height:.0f} px, "
            f"{self.mean_bytes / 1000:.0f} KB; resized to {self.spec.image_size}x{self.spec.image_size}, "
            f"batch {self.spec.batch_size}"
        )


def _write_lance(spec: DataSetSpec, uri: Path) -> None:
    """lance_hpc's own ingest of the scikit-image photo source (every row to training)."""
    from lance_hpc.ingest.dataset import ingest

    options = dict(count=spec.count, seed=spec.seed, min_side=spec.min_side, max_side=spec.max_side, quality=spec.quality)
    if spec.size is not None:
        options["size"] = spec.size
    source = "skimage-photos:" + ",".join(f"{key}={value}" for key, value in options.items())
    ingest(source, str(uri), rows_per_fragment=spec.rows_per_fragment, seed=spec.seed)


def _write_image_folder(lance_uri: Path, root: Path) -> tuple[float, float, float]:
    """The Lance rows' very bytes as ``root/<class>/<row>.jpg``; returns mean bytes, width, height."""
    import io

    import lance
    from PIL import Image

    from lance_hpc.tasks.base import DatasetInfo
    from lance_hpc.tasks.image import class_names

    dataset = lance.dataset(str(lance_uri))
    names = class_names(DatasetInfo(str(lance_uri), dataset.schema, dataset.count_rows(), dataset), "label")
    for name in names:
        (root / name).mkdir(parents=True, exist_ok=True)
    row = 0
    total_bytes = total_width = total_height = 0
    for batch in dataset.to_batches(columns=["image", "label"], batch_size=512):
        for data, label in zip(batch.column("image").to_pylist(), batch.column("label").to_pylist()):
            (root / names[label] / f"{row:06d}.jpg").write_bytes(data)
            width, height = Image.open(io.BytesIO(data)).size
            total_bytes, total_width, total_height = total_bytes + len(data), total_width + width, total_height + height
            row += 1
    return total_bytes / row, total_width / row, total_height / row


def prepare(spec: DataSetSpec, cache_dir: Path, log=print) -> DataSet:
    """The data set for ``spec`` under ``cache_dir``, generated unless an identical one is there."""
    directory = cache_dir / f"{spec.name}-{spec.count}"
    manifest_path = directory / "manifest.json"
    wanted = {"format": CACHE_FORMAT, "spec": asdict(spec)}
    if manifest_path.is_file():
        manifest = json.loads(manifest_path.read_text())
        if {key: manifest.get(key) for key in wanted} == wanted:
            return _from_manifest(spec, directory, manifest)
    log(f"generating the {spec.name} data set ({spec.count:,} images) in {directory} ...")
    staging = directory.with_name(directory.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    _write_lance(spec, staging / "train.lance")
    mean_bytes, mean_width, mean_height = _write_image_folder(staging / "train.lance", staging / "imagefolder")
    manifest = {**wanted, "mean_bytes": mean_bytes, "mean_width": mean_width, "mean_height": mean_height}
    (staging / "manifest.json").write_text(json.dumps(manifest, indent=1))
    shutil.rmtree(directory, ignore_errors=True)
    staging.rename(directory)  # a data set is either complete or absent
    return _from_manifest(spec, directory, manifest)


def _from_manifest(spec: DataSetSpec, directory: Path, manifest: dict) -> DataSet:
    return DataSet(
        spec=spec,
        lance_uri=str(directory / "train.lance"),
        folder=str(directory / "imagefolder"),
        mean_bytes=manifest["mean_bytes"],
        mean_width=manifest["mean_width"],
        mean_height=manifest["mean_height"],
    )
