"""The benchmark's GPU section: its training measurement runs here on the CPU (a small model on small
images, fp32), the same code that trains ResNet-50 in bf16 on a CUDA device; without one the
section measures nothing and says so."""

from __future__ import annotations

import pytest
import torch

from benchmarks import gpu
from benchmarks.cli import main
from benchmarks.datasets import DataSetSpec, prepare
from benchmarks.sections import Context
from benchmarks.worker import WORKER
from lance_hpc.bench.configs import Measurement
from lance_hpc.bench.runner import run_measurement


@pytest.mark.slow
def test_a_model_trains_on_every_batch_and_the_wait_for_data_is_measured(tmp_path):
    data = prepare(
        DataSetSpec("small", count=96, image_size=32, batch_size=16, size=32, rows_per_fragment=50),
        tmp_path / "data",
        log=lambda line: None,
    )
    common = dict(
        dataset="small-gpu",
        lance_uri=data.lance_uri,
        image_size=32,
        batch_size=16,
        num_workers=1,
        seconds=3.0,
        train_model="resnet18",
        device="cpu",
    )
    loader = dict(uri=data.lance_uri, style="map", sampler="distributed", batch_size=16, num_workers=1, seed=0)
    fed = Measurement("fed by lance_hpc", "lance_hpc", data=loader, full_epoch=True, **common)
    synthetic = Measurement("synthetic", "synthetic", **common)

    [fed_result] = run_measurement(fed, tmp_path / "work", WORKER)
    assert not fed_result.error, fed_result.error
    assert fed_result.epoch_done
    assert 0.0 < fed_result.data_wait_share < 1.0

    assert fed_result.device_name == "CPU"
    # 6 batches: the first and the 2 the worker queued meanwhile are trained on before the clock starts.
    assert fed_result.images == 3 * 16

    [synthetic_result] = run_measurement(synthetic, tmp_path / "work", WORKER)
    assert not synthetic_result.error, synthetic_result.error
    assert synthetic_result.images > 0 and not synthetic_result.epoch_done
    assert synthetic_result.data_wait_share < 0.5  # the same batch is at hand at once: the window is training


def test_synthetic_batches_are_one_channels_last_batch_on_the_device():
    config = Measurement("synthetic", "synthetic", "small-gpu", image_size=8, batch_size=4, device="cpu")
    batches = gpu.synthetic_batches(config)
    first, second = next(batches), next(batches)
    assert first is second
    assert first["image"].shape == (4, 3, 8, 8) and first["image"].dtype == torch.uint8
    assert first["image"].is_contiguous(memory_format=torch.channels_last)
    assert first["label"].shape == (4,) and int(first["label"].max()) < 1000


def test_a_train_step_updates_the_model_from_a_loader_batch_of_uint8_pixels():
    config = Measurement("fed", "lance_hpc", "small-gpu", image_size=16, batch_size=4, train_model="resnet18", device="cpu")
    step = gpu.TrainStep(config)
    before = step.model.fc.weight.detach().clone()
    images = torch.randint(0, 256, (4, 16, 16, 3), dtype=torch.uint8).permute(0, 3, 1, 2)  # as workers hand it over
    step({"image": images, "label": torch.tensor([0, 1, 2, 999])})
    assert not torch.equal(before, step.model.fc.weight)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_the_step_trains_in_bf16_channels_last_from_pinned_memory():
    config = Measurement("fed", "lance_hpc", "small-gpu", image_size=32, batch_size=8, train_model="resnet18")
    step = gpu.TrainStep(config)
    assert step.model.conv1.weight.is_cuda and step.model.conv1.weight.is_contiguous(memory_format=torch.channels_last)
    before = step.model.fc.weight.detach().clone()
    images = torch.randint(0, 256, (8, 3, 32, 32), dtype=torch.uint8).pin_memory()
    step({"image": images, "label": torch.arange(8).pin_memory()})
    assert not torch.equal(before, step.model.fc.weight) and step.device_name


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_without_a_cuda_device_the_section_measures_nothing_and_says_so(tmp_path, capsys):
    context = Context(tmp_path, tmp_path / "data", [], workers=2, seconds=2.0, tiny=False, machine="test")
    assert gpu.configs(context) == []
    found = gpu.section_report(context, {})
    assert found.targets == [] and "no CUDA device" in "\n".join(found.text)
    code = main(["--tiny", "--sections", "gpu", "--out", str(tmp_path / "out")])  # from the command, too
    assert code == 0
    assert "## GPU" in (tmp_path / "out" / "results.md").read_text()
    assert "the GPU section measured nothing" in capsys.readouterr().out
