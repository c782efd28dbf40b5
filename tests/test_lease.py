"""One writer per checkpoint directory: the lease a run's rank 0 holds, on a local directory and on
the loopback S3 server. A live holder (this machine: its pid runs; another: a fresh heartbeat) makes
a second run refuse, naming it; a dead one is taken over with a message; a requeued SLURM job takes
its own lease back; of several runs racing for one directory, exactly one wins."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from lance_hpc.checkpoint import lease
from lance_hpc.checkpoint.stores import open_store
from lance_hpc.errors import UserError
from lance_hpc.slurm import queue
from tests.support.jobs import REPO_ROOT
from tests.support.s3 import S3Server
from tests.support.slurm_cluster import SlurmCluster


@pytest.fixture
def leases() -> Iterator[list[lease.Lease]]:
    """Leases a test took: released at its end, so no heartbeat thread outlives it."""
    taken: list[lease.Lease] = []
    yield taken
    for held in taken:
        held.release()


def take(directory: str | Path, me: lease.Holder, leases: list[lease.Lease]) -> tuple[lease.Lease, str | None]:
    held, note = lease.acquire(open_store(directory), me)
    leases.append(held)
    return held, note


def elsewhere(heartbeat_age_s: float, job: str | None = "4711") -> lease.Holder:
    """A holder on another machine whose last heartbeat is ``heartbeat_age_s`` old."""
    now = float(int(time.time()))  # as a lease file records it
    return lease.Holder(
        uuid.uuid4().hex,
        "node-elsewhere",
        "another-boot",
        4242,
        123,
        "ada",
        job,
        0,
        now - heartbeat_age_s - 60,
        now - heartbeat_age_s,
    )


def dead_pid() -> int:
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


def plant(directory: Path, holder: lease.Holder) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / lease.LEASE_NAME).write_bytes(holder.encode())


def test_a_second_run_refuses_naming_the_holder_and_the_lease_goes_at_release(tmp_path: Path, leases) -> None:
    directory = tmp_path / "checkpoints"
    held, note = take(directory, lease.this_process(None, 0), leases)
    assert note is None and lease.held(open_store(directory)) is held
    on_disk = lease.Holder.decode((directory / lease.LEASE_NAME).read_bytes())
    assert on_disk == held.holder and on_disk.pid == os.getpid() and on_disk.host == held.holder.host

    with pytest.raises(UserError) as refused:
        lease.acquire(open_store(directory), lease.this_process(None, 0))  # a second run on this machine, while the first lives
    message = str(refused.value)
    assert message.startswith(
        f"checkpoint.dir {directory} is in use by another run: pid {os.getpid()} on {held.holder.host}, a local run"
    )
    assert "fix: wait for that run to end" in message and "--set checkpoint.dir=" in message

    held.release()
    assert not (directory / lease.LEASE_NAME).exists() and lease.held(open_store(directory)) is None
    take(directory, lease.this_process(None, 0), leases)  # free again


def test_a_lease_whose_pid_is_gone_is_taken_over_with_a_message(tmp_path: Path, leases) -> None:
    me = lease.this_process(None, 0)
    gone = dataclasses.replace(me, token="gone", pid=dead_pid())
    plant(tmp_path, gone)
    held, note = take(tmp_path, me, leases)
    assert note.startswith(
        f"checkpoint.dir {tmp_path}: taking over the lease of a run that is gone "
        f"(pid {gone.pid} is no longer running on {me.host}); it was held by pid {gone.pid}"
    )
    assert lease.Holder.decode((tmp_path / lease.LEASE_NAME).read_bytes()).token == held.holder.token
    assert [path.name for path in tmp_path.iterdir()] == [lease.LEASE_NAME]  # the old lease is not left aside


def test_a_reused_pid_does_not_keep_a_dead_runs_lease(tmp_path: Path, leases) -> None:
    """The pid runs, but it is another process than the one that took the lease (pids are reused)."""
    me = lease.this_process(None, 0)
    plant(tmp_path, dataclasses.replace(me, token="earlier", pid_start=me.pid_start - 1))
    assert "is no longer running" in take(tmp_path, me, leases)[1]


def test_another_machines_lease_holds_while_its_heartbeat_is_fresh(tmp_path: Path, leases) -> None:
    plant(tmp_path, elsewhere(heartbeat_age_s=20))
    with pytest.raises(
        UserError,
        match="in use by another run: pid 4242 on node-elsewhere, SLURM job 4711, user ada, "
        r"since .* UTC, last heartbeat 2\d s ago\n",
    ) as refused:
        lease.acquire(open_store(tmp_path), lease.this_process(None, 0))
    assert "`lance-hpc cancel 4711` saves and stops it" in str(refused.value)

    plant(tmp_path, elsewhere(heartbeat_age_s=lease.STALE_AFTER_S + 60))
    held, note = take(tmp_path, lease.this_process(None, 0), leases)
    assert "taking over the lease of a run that is gone (no heartbeat for 6 min" in note
    assert "it was held by pid 4242 on node-elsewhere, SLURM job 4711" in note


@pytest.mark.slow
@pytest.mark.slurm
def test_a_lease_of_a_slurm_job_that_ended_is_taken_over_before_its_heartbeat_is_stale(
    slurm_cluster: SlurmCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, leases
) -> None:
    """A job cancelled with --now (or killed) leaves its lease behind with a fresh heartbeat; a job
    submitted right after it must not wait five minutes for it when SLURM says the job is over."""
    submitted = slurm_cluster.run(
        "sbatch", "--parsable", f"--partition={slurm_cluster.partition}", f"--output={tmp_path}/true-%j.out", "--wrap", "true"
    )
    job = submitted.stdout.strip().split(";")[0]
    for key, value in slurm_cluster.env.items():
        monkeypatch.setenv(key, value)
    deadline = time.monotonic() + 120
    while not ((shown := queue.show_job(job)) and shown.ended):
        assert time.monotonic() < deadline, f"job {job} did not end: {shown}"
        time.sleep(0.5)

    plant(tmp_path / "ended", elsewhere(heartbeat_age_s=5, job=job))
    held, note = take(tmp_path / "ended", lease.this_process(None, 0), leases)
    assert f"taking over the lease of a run that is gone (SLURM job {job} ended COMPLETED)" in note

    running = slurm_cluster.run(
        "sbatch",
        "--parsable",
        f"--partition={slurm_cluster.partition}",
        f"--output={tmp_path}/sleep-%j.out",
        "--wrap",
        "sleep 120",
    ).stdout.strip()
    try:
        plant(tmp_path / "running", elsewhere(heartbeat_age_s=5, job=running))
        with pytest.raises(UserError, match=f"in use by another run: pid 4242 on node-elsewhere, SLURM job {running}"):
            lease.acquire(open_store(tmp_path / "running"), lease.this_process(None, 0))
    finally:
        slurm_cluster.run("scancel", running, check=False)


def test_a_restart_inside_the_allocation_takes_its_jobs_lease_on_another_node_and_others_wait(tmp_path: Path, leases) -> None:
    """The restart supervisor starts an attempt only once the one before has ended, whose rank 0 may
    have held the lease on another node, its heartbeat still fresh."""
    plant(tmp_path, elsewhere(heartbeat_age_s=5, job="800"))  # attempt 1's rank 0, on node-elsewhere
    with pytest.raises(UserError, match="in use by another run: pid 4242 on node-elsewhere, SLURM job 800"):
        lease.acquire(open_store(tmp_path), lease.this_process("801", 0, attempt=1))  # another job's second attempt
    with pytest.raises(UserError, match="in use by another run: pid 4242 on node-elsewhere, SLURM job 800"):
        lease.acquire(open_store(tmp_path), lease.this_process("800", 0))  # the same attempt of the same job: a second srun
    held, note = take(tmp_path, lease.this_process("800", 0, attempt=1), leases)  # attempt 2, on this node
    assert note is None and held.holder.attempt == 1


def test_a_requeued_job_takes_its_own_lease_back_and_others_wait(tmp_path: Path, leases) -> None:
    first_run = elsewhere(heartbeat_age_s=5, job="800")  # SLURM ran the job's first run on another node
    plant(tmp_path, first_run)
    with pytest.raises(UserError, match="SLURM job 800"):
        lease.acquire(open_store(tmp_path), lease.this_process("801", 0))  # another job
    with pytest.raises(UserError, match="SLURM job 800"):
        lease.acquire(open_store(tmp_path), lease.this_process("800", 0))  # the same run of the same job: a second srun
    held, note = take(tmp_path, lease.this_process("800", 1), leases)  # its next run, after a requeue
    assert note is None

    held.keep()  # requeued again: the lease stays, marked, without a heartbeat
    kept = lease.Holder.decode((tmp_path / lease.LEASE_NAME).read_bytes())
    assert kept.requeued and kept.token == held.holder.token and lease.held(open_store(tmp_path)) is None
    with pytest.raises(UserError, match="SLURM job 800 \\(restart 1\\) requeued and waiting to run again"):
        lease.acquire(open_store(tmp_path), lease.this_process(None, 0))
    assert take(tmp_path, lease.this_process("800", 1), leases)[1] is None  # marked requeued: taken back at once


def test_a_requeued_job_keeps_its_lease_after_its_process_is_gone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, leases
) -> None:
    """On this machine the requeued run's pid is gone at once, so the pid cannot keep the lease: while
    SLURM does not say the job ended (here it cannot say anything: no SLURM configured), the mark and
    a fresh heartbeat do; the job's next run takes it back."""
    monkeypatch.delenv("SLURM_CONF", raising=False)
    me = lease.this_process(None, 0)
    requeued = dataclasses.replace(me, token="requeued", pid=dead_pid(), job="900", requeued=True)
    plant(tmp_path, requeued)
    for other in (lease.this_process(None, 0), lease.this_process("901", 0)):
        with pytest.raises(UserError) as refused:
            lease.acquire(open_store(tmp_path), other)
        message = str(refused.value)
        assert message.startswith(
            f"checkpoint.dir {tmp_path} is kept by a requeued job: pid {requeued.pid} on "
            f"{me.host}, SLURM job 900 requeued and waiting to run again"
        )
        assert "fix: let that job run again, or stop it for good with `lance-hpc cancel 900` (or `scancel 900`)" in message
    assert take(tmp_path, lease.this_process("900", 1), leases)[1] is None  # its next run


