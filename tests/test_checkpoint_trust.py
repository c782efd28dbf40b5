"""A checkpoint directory is data from anyone: exporting, resuming from and evaluating one never runs
code its files carry or reads outside it, and says so in one message naming the file."""

from __future__ import annotations

import io
import os
import pickle
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemWriter, _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from lance_hpc.checkpoint import resuming, saving
from lance_hpc.checkpoint.export import export
from lance_hpc.checkpoint.manifests import checkpoint_name
from lance_hpc.checkpoint.shards.saver import ShardedSaver, load_shards, tensor_state
from lance_hpc.checkpoint.stores import LocalDirectory, open_store
from lance_hpc.cli.checkpoint import main as checkpoint_main
from lance_hpc.errors import ExitCode, UserError
from lance_hpc.spec import JobSpec, load_spec
from lance_hpc.tasks.models import small_cnn
from tests.support.jobs import REPO_ROOT
from tests.test_infer import infer_spec

MARKER = "code-ran"


class RunsCode:
    """Unpickled, it creates the file ``marker``: what a hostile checkpoint would do instead."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[str]]:
        return exec, (f"open({str(self.marker)!r}, 'w').close()",)


def model_and_optimizer() -> dict[str, Any]:
    """A small_cnn for 10 classes after one AdamW step: the optimizer has state and hyperparameters."""
    torch.manual_seed(0)
    model = small_cnn(10)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(2, 3, 16, 16)).sum().backward()
    optimizer.step()
    return {"model": model, "optimizer": optimizer}


def write_checkpoint(directory: Path, spec: JobSpec, step: int = 1) -> None:
    """A sharded checkpoint of :func:`model_and_optimizer`, as a training job writes it."""
    saver = ShardedSaver(None)
    state = {"format": saving.FORMAT, "step": step, "epoch": 0, "progress": 0.0, "mid_epoch": False}
    state.update(objects={}, spec=spec.redacted_dict())
    saving.save(open_store(directory), step, state, {}, keep=2, sharded=(saver, tensor_state(model_and_optimizer()), False))
    saver.wait()


def metadata_of(shards: Path) -> Any:
    return pickle.loads((shards / ".metadata").read_bytes())


def point_an_item_at(shards: Path, pick: Callable[[str, Any], bool], payload: bytes, name: str = "extra.distcp") -> None:
    """The first item of the metadata that ``pick`` (key, storage metadata) chooses, read from a
    file of ``payload`` instead: the metadata itself stays DCP's own."""
    metadata = metadata_of(shards)
    key = next(key for key, item in metadata.state_dict_metadata.items() if pick(key, item))
    (shards / name).write_bytes(payload)
    for index in list(metadata.storage_data):
        if index.fqn == key:
            metadata.storage_data[index] = _StorageInfo(name, 0, len(payload))
    (shards / ".metadata").write_bytes(pickle.dumps(metadata))


