"""Checkpoint files: atomic writes that survive a crash mid-write, a full disk, pruning with the
manifests beside each checkpoint, reading the newest step without loading it, RNG round trips, the
collective save (only while this run holds the directory's lease), a checkpoint of another model,
and the preemption flag."""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from lance_hpc.checkpoint import lease, manifests, resuming, rng_states, saving, stores
from lance_hpc.checkpoint.manifests import checkpoint_name
from lance_hpc.checkpoint.shards.saver import ShardedSaver, tensor_state
from lance_hpc.checkpoint.stores import LocalDirectory, local, open_store
from lance_hpc.errors import UserError
from lance_hpc.runtime import preemption
from lance_hpc.runtime.environment import DistEnv
from lance_hpc.spec import JobSpec, load_spec_text
from lance_hpc.tasks.image import ImageOptions
from tests.support.checkpoints import small_tmpfs, state


def test_atomic_write_lists_and_prunes(tmp_path: Path) -> None:
    for step in (5, 10, 15, 20):
        open_store(tmp_path).write(checkpoint_name(step), state(step))
    (tmp_path / ".step-00000025.pt.999.tmp").write_bytes(b"half a checkpoint")
    assert [path.name for path in saving.list_checkpoints(open_store(tmp_path))] == [
        "step-00000005.pt",
        "step-00000010.pt",
        "step-00000015.pt",
        "step-00000020.pt",
    ]
    saving.prune(open_store(tmp_path), keep=2)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["step-00000015.pt", "step-00000020.pt"]
    found = resuming.load_latest(open_store(tmp_path))
    path, loaded = found.path, found.state
    assert path.name == "step-00000020.pt" and loaded["note"] == "step 20"
    assert resuming.load_latest(open_store(tmp_path / "missing")) is None


def test_failure_between_write_and_rename_keeps_the_previous_checkpoint(tmp_path: Path, monkeypatch) -> None:
    open_store(tmp_path).write(checkpoint_name(1), state(1))

    def fail(*args: object) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(local.os, "replace", fail)
    with pytest.raises(OSError, match="Input/output error"):
        open_store(tmp_path).write(checkpoint_name(2), state(2))
    found = resuming.load_latest(open_store(tmp_path))
    path, loaded = found.path, found.state
    assert path.name == "step-00000001.pt" and torch.equal(loaded["model"]["weight"], torch.full((4, 4), 1.0))
    assert [p.name for p in tmp_path.iterdir()] == ["step-00000001.pt"]  # the temporary file is gone


def test_process_killed_mid_write_leaves_a_loadable_previous_checkpoint(tmp_path: Path) -> None:
    """A real crash: the writer is SIGKILLed after its data hit the temporary file, before the rename."""
    child = textwrap.dedent(
        f"""
        import os, sys, time, torch
        from lance_hpc.checkpoint.manifests import checkpoint_name
        from lance_hpc.checkpoint.stores import local, open_store
        directory = {str(tmp_path)!r}
        open_store(directory).write(checkpoint_name(1), {{"step": 1, "weight": torch.ones(1000)}})
        real_fsync = os.fsync
        def fsync_then_hang(fd):
            real_fsync(fd)
            print("written", flush=True)
            time.sleep(600)
        local.os.fsync = fsync_then_hang
        open_store(directory).write(checkpoint_name(2), {{"step": 2, "weight": torch.zeros(10_000_000)}})
        """
    )
    process = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline().strip() == "written"
    finally:
        process.kill()
        process.wait()
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.endswith(stores.TEMP_SUFFIX)]
    assert len(leftovers) == 1 and (tmp_path / leftovers[0]).stat().st_size > 40_000_000
    found = resuming.load_latest(open_store(tmp_path))
    path, loaded = found.path, found.state
    assert path.name == "step-00000001.pt" and loaded["step"] == 1
    saving.prune(open_store(tmp_path), keep=3)  # the next save clears what the crash left
    assert [p.name for p in tmp_path.iterdir()] == ["step-00000001.pt"]


def test_unreadable_newest_checkpoint_falls_back_to_the_previous(tmp_path: Path, capsys) -> None:
    open_store(tmp_path).write(checkpoint_name(1), state(1))
    saving.checkpoint_path(open_store(tmp_path), 2).write_bytes(b"not a checkpoint")
    path = resuming.load_latest(open_store(tmp_path)).path
    assert path.name == "step-00000001.pt"
    assert "skipping unreadable checkpoint" in capsys.readouterr().err


