"""lance_hpc.Loader under the frameworks people train with: Lightning's Trainer and Hugging Face
Accelerate, each example run on two gloo ranks by torchrun, stopped mid-epoch, resumed from the
framework's own checkpoint, and every row of each epoch trained on once."""

from __future__ import annotations

from pathlib import Path

from lightning.fabric.utilities.data import _set_sampler_epoch

from lance_hpc import Loader
from tests.test_loader_library import write_rows


def test_lightnings_fit_loop_reaches_the_loaders_epoch(tmp_path: Path) -> None:
    uri = write_rows(str(tmp_path / "rows.lance"), [30, 30])
    loader = Loader(uri, batch_size=8, columns=["x"], num_workers=0)
    first = [int(row) for batch in loader for row in batch["x"]]
    _set_sampler_epoch(loader, 1)  # what Lightning's fit loop calls on each train dataloader, every epoch
    assert loader.epoch == 1
    second = [int(row) for batch in loader for row in batch["x"]]
    assert sorted(first) == sorted(second) == list(range(60)) and first != second  # a new order