def test_a_requeued_job_slurm_does_not_know_loses_its_lease_once_its_heartbeat_is_stale(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, leases
) -> None:
    monkeypatch.delenv("SLURM_CONF", raising=False)
    plant(tmp_path, dataclasses.replace(elsewhere(heartbeat_age_s=lease.STALE_AFTER_S + 60, job="902"), requeued=True))
    held, note = take(tmp_path, lease.this_process(None, 0), leases)
    assert (
        "taking over the lease of a run that is gone (SLURM job 902 was requeued 6 min ago and SLURM no longer knows it" in note
    )


def test_release_does_not_hang_on_a_store_that_stopped_answering(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    held, _ = lease.acquire(open_store(tmp_path), lease.this_process(None, 0))
    answering, read = threading.Event(), held.store.read
    monkeypatch.setattr(held.store, "read", lambda: answering.wait() and read())  # an NFS server gone away
    monkeypatch.setattr(lease, "END_WAIT_S", 0.2)
    started = time.monotonic()
    try:
        held.release()
    finally:
        answering.set()
    assert time.monotonic() - started < 5 and lease.held(open_store(tmp_path)) is None
    assert "could not be released within 0 s" in capsys.readouterr().err


def test_an_unreadable_lease_holds_while_young_and_is_taken_over_when_old(tmp_path: Path, leases) -> None:
    path = tmp_path / lease.LEASE_NAME
    path.write_bytes(b"")  # what a taker has between its O_EXCL create and its write
    with pytest.raises(UserError, match=f"has a lease {path} that cannot be read.*\n  fix: start this run again"):
        lease.acquire(open_store(tmp_path), lease.this_process(None, 0))
    old = time.time() - lease.STALE_AFTER_S - 1
    os.utime(path, (old, old))
    assert "taking over the unreadable lease" in take(tmp_path, lease.this_process(None, 0), leases)[1]


def test_renewal_keeps_the_heartbeat_fresh_and_a_lost_lease_stops_the_writer(tmp_path: Path, leases) -> None:
    held, _ = take(tmp_path, lease.this_process(None, 0), leases)
    before = held.holder.heartbeat
    time.sleep(1.1)
    held.renew()
    assert lease.Holder.decode((tmp_path / lease.LEASE_NAME).read_bytes()).heartbeat > before
    held.confirm()

    usurper = elsewhere(heartbeat_age_s=0)
    plant(tmp_path, usurper)  # what a run that judged this one dead leaves
    held.renew()  # a renewal never writes over another run's lease
    assert lease.Holder.decode((tmp_path / lease.LEASE_NAME).read_bytes()) == usurper
    with pytest.raises(
        UserError,
        match="this run no longer holds its lease .another run took it over: pid 4242 on "
        "node-elsewhere.*it stops without writing",
    ):
        held.confirm()
    held.release()  # nor does a release delete it
    assert lease.Holder.decode((tmp_path / lease.LEASE_NAME).read_bytes()) == usurper


def test_a_directory_that_cannot_be_created_is_one_clear_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("a file where checkpoint.dir should be")
    with pytest.raises(UserError, match=f"cannot take the lease {blocker}/checkpoints/{lease.LEASE_NAME}: .*\n  fix: "):
        lease.acquire(open_store(blocker / "checkpoints"), lease.this_process(None, 0))


RACER = """
import sys, time
from lance_hpc.checkpoint import lease
from lance_hpc.checkpoint.stores import open_store
from lance_hpc.errors import UserError
from lance_hpc.slurm import queue
from tests.support.slurm_cluster import SlurmCluster
sys.stdout.write("ready\\n"); sys.stdout.flush()
sys.stdin.readline()  # all start at once
try:
    lease.acquire(open_store({directory!r}), lease.this_process(None, 0))
    print("won", flush=True)
except UserError as error:
    print("refused", str(error).splitlines()[0], flush=True)
sys.stdin.readline()  # alive (and holding) until every racer has tried
"""


@pytest.mark.slow
def test_of_several_processes_racing_for_a_stale_lease_exactly_one_wins(tmp_path: Path) -> None:
    directory = tmp_path / "checkpoints"
    plant(directory, dataclasses.replace(lease.this_process(None, 0), token="dead", pid=dead_pid()))
    racers = [
        subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(RACER.format(directory=str(directory)))],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=REPO_ROOT,
            env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        )
        for _ in range(6)
    ]
    try:
        for racer in racers:
            assert racer.stdout.readline().strip() == "ready"
        for racer in racers:
            racer.stdin.write("go\n")
            racer.stdin.flush()
        outcomes = [racer.stdout.readline().strip() for racer in racers]
    finally:
        for racer in racers:
            racer.communicate("done\n", timeout=30)
    winners = [index for index, outcome in enumerate(outcomes) if outcome == "won"]
    assert len(winners) == 1, outcomes
    winner_pid = racers[winners[0]].pid
    assert all(
        outcome.startswith(f"refused checkpoint.dir {directory} is in use by another run: pid {winner_pid} ")
        for index, outcome in enumerate(outcomes)
        if index != winners[0]
    ), outcomes
    assert sorted(path.name for path in directory.iterdir()) == [lease.LEASE_NAME]


