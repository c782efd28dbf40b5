"""Checkpoints on object storage against the loopback S3 server (moto, credentials checked): save,
list, load and prune under an s3:// checkpoint.dir, with a manifest beside each checkpoint; an upload
cut short leaves the previous checkpoint the latest; a failed write names the URI, the operation and
the fix, on every rank; a two-rank local job interrupted by SIGUSR2 resumes from its S3
checkpoint and finishes; and a second job on the same checkpoint.dir is refused while the first runs.

Objects are also listed with boto3, a client independent of the code under test."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import uuid
from datetime import timedelta
from pathlib import Path

import boto3
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lance_hpc import loading
from lance_hpc.checkpoint import lease, manifests, resuming, saving
from lance_hpc.checkpoint.manifests import checkpoint_name
from lance_hpc.checkpoint.stores import open_store
from lance_hpc.errors import ExitCode, UserError
from lance_hpc.kinds.rank import exit_process
from lance_hpc.loading import load_task
from lance_hpc.spec import SpecError, load_spec, load_spec_text
from tests.support.checkpoints import state
from tests.support.jobs import REPO_ROOT, write_spec
from tests.support.ports import free_port
from tests.support.ranks import rank_pid
from tests.support.s3 import S3Server


@pytest.fixture
def s3_env(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> S3Server:
    """A job's environment: the valid key, and the endpoint, which checkpoints take from AWS_ENDPOINT_URL."""
    for key, value in {**s3_server.env, "AWS_ENDPOINT_URL": s3_server.endpoint}.items():
        monkeypatch.setenv(key, value)
    return s3_server


@pytest.fixture
def run_uri(s3_env: S3Server) -> str:
    """A checkpoint.dir of its own for each test, written with a trailing slash as users often do."""
    return s3_env.uri(f"runs/{uuid.uuid4().hex[:8]}/")


def s3_client(server: S3Server):  # type: ignore[no-untyped-def]
    return boto3.client(
        "s3",
        endpoint_url=server.endpoint,
        region_name=server.region,
        aws_access_key_id=server.access_key_id,
        aws_secret_access_key=server.secret_access_key,
    )


def key_prefix(server: S3Server, uri: str) -> str:
    return uri.removeprefix(f"s3://{server.bucket}/").rstrip("/") + "/"


def stored(server: S3Server, uri: str) -> list[str]:
    """Names of the objects under ``uri`` (less the empty ``prefix/`` marker pyarrow leaves after a delete)."""
    prefix = key_prefix(server, uri)
    listing = s3_client(server).list_objects_v2(Bucket=server.bucket, Prefix=prefix)
    return sorted(item["Key"].removeprefix(prefix) for item in listing.get("Contents", []) if item["Key"] != prefix)


@pytest.mark.s3
def test_save_list_load_and_prune_on_s3(
    run_uri: str, s3_env: S3Server, single_rank: torch.device, tmp_path: Path, digits, capsys: pytest.CaptureFixture[str]
) -> None:
    for step in range(1, 5):
        path = saving.save(open_store(run_uri), step, state(step), {"loader": {"batches_consumed": step}}, keep=2)
    assert path == f"{run_uri}step-00000004.pt"
    assert saving.list_checkpoints(open_store(run_uri)) == [saving.checkpoint_path(open_store(run_uri), 3), path]
    assert stored(s3_env, run_uri) == ["step-00000003.json", "step-00000003.pt", "step-00000004.json", "step-00000004.pt"]
    newest = manifests.latest(open_store(run_uri))  # what lance-hpc status reads: a listing and a manifest
    assert (newest.step, newest.location, newest.world_size) == (4, path, 1)
    found = resuming.load_latest(open_store(run_uri))
    assert found.path == path and found.step == 4 and found.state["note"] == "step 4"
    assert torch.equal(found.state["model"]["weight"], torch.full((4, 4), 4.0))
    assert found.rank_state(0)["loader"] == {"batches_consumed": 4}

    big = torch.randn(4_000_000)  # 16 MB: a multipart upload
    open_store(run_uri).write(checkpoint_name(5), {"step": 5, "weight": big})
    assert torch.equal(resuming.load_latest(open_store(run_uri)).state["weight"], big)

    client, prefix = s3_client(s3_env), key_prefix(s3_env, run_uri)
    client.put_object(Bucket=s3_env.bucket, Key=f"{prefix}step-00000006.pt", Body=b"not a checkpoint")
    client.put_object(Bucket=s3_env.bucket, Key=f"{prefix}notes.txt", Body=b"not listed")
    assert resuming.load_latest(open_store(run_uri)).step == 5
    assert f"skipping unreadable checkpoint {run_uri}step-00000006.pt" in capsys.readouterr().err
    saving.prune(open_store(run_uri), keep=1)
    assert stored(s3_env, run_uri) == ["notes.txt", "step-00000006.pt"]
    assert resuming.load_latest(open_store(s3_env.uri("runs/never-written"))) is None

    fresh = load_spec(write_spec(tmp_path, digits, checkpoint={"dir": run_uri, "resume": False})).spec
    assert fresh.checkpoint.dir == run_uri  # a URI is not resolved against the run directory
    with pytest.raises(UserError, match=f"checkpoint.dir {run_uri} holds checkpoints of an earlier run"):
        resuming.find_resume_point(fresh)


