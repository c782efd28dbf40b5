"""Faults of the store, through the fault-injecting proxy in front of the loopback S3 server
(moto): the proxy itself; the retry loop; an epoch read through 503s, resets, stalls and a burst
that outlasts Lance's own retries, with every row once and the retries counted; an outage longer
than data.io_timeout_s in a real 2-rank run, which stops both ranks with one message and exit 1
and leaves the checkpoint loadable; and a data file deleted or truncated, locally and on S3."""

from __future__ import annotations

import http.client
import multiprocessing
import os
import subprocess
import sys
import time
from multiprocessing.context import ForkServerProcess
from pathlib import Path

import boto3
import lance
import numpy as np
import pyarrow as pa
import pytest

from lance_hpc.checkpoint import resuming
from lance_hpc.checkpoint.stores import open_store
from lance_hpc.errors import UserError, worker_message
from lance_hpc.ingest import ensure_dataset
from lance_hpc.ingest.dataset import schema_for
from lance_hpc.loading import preflight
from lance_hpc.loading.workers import kill_workers
from lance_hpc.spec import DataSpec, IngestSpec, SpecError, validate_spec
from lance_hpc.storage.datasets import open_dataset
from lance_hpc.storage.integrity import DamagedDataset
from lance_hpc.storage.retry import StoreUnavailable, backoff_s, retrying, short_error
from tests.support.fault_proxy import FaultProxy, control
from tests.support.jobs import REPO_ROOT, Digits, write_spec
from tests.support.loaders import IMAGES, train_loader

LANCE_503 = (
    "LanceError(IO): Generic N/A error: LanceError(IO): Generic S3 error: Error performing GET "
    "http://127.0.0.1:9/b/x.lance/data/0101.lance in 2.1ms, after 3 retries, max_retries: 3, retry_timeout: 180s  - "
    'Server returned non-2xx status code: 503 Service Unavailable: <?xml version="1.0" encoding="UTF-8"?>\n'
    "<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>, "
    "/home/runner/work/lance/lance/rust/lance-io/src/object_reader.rs:335:56, /rustc/48a2/library/core/src/ops/function.rs:250:5"
)


# ---------------------------------------------------------------------------------------------
# the proxy


@pytest.fixture
def proxy(s3_server):
    with FaultProxy(s3_server.endpoint) as running:
        yield running


def request(proxy: FaultProxy, path: str = "/moto-api/", timeout: float = 30) -> tuple[int, bytes]:
    """One GET through the proxy (by default of moto's own page, which answers 200)."""
    host, port = proxy.server.server_address[:2]
    connection = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


@pytest.mark.s3
def test_proxy_passes_requests_through_and_injects_each_fault_on_command(proxy):
    assert request(proxy)[0] == 200  # moto's answer, relayed
    proxy.inject("slowdown", count=2)
    answers = [request(proxy) for _ in range(3)]
    assert [status for status, _ in answers] == [503, 503, 200]
    assert b"<Code>SlowDown</Code>" in answers[0][1]

    proxy.inject("reset", count=1)
    with pytest.raises((ConnectionResetError, http.client.RemoteDisconnected)):
        request(proxy)
    assert request(proxy)[0] == 200

    proxy.inject("stall", count=1, stall_s=1.0)
    started = time.monotonic()
    assert request(proxy)[0] == 200 and time.monotonic() - started >= 1.0

    proxy.inject("hang", seconds=1.0)
    started = time.monotonic()
    with pytest.raises((ConnectionResetError, http.client.RemoteDisconnected)):
        request(proxy)
    assert time.monotonic() - started >= 1.0
    assert request(proxy)[0] == 200  # the outage ended with its rule

    proxy.inject("refuse", seconds=60)
    with pytest.raises((ConnectionResetError, http.client.RemoteDisconnected, ConnectionAbortedError, BrokenPipeError)):
        request(proxy)
    proxy.clear()
    assert request(proxy)[0] == 200

    proxy.inject("slowdown", fraction=0.5, path="/only-here/")
    statuses = [request(proxy, "/only-here/x")[0] for _ in range(100)] + [request(proxy)[0] for _ in range(10)]
    assert 20 <= statuses[:100].count(503) <= 80 and statuses[100:] == [200] * 10
    stats = proxy.stats()
    assert stats["injected"] == {"slowdown": 2 + statuses.count(503), "reset": 1, "stall": 1, "hang": 1, "refuse": 1}
    assert stats["requests"] >= 118 and [rule["kind"] for rule in stats["rules"]] == ["slowdown"]