def test_rng_states_round_trip() -> None:
    states = rng_states.capture_rng()
    expected = (random.random(), float(np.random.rand()), torch.rand(3))
    random.seed(99), np.random.seed(99), torch.manual_seed(99)
    rng_states.restore_rng(states)
    assert random.random() == expected[0] and float(np.random.rand()) == expected[1]
    assert torch.equal(torch.rand(3), expected[2])


def test_collective_save_gathers_every_rank_and_keeps_k(tmp_path: Path, single_rank: torch.device) -> None:
    for step in range(1, 5):
        path = saving.save(open_store(tmp_path), step, state(step), {"loader": {"batches_consumed": step}}, keep=2)
    assert path == saving.checkpoint_path(open_store(tmp_path), 4)
    assert [p.name for p in saving.list_checkpoints(open_store(tmp_path))] == ["step-00000003.pt", "step-00000004.pt"]
    loaded = resuming.load_latest(open_store(tmp_path)).state
    assert len(loaded["ranks"]) == dist.get_world_size() and loaded["ranks"][0]["loader"] == {"batches_consumed": 4}
    assert set(loaded["ranks"][0]["rng"]) == {"python", "numpy", "torch", "cuda"}


def test_a_sharded_save_is_listed_only_once_its_shards_are_on_disk(
    tmp_path: Path, single_rank: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A synchronous sharded save to a file system returns once the shards are written; their
    fsync and the step file follow in the background. When the flush fails, the save is never
    listed, the error reaches the caller at the next wait, and the previous checkpoint stays."""
    model = torch.nn.Linear(4, 3)
    saver = ShardedSaver(None)
    saving.save(open_store(tmp_path), 1, state(1), {}, keep=2, sharded=(saver, tensor_state({"model": model}), False))
    saver.wait()
    assert [path.name for path in saving.list_checkpoints(open_store(tmp_path))] == ["step-00000001.pt"]
    flushed: list[Path] = []

    def fail_to_flush(store: LocalDirectory, name: str) -> None:
        flushed.append(store.location(name))
        raise OSError(errno.EIO, "input/output error")

    monkeypatch.setattr(LocalDirectory, "flush_shards", fail_to_flush)
    saving.save(open_store(tmp_path), 2, state(2), {}, keep=2, sharded=(saver, tensor_state({"model": model}), False))
    with pytest.raises(RuntimeError, match="could not be written to disk on every rank"):
        saver.wait()
    assert flushed == [tmp_path / "step-00000002.dcp"]
    assert [path.name for path in saving.list_checkpoints(open_store(tmp_path))] == ["step-00000001.pt"]
    assert resuming.load_latest(open_store(tmp_path)).step == 1


def test_each_checkpoint_has_a_manifest_pruned_with_it(tmp_path: Path, single_rank: torch.device) -> None:
    for step in range(1, 4):
        saved = {**state(step), "epoch": step // 2, "progress": step / 4, "mid_epoch": True, "dataset_version": 3}
        saving.save(open_store(tmp_path), step, saved, {}, keep=2)
    (tmp_path / "step-00000001.json").write_text("{}")  # a manifest whose checkpoint is gone: a save cut short
    (tmp_path / ".step-00000004.json.77.tmp").write_text("{")
    saving.prune(open_store(tmp_path), keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "step-00000002.json",
        "step-00000002.pt",
        "step-00000003.json",
        "step-00000003.pt",
    ]
    manifest = json.loads((tmp_path / "step-00000003.json").read_text())
    assert manifest.pop("saved_at").endswith("+00:00")
    assert manifest == {
        "step": 3,
        "epoch": 1,
        "progress": 0.75,
        "mid_epoch": True,
        "world_size": 1,
        "dataset_version": 3,
        "checkpoint": "step-00000003.pt",
    }


def test_the_newest_step_is_read_from_names_and_manifests_without_loading(tmp_path: Path, monkeypatch) -> None:
    """What lance-hpc status and cancel read: a multi-GB checkpoint is neither loaded nor downloaded."""
    assert manifests.latest(open_store(tmp_path)) is None
    open_store(tmp_path).write(checkpoint_name(5), state(5))
    (tmp_path / "step-00000012.pt").write_bytes(b"not a torch file: never opened")
    (tmp_path / "step-00000012.json").write_text(json.dumps({"step": 12, "epoch": 2, "world_size": 4}))

    def no_loading(*args: object, **kwargs: object) -> None:
        raise AssertionError("torch.load was called")

    monkeypatch.setattr(torch, "load", no_loading)
    saved = manifests.latest(open_store(tmp_path))
    assert (saved.step, saved.epoch, saved.world_size, saved.location) == (12, 2, 4, str(tmp_path / "step-00000012.pt"))
    (tmp_path / "step-00000012.json").write_text("{damaged")  # the name still says the step
    assert (manifests.latest(open_store(tmp_path)).step, manifests.latest(open_store(tmp_path)).epoch) == (12, None)


@pytest.fixture
def small_filesystem(tmp_path: Path) -> Iterator[Path]:
    with small_tmpfs(tmp_path / "small", "1m") as mount_point:
        yield mount_point


def test_a_full_disk_is_one_message_and_the_previous_checkpoint_stays(small_filesystem: Path, single_rank: torch.device) -> None:
    saving.save(open_store(small_filesystem), 1, state(1), {}, keep=3)
    too_big = {"step": 2, "model": {"weight": torch.zeros(1_000_000)}}  # 4 MB on a 1 MiB file system
    with pytest.raises(UserError) as full:
        saving.save(open_store(small_filesystem), 2, too_big, {}, keep=3)
    lines = str(full.value).splitlines()
    free = shutil.disk_usage(small_filesystem).free
    assert lines[0] == (
        f"cannot write {small_filesystem}/step-00000002.pt: the file system is full "
        f"({free / 1024:.1f} KiB free in {small_filesystem} after removing the partial file, which had "
        f"reached {lines[0].rsplit('reached ', 1)[1]}"
    )
    assert lines[1].startswith("  the newest complete checkpoint, step-00000001.pt, is intact")
    assert lines[2].startswith("  fix: free space there or point checkpoint.dir at a larger file system")
    assert "enforce fail" not in str(full.value)
    assert sorted(p.name for p in small_filesystem.iterdir()) == ["step-00000001.json", "step-00000001.pt"]
    assert resuming.load_latest(open_store(small_filesystem)).step == 1


def test_a_save_after_another_run_took_the_lease_writes_nothing(tmp_path: Path, single_rank: torch.device) -> None:
    held, _ = lease.acquire(open_store(tmp_path), lease.this_process(None, 0))
    try:
        saving.save(open_store(tmp_path), 1, state(1), {}, keep=3)
        other = lease.this_process("55", 0)
        (tmp_path / lease.LEASE_NAME).write_bytes(other.encode())  # what a run that judged this one dead leaves
        with pytest.raises(
            UserError,
            match=f"this run no longer holds its lease .another run took it over: pid {os.getpid()} on .*, SLURM job 55",
        ):
            saving.save(open_store(tmp_path), 2, state(2), {}, keep=3)
        assert [p.name for p in saving.list_checkpoints(open_store(tmp_path))] == ["step-00000001.pt"]
    finally:
        held.release()


def test_failed_save_raises_instead_of_hanging(tmp_path: Path, single_rank: torch.device) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("a file where the checkpoint directory should be")
    with pytest.raises(RuntimeError, match="cannot write checkpoint"):
        saving.save(open_store(blocker / "checkpoints"), 1, state(1), {}, keep=1)


def test_preemption_signal_only_sets_a_flag(single_rank: torch.device) -> None:
    before = signal.getsignal(signal.SIGUSR2), signal.getsignal(signal.SIGTERM)
    with preemption.Preemption() as stop:
        assert not stop.agreed(single_rank) and stop.agreed_signal is None
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.agreed(single_rank) and stop.agreed_signal == signal.SIGTERM
        os.kill(os.getpid(), signal.SIGUSR2)
        os.kill(os.getpid(), signal.SIGTERM)  # a later SIGTERM does not take back the requeue request
        assert stop.agreed(single_rank) and stop.agreed_signal == signal.SIGUSR2
    assert (signal.getsignal(signal.SIGUSR2), signal.getsignal(signal.SIGTERM)) == before


def test_no_requeue_beyond_max_requeues() -> None:
    env = DistEnv("slurm", 0, 0, 1, 1, 0, 1, "node1", 20001, job_id="12", restart_count=3)
    requeued, message = preemption.requeue_sbatch(env, max_requeues=3)
    assert not requeued and "requeued 3 times already (slurm.max_requeues: 3)" in message


def fake_scontrol(folder: Path, requeue: str, restarts: int) -> None:
    """An scontrol whose ``requeue`` runs the shell lines ``requeue`` and whose ``show job`` says
    the job was requeued ``restarts`` times."""
    script = folder / "scontrol"
    script.write_text(
        "#!/bin/sh\n"
        f'if [ "$1" = requeue ]; then echo "$2" >> "{folder}/requeued"; {requeue}; fi\n'
        f'echo "JobId=13 ArrayJobId=12 ArrayTaskId=0 JobName=j JobState=PENDING Restarts={restarts}"\n'
    )
    script.chmod(0o755)


def test_scontrol_starts_with_the_steps_signals_blocked_so_none_sent_before_its_trap_kills_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A signal sent to the step again reaches a new process of it at once: scontrol's shell gets it
    blocked from its start, as scontrol does after its ``exec``, so it waits until it is ignored."""
    script = tmp_path / "scontrol"  # in Python: a shell's own children start with no signal blocked
    script.write_text(
        f"#!{sys.executable}\n"
        "import sys\n"
        f"open({str(tmp_path / 'requeued')!r}, 'a').write(sys.argv[2] + '\\n')\n"
        f"open({str(tmp_path / 'blocked')!r}, 'w').write(open('/proc/self/status').read().split('SigBlk:')[1].split()[0])\n"
    )
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    env = DistEnv("slurm", 0, 0, 1, 1, 0, 1, "node1", 20001, job_id="13", array_job_id="12", array_task_id="0")
    assert preemption.requeue_sbatch(env, max_requeues=3) == (True, "requeued job 12_0 (requeue 1 of at most 3)")
    blocked = int((tmp_path / "blocked").read_text(), 16)
    assert all(blocked >> (number - 1) & 1 for number in preemption.SPARED_SIGNALS)
    assert not signal.pthread_sigmask(signal.SIG_BLOCK, []) & set(preemption.SPARED_SIGNALS)  # this process: unblocked again
    assert (tmp_path / "requeued").read_text() == "12_0\n"


@pytest.mark.parametrize(
    ("requeue", "restarts", "expected"),
    [
        # the step's SIGTERM reaches scontrol while it reports the requeue: it ignores it
        ("kill -TERM $$; exit 0", 0, (True, "requeued job 12_0 (requeue 1 of at most 3)")),
        # the warning signal sent to the step again (scancel retries one a node missed) before it asks
        ("kill -USR2 $$; kill -USR1 $$; exit 0", 0, (True, "requeued job 12_0 (requeue 1 of at most 3)")),
        # scontrol died without a word, yet SLURM counts the requeue
        ("kill -KILL $$", 1, (True, "requeued job 12_0 (requeue 1 of at most 3)")),
        ("exit 1", 0, (False, "scontrol requeue 12_0 failed: exit code 1, nothing printed")),
        ("echo 'Job is not running' >&2; exit 1", 0, (False, "scontrol requeue 12_0 failed: Job is not running")),
    ],
)
def test_a_requeue_counts_when_slurm_did_it_whatever_scontrol_said(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, requeue: str, restarts: int, expected: tuple[bool, str]
) -> None:
    fake_scontrol(tmp_path, requeue, restarts)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    env = DistEnv("slurm", 0, 0, 1, 1, 0, 1, "node1", 20001, job_id="13", array_job_id="12", array_task_id="0")
    assert preemption.requeue_sbatch(env, max_requeues=3) == expected
    assert (tmp_path / "requeued").read_text() == "12_0\n"


@pytest.mark.parametrize(
    ("requeue", "restarts", "expected"),
    [
        # submitit's own scontrol gets the step's SIGTERM (and a warning signal again) as the requeue takes
        ("kill -TERM $$; kill -USR2 $$; exit 0", 0, (True, "requeued by submitit")),
        # it died anyway, yet SLURM counts the requeue: no traceback, the job goes on
        ("kill -KILL $$", 1, (True, "requeued by submitit")),
        ("exit 1", 0, (False, "submitit's scontrol requeue failed: exit code 1, nothing printed")),
    ],
)
def test_a_requeue_through_submitits_handler_survives_the_signals_of_its_own_success(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, requeue: str, restarts: int, expected: tuple[bool, str]
) -> None:
    """submitit's USR2 handler runs ``scontrol requeue`` itself (check_call) and exits the task."""
    fake_scontrol(tmp_path, requeue, restarts)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")

    def submitits_handler(signum: int, frame: object) -> None:  # as submitit's checkpoint_and_try_requeue
        subprocess.check_call(["scontrol", "requeue", "12_0"], timeout=60)
        sys.exit(-1)

    stopped = preemption.Preemption()
    stopped.previous[signal.SIGUSR2] = submitits_handler
    env = DistEnv("slurm", 0, 0, 1, 1, 0, 1, "node1", 20001, job_id="13", array_job_id="12", array_task_id="0")
    before = {signum: signal.getsignal(signum) for signum in preemption.SPARED_SIGNALS}
    assert preemption.requeue_with_submitit(env, digits_spec("small_cnn"), stopped) == expected
    assert {signum: signal.getsignal(signum) for signum in preemption.SPARED_SIGNALS} == before
    assert (tmp_path / "requeued").read_text() == "12_0\n"


def digits_spec(model: str) -> JobSpec:
    return load_spec_text(f"name: job\ndata: {{uri: /data/train.lance}}\ntask: {{options: {{model: {model}}}}}\n").spec


def test_a_checkpoint_of_another_model_is_one_message_naming_both(tmp_path: Path) -> None:
    """Written for small_cnn, resumed with --set task.options.model=resnet18."""
    written_for = digits_spec("small_cnn")
    resumed = resuming.Checkpoint(
        tmp_path / "step-00000010.pt", {"model": {}, "spec": written_for.redacted_dict()}, LocalDirectory(tmp_path)
    )
    spec = digits_spec("resnet18")
    with pytest.raises(UserError) as refused:
        resuming.check_same_model(resumed, spec, ImageOptions(model="resnet18"))
    assert str(refused.value) == (
        f"checkpoint {tmp_path}/step-00000010.pt was written for model small_cnn (task image_classification), but "
        "this job trains model resnet18 (task image_classification)\n"
        "  fix: give this job another checkpoint.dir (--set checkpoint.dir=DIR), or set task.options.model: small_cnn "
        "to continue that run; checkpoint.resume: false starts over, in a directory without checkpoints"
    )

    # a spec that left the model out meant the default (resnet18): the same model, so it loads
    default = load_spec_text("name: job\ndata: {uri: /data/train.lance}\n").spec
    model = torch.nn.Linear(2, 2)
    same = resuming.Checkpoint(
        resumed.path, {"model": torch.nn.Linear(2, 2).state_dict(), "spec": default.redacted_dict()}, LocalDirectory(tmp_path)
    )
    resuming.check_same_model(same, spec, ImageOptions(model="resnet18"))
    resuming.restore_object(model, same.objects["model"], same, spec, "model")
    assert torch.equal(model.weight, same.state["model"]["weight"])


def test_a_users_model_that_does_not_match_lists_a_few_keys(tmp_path: Path) -> None:
    """Script mode: the model is the user's own, so only its keys can tell."""
    written = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    resumed = resuming.Checkpoint(
        tmp_path / "step-00000010.pt", {"spec": digits_spec("small_cnn").redacted_dict()}, LocalDirectory(tmp_path)
    )
    now = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3), torch.nn.Linear(3, 3))
    with pytest.raises(UserError) as refused:
        resuming.restore_object(now, written.state_dict(), resumed, digits_spec("resnet18"), "model")
    assert str(refused.value) == (
        f"checkpoint {tmp_path}/step-00000010.pt: its 'model' does not match this job's model (2 key(s) missing from "
        "the checkpoint: 3.weight, 3.bias; 3 key(s) of another shape (checkpoint vs model): "
        "0.weight [8, 4] vs [16, 4], 0.bias [8] vs [16], 2.weight [3, 8] vs [3, 16])\n"
        "  the checkpoint was written with task.options.model: small_cnn (this job: resnet18)\n"
        "  fix: give this job another checkpoint.dir (--set checkpoint.dir=DIR), or build the model the checkpoint "
        "was written for; checkpoint.resume: false starts over, in a directory without checkpoints"
    )

    optimizer = torch.optim.AdamW(now.parameters())
    saved = torch.optim.AdamW(written.parameters()).state_dict()
    saved["param_groups"][0]["params"] = saved["param_groups"][0]["params"][:2]
    with pytest.raises(UserError, match="its 'optimizer' does not match this job's optimizer .loaded state dict "):
        resuming.restore_object(optimizer, saved, resumed, digits_spec("resnet18"), "optimizer")