@pytest.mark.parametrize(
    "directory, problem",
    [
        (
            "gs://bucket/run",
            "checkpoint.dir: gs:// is not a checkpoint store\n      fix: use a local directory or s3://bucket/prefix",
        ),
        ("s3:///run", "checkpoint.dir: s3:///run names no bucket\n      fix: write it as s3://bucket/prefix"),
    ],
)
def test_the_spec_accepts_s3_checkpoint_dirs_and_refuses_other_schemes(directory: str, problem: str) -> None:
    spec = "name: job\ndata: {{uri: /data/train.lance}}\ncheckpoint: {{dir: '{}'}}\n"
    assert load_spec_text(spec.format("s3://bucket/runs/{name}/")).spec.checkpoint.dir == "s3://bucket/runs/job/"
    with pytest.raises(SpecError) as refused:
        load_spec_text(spec.format(directory))
    assert problem in str(refused.value)


HALF_UPLOAD = """
import time, torch
from lance_hpc.checkpoint import stores
from lance_hpc.checkpoint.manifests import checkpoint_name
from lance_hpc.checkpoint.stores import open_store

directory = {directory!r}
open_store(directory).write(checkpoint_name(1), {{"step": 1, "weight": torch.ones(1000)}})

class HalfUpload:
    '''Uploads the first half of what it is given, then hangs until the test kills the process.'''
    def __init__(self, stream):
        self.stream = stream
    def __enter__(self):
        return self
    def __exit__(self, *exc_info):
        return False
    def write(self, payload):
        self.stream.write(payload[: len(payload) // 2])
        self.stream.flush()  # the parts so far are on the server
        print("uploading", flush=True)
        time.sleep(600)

class HalfUploads:
    def __init__(self, filesystem):
        self.filesystem = filesystem
    def open_output_stream(self, path):
        return HalfUpload(self.filesystem.open_output_stream(path))

real_filesystem = stores.ObjectStore.filesystem.func
stores.ObjectStore.filesystem = property(lambda store: HalfUploads(real_filesystem(store)))
open_store(directory).write(checkpoint_name(2), {{"step": 2, "weight": torch.zeros(6_000_000)}})
"""


@pytest.mark.s3
def test_an_upload_cut_short_leaves_the_previous_checkpoint_the_latest(run_uri: str, s3_env: S3Server) -> None:
    """A real crash mid-upload: the writer is SIGKILLed after half of a 40 MB checkpoint reached the server."""
    child = textwrap.dedent(HALF_UPLOAD.format(directory=run_uri))
    process = subprocess.Popen(
        [sys.executable, "-c", child], stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    )
    try:
        assert process.stdout.readline().strip() == "uploading"
        uploads = s3_client(s3_env).list_multipart_uploads(Bucket=s3_env.bucket, Prefix=key_prefix(s3_env, run_uri))
    finally:
        process.kill()
        process.wait()
    assert [upload["Key"].rsplit("/", 1)[1] for upload in uploads["Uploads"]] == ["step-00000002.pt"]
    assert stored(s3_env, run_uri) == ["step-00000001.pt"]
    assert saving.list_checkpoints(open_store(run_uri)) == [saving.checkpoint_path(open_store(run_uri), 1)]
    assert resuming.load_latest(open_store(run_uri)).step == 1

    # torch.save fails halfway through the state: nothing is uploaded under the final name
    unpicklable = {"step": 3, "weight": torch.zeros(5_000_000), "callback": lambda: None}
    with pytest.raises(Exception, match="pickle"):
        open_store(run_uri).write(checkpoint_name(3), unpicklable)
    assert stored(s3_env, run_uri) == ["step-00000001.pt"]