@pytest.mark.s3
def test_proxy_is_controlled_from_another_process(proxy):
    command = [sys.executable, "-m", "tests.support.fault_proxy"]
    subprocess.run(
        [*command, "inject", "--proxy", proxy.endpoint, "slowdown", "--count", "1"],
        check=True,
        cwd=REPO_ROOT,
        capture_output=True,
    )
    assert request(proxy)[0] == 503 and request(proxy)[0] == 200
    printed = subprocess.run(
        [*command, "stats", "--proxy", proxy.endpoint], check=True, cwd=REPO_ROOT, capture_output=True, text=True
    ).stdout
    assert '"slowdown": 1' in printed
    control(proxy.endpoint, "POST", {"kind": "slowdown"})
    assert request(proxy)[0] == 503
    assert control(proxy.endpoint, "DELETE")["rules"] == [] and request(proxy)[0] == 200
    with pytest.raises(Exception, match="400"):
        control(proxy.endpoint, "POST", {"kind": "meteor"})


# ---------------------------------------------------------------------------------------------
# the retry loop, without a store


def failing(errors: list[BaseException], result: str = "rows"):
    """A call that raises ``errors`` one per call, then returns ``result``."""
    calls = []

    def call() -> str:
        calls.append(time.monotonic())
        if len(calls) <= len(errors):
            raise errors[len(calls) - 1]
        return result

    return call, calls


def test_transient_errors_are_retried_with_growing_jittered_backoff_and_counted():
    call, calls = failing([OSError(LANCE_503), OSError("HTTP error: error sending request"), OSError("timed out")])
    sleeps, retries = [], []
    assert (
        retrying(
            call,
            what="take of 2 rows of s3://b/x.lance",
            uri="s3://b/x.lance",
            options={},
            timeout_s=300,
            on_retry=lambda: retries.append(1),
            sleep=sleeps.append,
        )
        == "rows"
    )
    assert len(calls) == 4 and len(retries) == 3 and len(sleeps) == 3
    for retry, slept in enumerate(sleeps):
        ceiling = min(15.0, 0.5 * 2**retry)
        assert ceiling / 2 <= slept <= ceiling
    assert len({backoff_s(3) for _ in range(20)}) > 1  # jitter: retries do not come back in step


def test_other_errors_are_not_retried_and_damage_goes_through_its_explanation():
    call, calls = failing([ValueError("column 'x' does not exist")])
    with pytest.raises(ValueError, match="does not exist"):
        retrying(call, what="take", uri="s3://b/x.lance", options={}, timeout_s=300, on_retry=lambda: None)
    assert len(calls) == 1
    call, calls = failing([OSError("LanceError(IO): Generic N/A error: Not found: /d/x.lance/data/ab.lance, /x.rs:3:5")])
    with pytest.raises(UserError, match="explained"):
        retrying(
            call,
            what="take",
            uri="/d/x.lance",
            options={},
            timeout_s=300,
            on_retry=lambda: None,
            explain=lambda error: UserError(f"explained: {error}"),
        )
    assert len(calls) == 1
    call, calls = failing([KeyError("unexplained")])
    with pytest.raises(KeyError, match="unexplained"):
        retrying(
            call, what="take", uri="/d/x.lance", options={}, timeout_s=300, on_retry=lambda: None, explain=lambda error: error
        )