def saved_object(value: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def tamper(directory: Path, how: str, marker: Path) -> str:
    """Make the checkpoint in ``directory`` hostile in one way; the file a refusal must name."""
    shards = directory / "step-00000001.dcp"
    if how == "metadata":  # .metadata itself runs code
        (shards / ".metadata").write_bytes(pickle.dumps(RunsCode(marker)))
        return str(shards / ".metadata")
    if how == "tensor-item":  # a tensor of the model read from a pickle that runs code
        point_an_item_at(
            shards,
            lambda key, item: key.startswith("model.") and isinstance(item, TensorStorageMetadata),
            saved_object(RunsCode(marker)),
        )
        return str(shards)
    if how == "bytes-item":  # an optimizer hyperparameter read from a pickle that runs code
        point_an_item_at(shards, lambda key, item: isinstance(item, BytesStorageMetadata), saved_object(RunsCode(marker)))
        return str(shards)
    if how == "data-outside":  # the metadata names a data file outside the shard directory
        shutil.copy(shards / "__0_0.distcp", directory / "elsewhere.distcp")
        metadata = metadata_of(shards)
        for index, stored in list(metadata.storage_data.items()):
            metadata.storage_data[index] = _StorageInfo("../elsewhere.distcp", stored.offset, stored.length)
        (shards / ".metadata").write_bytes(pickle.dumps(metadata))
        return str(shards / ".metadata")
    if how in ("metadata-fifo", "metadata-device"):  # a read that would never end, or never begin
        (shards / ".metadata").unlink()
        if how == "metadata-fifo":
            os.mkfifo(shards / ".metadata")
        else:
            (shards / ".metadata").symlink_to("/dev/zero")
        return str(shards / ".metadata")
    assert how == "shards-outside"  # the step file names shards outside checkpoint.dir: a full copy is there
    shutil.copytree(shards, directory.parent / "elsewhere")
    step_file = directory / "step-00000001.pt"
    LocalDirectory(directory).write(step_file.name, {**torch.load(step_file, weights_only=True), "shards": "../elsewhere"})
    return str(step_file)


HOSTILE = ["metadata", "tensor-item", "data-outside", "shards-outside"]


@pytest.fixture
def spec(tmp_path: Path, digits) -> JobSpec:
    return load_spec(infer_spec(tmp_path / "eval", digits.val, tmp_path / "checkpoints", job="evaluate")).spec


def hostile_checkpoint(tmp_path: Path, spec: JobSpec, how: str) -> tuple[Path, str, Path]:
    """A checkpoint made hostile ``how``: its directory, the file a refusal names, the marker file
    its code would create."""
    directory, marker = tmp_path / "checkpoints", tmp_path / MARKER
    write_checkpoint(directory, spec)
    return directory, tamper(directory, how, marker), marker


def assert_refused(message: str, named: str, marker: Path) -> None:
    assert not marker.exists(), "the checkpoint ran its code"
    assert message.startswith("refusing checkpoint file ") and named in message, message
    assert "Traceback" not in message and "fix:" in message, message


@pytest.mark.parametrize("how", [*HOSTILE, "metadata-fifo", "metadata-device"])
def test_export_refuses_a_hostile_checkpoint_in_one_message(
    tmp_path: Path, spec: JobSpec, single_rank: torch.device, how: str
) -> None:
    """The command itself, in its own process: what it prints is all the user sees."""
    directory, named, marker = hostile_checkpoint(tmp_path, spec, how)
    done = subprocess.run(
        [sys.executable, "-m", "lance_hpc", "checkpoint", "export", str(directory), str(tmp_path / "model.pt")],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        timeout=120,
    )
    assert done.returncode == ExitCode.USER_ERROR, done.stdout + done.stderr
    assert done.stderr.count("refusing checkpoint file") == 1, done.stderr
    assert_refused(done.stderr[done.stderr.index("refusing") :], named, marker)
    assert "Traceback" not in done.stderr, done.stderr
    assert not (tmp_path / "model.pt").exists()


@pytest.mark.parametrize("how", [*HOSTILE, "bytes-item"])
def test_resuming_refuses_a_hostile_checkpoint_in_one_message(
    tmp_path: Path, spec: JobSpec, single_rank: torch.device, how: str
) -> None:
    directory, named, marker = hostile_checkpoint(tmp_path, spec, how)
    saved = resuming.load_latest(open_store(directory))
    assert saved is not None
    with pytest.raises(UserError) as refused:
        load_shards(model_and_optimizer(), saved.store, saved.shards)  # as CheckpointManager.register does
    assert_refused(str(refused.value), named, marker)


@pytest.mark.parametrize("how", HOSTILE)
def test_evaluation_refuses_a_hostile_checkpoint_in_one_message(
    tmp_path: Path, spec: JobSpec, single_rank: torch.device, how: str
) -> None:
    from lance_hpc.loading import load_task
    from lance_hpc.writeback.job import load_model

    directory, named, marker = hostile_checkpoint(tmp_path, spec, how)
    with pytest.raises(UserError) as refused:
        load_model(spec, load_task(spec), torch.device("cpu"))
    assert_refused(str(refused.value), named, marker)


def test_an_untampered_checkpoint_still_exports_resumes_and_evaluates(
    tmp_path: Path, spec: JobSpec, single_rank: torch.device
) -> None:
    from lance_hpc.loading import load_task
    from lance_hpc.writeback.job import load_model

    directory = tmp_path / "checkpoints"
    write_checkpoint(directory, spec)
    expected = model_and_optimizer()
    assert checkpoint_main(["export", str(directory), str(tmp_path / "model.pt")]) == 0
    exported = torch.load(tmp_path / "model.pt", weights_only=True)
    assert all(torch.equal(exported[key], value) for key, value in expected["model"].state_dict().items())
    saved = resuming.load_latest(open_store(directory))
    assert saved is not None and saved.shards is not None
    resumed = {"model": small_cnn(10), "optimizer": None}
    resumed["optimizer"] = torch.optim.AdamW(resumed["model"].parameters(), lr=0.5)
    load_shards(resumed, saved.store, saved.shards)
    assert resumed["optimizer"].param_groups[0]["lr"] == 0.01
    assert all(torch.equal(resumed["model"].state_dict()[key], value) for key, value in expected["model"].state_dict().items())
    model, _ = load_model(spec, load_task(spec), torch.device("cpu"))
    assert model is not None


class Killed(BaseException):
    """Raised where a save is cut short: nothing after it runs, as when the ranks are killed there."""


def cut_short(where: str) -> None:
    raise Killed(where)


# A point of a repeated save -> (object, attribute) that is cut short there.
SAVE_POINTS: dict[str, tuple[Any, str]] = {
    "before-the-shards": (LocalDirectory, "shard_writer"),
    "before-their-metadata": (FileSystemWriter, "finish"),
    "before-their-fsync": (LocalDirectory, "flush_shards"),
    "before-the-step-file": (LocalDirectory, "write"),
    "before-the-manifest": (LocalDirectory, "write_bytes"),
    "while-pruning": (LocalDirectory, "delete_shards"),
}


def other_weights() -> dict[str, Any]:
    """The objects of :func:`model_and_optimizer`, another step later: other weights to save."""
    objects = model_and_optimizer()
    objects["model"](torch.randn(2, 3, 16, 16)).sum().backward()
    objects["optimizer"].step()
    return objects


@pytest.mark.parametrize("point", list(SAVE_POINTS))
def test_a_repeated_save_cut_short_anywhere_leaves_a_checkpoint_that_loads(
    tmp_path: Path, spec: JobSpec, single_rank: torch.device, monkeypatch: pytest.MonkeyPatch, point: str
) -> None:
    """The step saved again (ctx.save() after the loop saved it, an epoch-end hook, a restart
    repeating it) with checkpoint.keep: 1, cut short at ``point``: the newest checkpoint still
    exports and resumes, whole, as one save or the other left it; the save repeated once more
    completes, and the old shards are gone."""
    directory = tmp_path / "checkpoints"
    state = {"format": saving.FORMAT, "step": 1, "epoch": 0, "progress": 0.0, "mid_epoch": False}
    state.update(objects={}, spec=spec.redacted_dict())
    first, second = model_and_optimizer(), other_weights()

    def save_step_1(objects: dict[str, Any]) -> None:
        saver = ShardedSaver(None)
        saving.save(open_store(directory), 1, state, {}, keep=1, sharded=(saver, tensor_state(objects), False))
        saver.wait()

    save_step_1(first)

    owner, name = SAVE_POINTS[point]
    with monkeypatch.context() as patched:
        patched.setattr(owner, name, lambda *args, **kwargs: cut_short(point))
        with pytest.raises((Killed, CheckpointException, RuntimeError), match=point):  # as DCP or the saver report it
            save_step_1(second)

    def loads_as_one_of(*candidates: dict[str, Any]) -> None:
        export(str(directory), tmp_path / "model.pt", None)
        exported = torch.load(tmp_path / "model.pt", weights_only=True)
        wholes = [candidate["model"].state_dict() for candidate in candidates]
        assert any(all(torch.equal(exported[key], value) for key, value in whole.items()) for whole in wholes)
        saved = resuming.load_latest(open_store(directory))
        assert saved is not None and saved.shards is not None
        load_shards(model_and_optimizer(), saved.store, saved.shards)

    loads_as_one_of(first, second)
    save_step_1(second)  # the restart repeats the save
    loads_as_one_of(second)
    saved = resuming.load_latest(open_store(directory))
    assert saved is not None
    assert sorted(path.name for path in directory.glob("*.dcp")) == [saved.shards]


def one_file_checkpoints(directory: Path, steps: list[int]) -> dict[int, dict[str, torch.Tensor]]:
    """A one-file (ddp) checkpoint of each of ``steps``, its model's weights all ``step``; those weights by step."""
    weights = {step: {"weight": torch.full((64, 64), float(step)), "bias": torch.full((64,), float(step))} for step in steps}
    for step in steps:
        LocalDirectory(directory).write(checkpoint_name(step), {"step": step, "objects": {"model": weights[step]}})
    return weights


def test_export_never_follows_a_link_planted_at_its_temporary_name(tmp_path: Path) -> None:
    """Links at the name the export used to write through, and at the name a pid makes guessable,
    point at a file of someone else's: it stays as it was, and OUT is a file of its own."""
    directory, out = tmp_path / "checkpoints", tmp_path / "model.pt"
    one_file_checkpoints(directory, [1])
    victim = tmp_path / "victim"
    victim.write_text("someone else's file\n")
    planted = [tmp_path / f".{out.name}.tmp", tmp_path / f".{out.name}.{os.getpid()}.tmp"]
    for link in planted:
        link.symlink_to(victim)
    export(str(directory), out, None)
    assert victim.read_text() == "someone else's file\n"
    assert all(link.is_symlink() and link.resolve() == victim for link in planted)
    assert not out.is_symlink() and torch.equal(torch.load(out, weights_only=True)["weight"], torch.full((64, 64), 1.0))


def test_two_exports_to_one_file_leave_the_one_renamed_last_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The export of step 1 has written its file and stops there while the export of step 2 runs to
    the end; then step 1's goes on. Both report what they wrote, and OUT holds step 1's model,
    whole: the export that renamed last."""
    directory, out = tmp_path / "checkpoints", tmp_path / "model.pt"
    weights = one_file_checkpoints(directory, [1, 2])
    first_written, second_done = threading.Event(), threading.Event()
    real_save = torch.save

    def save(*args: Any, **kwargs: Any) -> None:
        real_save(*args, **kwargs)
        if threading.current_thread().name == "step-1":
            first_written.set()
            assert second_done.wait(timeout=60)

    monkeypatch.setattr(torch, "save", save)
    reports: dict[int, str | BaseException] = {}

    def export_step(step: int) -> None:
        try:
            reports[step] = export(str(directory), out, step)
        except BaseException as error:  # reported below, with what the other export said
            reports[step] = error

    first = threading.Thread(target=export_step, args=(1,), name="step-1")
    first.start()
    assert first_written.wait(timeout=60)
    export_step(2)
    second_done.set()
    first.join(timeout=60)
    assert all(isinstance(report, str) for report in reports.values()), reports
    assert "(step 1)" in str(reports[1]) and "(step 2)" in str(reports[2]), reports
    exported = torch.load(out, weights_only=True)
    assert exported.keys() == weights[1].keys() and all(torch.equal(exported[key], weights[1][key]) for key in exported)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["checkpoints", "model.pt"], "a temporary file was left"