@pytest.mark.s3
def test_failed_writes_name_the_uri_the_operation_and_the_fix(
    run_uri: str, s3_env: S3Server, single_rank: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    saving.save(open_store(run_uri), 1, state(1), {}, keep=3)
    errors = []

    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    with pytest.raises(UserError) as wrong_secret:
        saving.save(open_store(run_uri), 2, state(2), {}, keep=3)
    errors.append(str(wrong_secret.value))
    assert errors[-1] == (
        f"cannot write checkpoint {run_uri}step-00000002.pt: the object store at {s3_env.endpoint} rejected the "
        "credentials (SIGNATURE_DOES_NOT_MATCH); earlier checkpoints are untouched\n"
        "  fix: export valid AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN for temporary "
        "credentials) for this endpoint in the environment that runs lance-hpc and the job"
    )
    listing_refused = f"cannot list checkpoints in {run_uri[:-1]}: .* rejected the credentials"
    with pytest.raises(UserError, match=listing_refused) as listing:
        resuming.load_latest(open_store(run_uri))
    errors.append(str(listing.value))
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAWRONGWRONGWRONG0")
    with pytest.raises(UserError, match="rejected the credentials .INVALID_ACCESS_KEY_ID.") as wrong_key:
        saving.save(open_store(run_uri), 2, state(2), {}, keep=3)
    errors.append(str(wrong_key.value))
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_env.access_key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_env.secret_access_key)
    assert resuming.load_latest(open_store(run_uri)).step == 1
    assert stored(s3_env, run_uri) == ["step-00000001.json", "step-00000001.pt"]

    missing = "s3://no-such-bucket/run"
    with pytest.raises(
        UserError,
        match=f"cannot write checkpoint {missing}/step-00000001.pt: bucket 'no-such-bucket' "
        f"does not exist at {s3_env.endpoint}.*\n  fix: create the bucket",
    ):
        saving.save(open_store(missing), 1, state(1), {}, keep=3)
    with pytest.raises(UserError, match=f"cannot list checkpoints in {missing}: bucket 'no-such-bucket' does not"):
        resuming.load_latest(open_store(missing))

    down = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setenv("AWS_ENDPOINT_URL", down)
    with pytest.raises(
        UserError,
        match=f"cannot write checkpoint {run_uri}step-00000002.pt: cannot reach the object "
        f"store at {down}.*\n  fix: check AWS_ENDPOINT_URL",
    ) as unreachable:
        saving.save(open_store(run_uri), 2, state(2), {}, keep=3)
    errors.append(str(unreachable.value))
    for message in errors:
        assert s3_env.secret_access_key not in message and "not-the-secret" not in message
        assert s3_env.access_key_id not in message and "AKIAWRONGWRONGWRONG0" not in message


def save_on_two_ranks(rank: int, store_file: str, uri: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=2, timeout=timedelta(seconds=60))
    try:
        saving.save(open_store(uri), 2, state(2), {}, keep=3)
        outcome = "saved"
    except UserError as error:
        outcome = f"UserError: {error}"
    Path(out_dir, f"{rank}.txt").write_text(outcome)
    dist.destroy_process_group()
    exit_process(0)  # as a rank of lance_hpc.run ends: gloo's threads may still hold the last broadcast