def test_a_store_failing_past_the_timeout_stops_with_one_message_naming_endpoint_read_and_time():
    call, calls = failing([OSError(LANCE_503)] * 100)
    with pytest.raises(StoreUnavailable) as stopped:
        retrying(
            call,
            what="take of 64 rows of s3://b/x.lance",
            uri="s3://b/x.lance",
            options={"endpoint": "http://store:9000", "secret_access_key": "SECRET"},
            timeout_s=2,
            on_retry=lambda: None,
            rank=1,
        )
    message = str(stopped.value)
    assert message.startswith("rank 1: the object store at http://store:9000 failed for ")
    assert "data.io_timeout_s (2 s): take of 64 rows of s3://b/x.lance was tried " in message
    assert (
        (
            "last error: GET http://127.0.0.1:9/b/x.lance/data/0101.lance: Server returned non-2xx status code: "
            "503 Service Unavailable: SlowDown. Training stopped"
        )
        in message
        and "rust" not in message
        and "\n" not in message
    )
    assert "latest checkpoint is intact" in message and 2 <= len(calls) <= 10


def test_a_hung_read_is_abandoned_at_the_deadline():
    started = time.monotonic()
    with pytest.raises(StoreUnavailable, match="did not answer"):
        retrying(lambda: time.sleep(60), what="take", uri="s3://b/x.lance", options={}, timeout_s=1, on_retry=lambda: None)
    assert time.monotonic() - started < 30  # liveness: far below the hung call's 60 s


def test_messages_of_worker_exceptions_lose_the_traceback_torch_wraps_them_in():
    wrapped = (
        "Caught StoreUnavailable in DataLoader worker process 0.\nOriginal Traceback (most recent call last):\n"
        '  File "x.py", line 1, in <module>\nlance_hpc.data.retry.StoreUnavailable: rank 0: the store failed\n'
    )
    assert str(StoreUnavailable(wrapped)) == "rank 0: the store failed"
    assert worker_message("plain", "UserError") == "plain"
    assert str(DamagedDataset(wrapped.replace("StoreUnavailable", "DamagedDataset"))) == "rank 0: the store failed"
    assert short_error(OSError(LANCE_503)).endswith("503 Service Unavailable: SlowDown")


def test_io_timeout_must_end_before_the_collective_timeout():
    raw = {"name": "x", "data": {"uri": "/d.lance", "io_timeout_s": 170}, "train": {"collective_timeout_s": 180}}
    with pytest.raises(SpecError, match=r"data.io_timeout_s.*170 s leaves less than 30 s before train.collective_timeout_s"):
        validate_spec(raw)
    assert validate_spec({**raw, "data": {"uri": "/d.lance", "io_timeout_s": 150}}).spec.data.io_timeout_s == 150
    assert validate_spec({"name": "x", "data": {"uri": "/d.lance"}}).spec.data.io_timeout_s == 120


# ---------------------------------------------------------------------------------------------
# reading through the proxy


def write_rows(uri: str, fragments: int, rows: int, options: dict[str, str] | None = None) -> str:
    """A dataset of ``fragments`` fragments of ``rows`` rows whose label is the row id."""
    total = fragments * rows
    schema = schema_for([str(i) for i in range(total)], "test")
    for fragment in range(fragments):
        ids = np.arange(fragment * rows, (fragment + 1) * rows)
        batch = pa.record_batch(
            [pa.array([IMAGES[int(i) % len(IMAGES)] for i in ids], pa.binary()), pa.array(ids, pa.int64())], schema=schema
        )
        lance.write_dataset(
            pa.Table.from_batches([batch]), uri, mode="create" if fragment == 0 else "append", storage_options=options
        )
    return uri


def s3_options(server) -> dict[str, str]:
    return dict(server.storage_options, access_key_id=server.access_key_id, secret_access_key=server.secret_access_key)