@pytest.fixture
def s3_uri(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> str:
    for key, value in {**s3_server.env, "AWS_ENDPOINT_URL": s3_server.endpoint}.items():
        monkeypatch.setenv(key, value)
    return s3_server.uri(f"runs/{uuid.uuid4().hex[:8]}/")


@pytest.mark.s3
def test_on_s3_a_live_holder_refuses_and_a_dead_one_is_taken_over(s3_uri: str, leases) -> None:
    held, note = take(s3_uri, lease.this_process("900", 0), leases)
    assert note is None
    with pytest.raises(
        UserError, match=f"checkpoint.dir {s3_uri} is in use by another run: pid {os.getpid()} on .*SLURM job 900"
    ):
        lease.acquire(open_store(s3_uri), lease.this_process("901", 0))
    held.confirm()
    held.release()
    assert open_store(s3_uri).lease().read() is None

    store = open_store(s3_uri).lease()
    store._put(elsewhere(heartbeat_age_s=10).encode())
    with pytest.raises(UserError, match="in use by another run: pid 4242 on node-elsewhere"):
        lease.acquire(open_store(s3_uri), lease.this_process(None, 0))
    store._put(elsewhere(heartbeat_age_s=lease.STALE_AFTER_S + 1).encode())
    held, note = take(s3_uri, lease.this_process(None, 0), leases)
    assert "taking over the lease of a run that is gone (no heartbeat for" in note
    assert lease.Holder.decode(store.read().payload).token == held.holder.token


@pytest.mark.s3
def test_on_s3_of_several_runs_starting_at_once_exactly_one_wins(s3_uri: str, leases) -> None:
    """Runs on different machines (told apart by host name) that all find the prefix without a lease."""
    outcomes: dict[int, str] = {}

    def start(index: int) -> None:
        me = dataclasses.replace(lease.this_process(None, 0), host=f"node{index}")
        try:
            leases.append(lease.acquire(open_store(s3_uri), me)[0])
            outcomes[index] = "won"
        except UserError as error:
            outcomes[index] = str(error)

    racers = [threading.Thread(target=start, args=(index,)) for index in range(5)]
    for racer in racers:
        racer.start()
    for racer in racers:
        racer.join()
    winners = [index for index, outcome in outcomes.items() if outcome == "won"]
    assert len(winners) == 1, outcomes
    # Each loser is refused by the live lease it read. That is the winner's, or, for a loser that
    # read while another racer was still waiting out its own claim, that racer's: it names a run
    # that was starting on the directory then, even if that run lost too.
    racing = tuple(f"in use by another run: pid {os.getpid()} on node{index}," for index in range(5))
    assert all(any(named in outcome for named in racing) for index, outcome in outcomes.items() if index != winners[0]), outcomes