@pytest.mark.s3
@pytest.mark.slow
def test_a_failed_write_raises_the_same_clear_error_on_every_rank(
    run_uri: str, s3_env: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")  # the spawned ranks inherit it
    mp.start_processes(save_on_two_ranks, args=(str(tmp_path / "store"), run_uri, str(tmp_path)), nprocs=2, start_method="spawn")
    outcomes = [(tmp_path / f"{rank}.txt").read_text() for rank in range(2)]
    assert outcomes[0] == outcomes[1]
    assert outcomes[0].startswith(f"UserError: cannot write checkpoint {run_uri}step-00000002.pt: the object store")
    assert "fix: export valid AWS_ACCESS_KEY_ID" in outcomes[0]


def submit_local(spec_file: Path, environ: dict[str, str] | None = None) -> subprocess.Popen:
    """``python -m lance_hpc.submit SPEC --local --nproc 2`` in the background, its output piped."""
    return subprocess.Popen(
        [sys.executable, "-m", "lance_hpc.submit", str(spec_file), "--local", "--nproc", "2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=REPO_ROOT,
        env={**os.environ, **(environ or {}), "PYTHONPATH": str(REPO_ROOT)},
    )


def read_until(process: subprocess.Popen, marker: str) -> str:
    """The output of ``process`` up to and including the first line that contains ``marker``."""
    lines = []
    for line in process.stdout:
        lines.append(line)
        if marker in line:
            return "".join(lines)
    raise AssertionError(f"{marker!r} never appeared:\n{''.join(lines)}")


@pytest.mark.s3
@pytest.mark.slow
def test_a_local_job_interrupted_mid_run_resumes_from_its_s3_checkpoint(
    run_uri: str, s3_env: S3Server, tmp_path: Path, digits
) -> None:
    spec_file = write_spec(tmp_path, digits, train={"epochs": 2}, checkpoint={"dir": run_uri})
    spec = load_spec(spec_file).spec
    steps_per_epoch = loading.build_train_loader(spec.data, load_task(spec).decoder(train=True), 0, 2).steps_per_epoch

    refused = submit_local(spec_file, {"AWS_SECRET_ACCESS_KEY": "not-the-secret"})
    output = refused.communicate(timeout=300)[0]
    assert refused.returncode != 0 and "Traceback" not in output, output
    assert f"cannot list checkpoints in {run_uri[:-1]}: the object store at {s3_env.endpoint} rejected" in output
    assert "not-the-secret" not in output and s3_env.secret_access_key not in output

    interrupted = submit_local(spec_file)
    read_until(interrupted, f"step {steps_per_epoch + 5}/")  # early in the second epoch
    interrupted.send_signal(signal.SIGUSR2)
    output = interrupted.communicate(timeout=120)[0]
    assert interrupted.returncode == ExitCode.STOPPED, output
    assert f"by SIGUSR2; checkpoint {run_uri}step-" in output
    stopped = resuming.load_latest(open_store(run_uri))
    assert stopped.state["mid_epoch"] and steps_per_epoch < stopped.step < 2 * steps_per_epoch
    assert not list(tmp_path.rglob("step-*.pt"))  # nothing went to a local directory

    resumed = submit_local(spec_file)
    output = resumed.communicate(timeout=300)[0]
    assert resumed.returncode == 0, output
    assert f"resuming from {stopped.path} at step {stopped.step}" in output
    assert resuming.load_latest(open_store(run_uri)).step == 2 * steps_per_epoch
    assert len(stored(s3_env, run_uri)) == 2 * spec.checkpoint.keep  # each with its manifest
    assert lease.LEASE_NAME not in stored(s3_env, run_uri)  # released when the run ended


@pytest.mark.s3
@pytest.mark.slow
def test_a_second_job_on_the_same_s3_checkpoint_dir_is_refused(run_uri: str, s3_env: S3Server, tmp_path: Path, digits) -> None:
    spec_file = write_spec(
        tmp_path, digits, train={"epochs": 50}, checkpoint={"dir": run_uri}, logging={"log_every_steps": 1, "progress": False}
    )
    first = submit_local(spec_file)
    try:
        read_until(first, "step 3/")
        second = submit_local(spec_file)  # the same job again, on the same checkpoint.dir
        output = second.communicate(timeout=300)[0]
        assert second.returncode == 2 and "Traceback" not in output, output
        assert (
            f"checkpoint.dir {run_uri} is in use by another run: pid {rank_pid(first, 0)} on {socket.gethostname()}, a local run"
        ) in output
        assert lease.LEASE_NAME in stored(s3_env, run_uri)
        first.send_signal(signal.SIGUSR2)
        output = first.communicate(timeout=120)[0]
        assert first.returncode == ExitCode.STOPPED, output
    finally:
        first.kill()
    assert lease.LEASE_NAME not in stored(s3_env, run_uri)  # a run that stopped gives it back


@pytest.mark.s3
@pytest.mark.slow
def test_sharded_checkpoints_written_in_the_background_resume_from_s3(
    run_uri: str, s3_env: S3Server, tmp_path: Path, digits
) -> None:
    """train.parallelism fsdp with async_save on an s3:// checkpoint.dir: each rank uploads its own
    shards, USR2 stops the job once they are complete, and the job resumes from them and finishes;
    pruning removes the shards of old checkpoints."""
    spec_file = write_spec(
        tmp_path, digits, train={"epochs": 2, "parallelism": "fsdp"}, checkpoint={"dir": run_uri, "async_save": True}
    )
    spec = load_spec(spec_file).spec
    steps_per_epoch = loading.build_train_loader(spec.data, load_task(spec).decoder(train=True), 0, 2).steps_per_epoch
    interrupted = submit_local(spec_file)
    read_until(interrupted, f"step {steps_per_epoch + 5}/")
    interrupted.send_signal(signal.SIGUSR2)
    output = interrupted.communicate(timeout=120)[0]
    assert interrupted.returncode == ExitCode.STOPPED, output
    stopped = resuming.load_latest(open_store(run_uri))
    assert stopped is not None and stopped.shards is not None and stopped.state["mid_epoch"], output
    objects = stored(s3_env, run_uri)
    assert {f"{stopped.shards}/.metadata", f"{stopped.shards}/__0_0.distcp", f"{stopped.shards}/__1_0.distcp"} <= set(objects)
    assert not list(tmp_path.rglob("*.distcp"))  # nothing went to a local directory

    resumed = submit_local(spec_file)
    output = resumed.communicate(timeout=300)[0]
    assert resumed.returncode == 0, output
    assert f"resuming from {stopped.path} at step {stopped.step}" in output
    assert resuming.load_latest(open_store(run_uri)).step == 2 * steps_per_epoch
    steps = {name.split("/")[0].split(".")[0] for name in stored(s3_env, run_uri) if name.startswith("step-")}
    assert len(steps) == spec.checkpoint.keep, stored(s3_env, run_uri)