@pytest.mark.s3
@pytest.mark.slow
def test_an_epoch_through_503s_resets_stalls_and_a_burst_reads_every_row_once(s3_env, proxy):
    uri = write_rows(s3_env.uri("faults_epoch.lance"), fragments=8, rows=25, options=s3_options(s3_env))
    # Lance's own retries turned off (object_store retries none, for at most 1 s) so a burst of seconds
    # reaches the batch retries here; the 503s and resets that Lance absorbs come through its read retries
    options = dict(s3_env.storage_options, endpoint=proxy.endpoint, client_max_retries="0", client_retry_timeout="1")
    data = DataSpec(uri=uri, storage_options=options, batch_size=20, num_workers=2, seed=1, io_timeout_s=120)
    loader = train_loader(data, 0, 1)
    # throughout: a few 503s and resets among the data reads, which Lance's own retries absorb
    proxy.inject("slowdown", fraction=0.05, path="/data/")
    proxy.inject("reset", fraction=0.05, path="/data/")
    proxy.inject("stall", count=2, stall_s=3, path="/data/")
    # and a burst: every data read fails for longer than Lance retries on its own. From the first
    # read on, since workers and read-ahead have most of an epoch this small in flight at once.
    proxy.inject("slowdown", seconds=6, path="/data/")
    labels = []
    try:
        for batch in loader:
            labels.extend(batch["label"].tolist())
            assert batch["row_id"].tolist() == batch["label"].tolist()
        retries = loader.stats.retries
    finally:
        loader = None  # its workers ignore SIGTERM: stop them now, not at interpreter exit
    injected = proxy.stats()["injected"]
    print(f"faults injected: {injected}; batch reads retried: {retries}")
    assert sorted(labels) == list(range(200)), "every row exactly once"
    assert injected["stall"] == 2 and injected["reset"] > 0 and injected["slowdown"] > 20
    assert retries >= 1, injected


@pytest.mark.s3
def test_opening_a_dataset_retries_and_a_store_that_hangs_stops_it_at_io_timeout(s3_env, proxy):
    options = dict(s3_options(s3_env), endpoint=proxy.endpoint)
    first = write_rows(s3_env.uri("faults_open_1.lance"), fragments=1, rows=5, options=s3_options(s3_env))
    second = write_rows(s3_env.uri("faults_open_2.lance"), fragments=1, rows=5, options=s3_options(s3_env))
    proxy.inject("slowdown", seconds=3)  # longer than Lance's own retries
    assert open_dataset(first, None, options, timeout_s=60).count_rows() == 5
    assert proxy.stats()["injected"]["slowdown"] > 0
    proxy.inject("hang")  # a dataset not opened before, so Lance has nothing of it cached
    started = time.monotonic()
    with pytest.raises(StoreUnavailable, match=rf"failed for \d+ s.*data.io_timeout_s \(2 s\): opening {second}"):
        open_dataset(second, None, options, timeout_s=2)
    assert time.monotonic() - started < 60


# ---------------------------------------------------------------------------------------------
# an outage in a real 2-rank run


@pytest.fixture
def s3_digits(s3_env) -> Digits:
    """The digits on the S3 server (1,438 train / 359 validation rows)."""
    digits = Digits(s3_env.uri("faults_digits_train.lance"), s3_env.uri("faults_digits_val.lance"))
    ingest = IngestSpec(source="sklearn-digits", val_fraction=0.2, rows_per_fragment=256, seed=0)
    ensure_dataset(DataSpec(uri=digits.train, val_uri=digits.val, storage_options=s3_env.storage_options, ingest=ingest))
    return digits


@pytest.mark.s3
@pytest.mark.slow
def test_an_outage_longer_than_io_timeout_stops_every_rank_with_one_message(s3_digits, s3_env, proxy, tmp_path):
    io_timeout_s = 5
    spec_file = write_spec(
        tmp_path,
        s3_digits,
        name="outage",
        data={
            "storage_options": dict(s3_env.storage_options, endpoint=proxy.endpoint),
            "num_workers": 1,
            "io_timeout_s": io_timeout_s,
            "sampler": "distributed",  # a read every batch (block would hold the digits' whole epoch already)
        },
        train={"epochs": 50},
        logging={"log_every_steps": 1, "progress": False},
        checkpoint={"every_steps": 5},
        slurm={"max_restarts": 0},  # one outage, one stop: a restart would wait out io_timeout_s again
    )
    job = subprocess.Popen(
        [sys.executable, "-m", "lance_hpc.submit", str(spec_file), "--local", "--nproc", "2"],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )
    lines = []
    try:
        for line in job.stdout:
            lines.append(line)
            if line.startswith("step 12/"):
                break
        proxy.inject("hang")  # from now on the store never answers
        outage = time.monotonic()
        try:
            rest = job.communicate(timeout=io_timeout_s + 60)[0]
        except subprocess.TimeoutExpired:
            job.kill()
            rest = job.communicate()[0]
    finally:
        job.kill()
    stopped_after = time.monotonic() - outage
    output = "".join(lines) + rest
    print(output[-3000:], f"\nstopped {stopped_after:.1f} s after the outage began")
    assert stopped_after < io_timeout_s + 60, output
    assert job.returncode == 1, output
    messages = [line for line in output.splitlines() if "failed for" in line and "data.io_timeout_s" in line]
    assert messages, output
    assert f"the object store at {proxy.endpoint} failed for" in messages[0]
    assert f"rows of {s3_digits.train} was tried" in messages[0] and f"data.io_timeout_s ({io_timeout_s} s)" in messages[0]
    assert "Traceback" not in output and "StoreUnavailable" not in output and "Caught " not in output
    latest = resuming.load_latest(open_store(tmp_path / "checkpoints"))
    assert latest is not None and latest.state["step"] >= 10 and "model" in latest.objects


# ---------------------------------------------------------------------------------------------
# a damaged dataset


def damage(uri: str, how: str, options: dict[str, str] | None = None) -> str:
    """Delete or truncate the data file of the dataset's second fragment; returns its path in the dataset."""
    dataset = lance.dataset(uri, storage_options=options)
    path = f"data/{dataset.get_fragments()[1].data_files()[0].path}"
    if uri.startswith("s3://"):
        bucket, key = uri.removeprefix("s3://").split("/", 1)
        client = boto3.client(
            "s3",
            endpoint_url=options["endpoint"],
            region_name=options["region"],
            aws_access_key_id=options["access_key_id"],
            aws_secret_access_key=options["secret_access_key"],
        )
        whole = client.get_object(Bucket=bucket, Key=f"{key}/{path}")["Body"].read()
        if how == "delete":
            client.delete_object(Bucket=bucket, Key=f"{key}/{path}")
        else:
            client.put_object(Bucket=bucket, Key=f"{key}/{path}", Body=whole[: len(whole) // 2])
    else:
        file = Path(uri) / path
        if how == "delete":
            file.unlink()
        else:
            file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    return path


def worker_processes() -> list[int]:
    """The pids of this process's DataLoader workers that are alive."""
    return [child.pid for child in multiprocessing.active_children() if isinstance(child, ForkServerProcess)]


def assert_damage_reported(data: DataSpec, path: str, how: str) -> None:
    expected = f"data file {path} of {data.uri} " + ("is missing" if how == "delete" else "has ")
    with pytest.raises(DamagedDataset) as at_preflight:
        preflight(data)
    before = set(worker_processes())
    loader = train_loader(data, 0, 1)
    try:
        with pytest.raises(DamagedDataset) as while_reading:  # raised in a worker, re-raised in this process
            for _ in loader:
                pass
        # The loader stopped its workers with the error: a program that goes on does not wait for
        # them (they ignore SIGTERM, so the DataLoader's own shutdown would take seconds per worker).
        assert set(worker_processes()) <= before
    finally:
        kill_workers()  # whatever the assertion found alive
        loader = None
    for error in (at_preflight.value, while_reading.value):
        message = str(error)
        assert message.startswith(expected), message
        assert "outside Lance" in message and "re-create the dataset" in message
        assert "Traceback" not in message and ".rs:" not in message


@pytest.mark.parametrize("how", ["delete", "truncate"])
def test_a_damaged_local_dataset_names_the_file(tmp_path, how):
    uri = write_rows(str(tmp_path / "damaged.lance"), fragments=4, rows=10)
    path = damage(uri, how)
    assert_damage_reported(DataSpec(uri=uri, batch_size=8, num_workers=1, shuffle=False), path, how)


@pytest.mark.s3
@pytest.mark.parametrize("how", ["delete", "truncate"])
def test_a_damaged_dataset_on_s3_names_the_file(s3_env, how):
    uri = write_rows(s3_env.uri(f"damaged_{how}.lance"), fragments=4, rows=10, options=s3_options(s3_env))
    path = damage(uri, how, s3_options(s3_env))
    data = DataSpec(uri=uri, storage_options=s3_env.storage_options, batch_size=8, num_workers=1, shuffle=False)
    assert_damage_reported(data, path, how)
