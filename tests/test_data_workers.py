"""DataLoader worker processes under what a SLURM job step does to them: SLURM's USR2 warning and
SIGTERM sent to every process of the step leave the workers serving batches (the rank process
checkpoints); a rank process that is SIGKILLed takes its worker server and workers with it; a
SIGKILLed worker ends the epoch with an error, not a hang. Also: the per-row ``__getitem__`` path
works inside a worker, and the image task gives the model and its batches the memory format it
asked for."""

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from lance_hpc.bench.resources import descendants
from lance_hpc.ingest.dataset import schema_for
from lance_hpc.loading import worker_context
from lance_hpc.loading.mapstyle import LanceMapDataset
from lance_hpc.loading.reader import BatchReader
from lance_hpc.tasks.base import ROW_ID, DatasetInfo
from lance_hpc.tasks.image import ImageClassification, ImageOptions
from tests.support.loaders import image_decoder, loader_on, workers_of, write_dataset

# How long processes may take to go after their rank process dies (torch's worker watchdog polls
# every few seconds); the test fails only if they never go.
GONE_WITHIN_S = 90


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("number", [signal.SIGUSR2, signal.SIGTERM])
def test_slurm_signals_to_every_process_of_the_step_leave_the_workers_serving(tmp_path, number):
    others = set(descendants(os.getpid()))  # this session's servers (moto's S3 server, say): not the step's
    loader = loader_on(tmp_path)
    batches = iter(loader)
    next(batches)
    received = []
    previous = signal.signal(number, lambda signum, frame: received.append(signum))
    try:
        # The worker server and the workers too. Not the resource tracker: a rank process starts it
        # inside worker_context, with these signals ignored, but this test process may have started
        # it earlier (it would be relaunched, with a warning).
        for pid in [os.getpid(), *descendants(os.getpid())]:
            if pid not in others and "resource_tracker" not in open(f"/proc/{pid}/cmdline").read():
                os.kill(pid, number)
        rest = sum(1 for _ in batches)
    finally:
        signal.signal(number, previous)
    assert received == [number] and rest == loader.steps_per_epoch - 1


def test_sigterm_sent_again_and_again_while_workers_start_ends_none_of_them(tmp_path):
    """torch's worker loop makes SIGTERM fatal before it runs the worker's init function, which
    ignores it: a SIGTERM sent to every process of the step in between ended a worker. The server
    starts its workers with the rank's signals blocked, so none arrives before the init runs."""
    others = set(descendants(os.getpid()))
    loaders = [loader_on(tmp_path / str(start)) for start in range(4)]
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)
    done = threading.Event()

    def storm():
        while not done.is_set():
            for pid in set(descendants(os.getpid())) - others:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGTERM)
            time.sleep(0.001)

    sender = threading.Thread(target=storm, daemon=True)
    sender.start()
    try:
        counts = [sum(1 for _ in loader) for loader in loaders]  # each starts its two workers
    finally:
        done.set()
        sender.join()
        signal.signal(signal.SIGTERM, previous)
    assert counts == [loader.steps_per_epoch for loader in loaders]


def test_a_killed_worker_stops_the_epoch_with_an_error_not_a_hang(tmp_path):
    loader = loader_on(tmp_path, num_workers=1)
    batches = iter(loader)
    next(batches)
    (worker,) = workers_of(os.getpid())
    os.kill(worker, signal.SIGKILL)
    with pytest.raises(RuntimeError, match="worker.* exited"):
        for _ in batches:
            pass


def test_a_killed_rank_process_takes_its_worker_server_and_workers_with_it(tmp_path):
    script = textwrap.dedent(f"""
        import os, sys, time
        sys.path.insert(0, {os.getcwd()!r})
        from tests.support.loaders import loader_on
        from pathlib import Path
        if __name__ == "__main__":
            loader = loader_on(Path({str(tmp_path)!r}))
            batches = iter(loader)
            next(batches)
            print("ready", flush=True)
            time.sleep(600)
    """)
    (tmp_path / "rank.py").write_text(script)
    rank = subprocess.Popen([sys.executable, str(tmp_path / "rank.py")], stdout=subprocess.PIPE, text=True)
    try:
        assert rank.stdout.readline().strip() == "ready"
        processes = descendants(rank.pid)
        assert workers_of(rank.pid) and len(processes) >= 3  # the server, two workers, the tracker
    finally:
        rank.kill()
        rank.wait()
    deadline = time.monotonic() + GONE_WITHIN_S
    while any(alive(pid) for pid in processes) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not [pid for pid in processes if alive(pid)]


def test_rows_by_index_work_inside_a_worker(tmp_path):
    uri = write_dataset(str(tmp_path / "d.lance"), [10])
    reader = BatchReader(uri, 1, {}, image_decoder(train=False, image_size=8), seed=0)
    dataset = LanceMapDataset(reader, 10)
    rows = DataLoader(dataset, batch_size=None, num_workers=1, multiprocessing_context=worker_context())
    got = list(rows)
    assert [int(row["label"]) for row in got] == list(range(10)) == [int(row[ROW_ID]) for row in got]
    assert all(row["image"].shape == (3, 8, 8) and row["image"].dtype == torch.uint8 for row in got)
    assert all(torch.equal(row["image"], dataset[index]["image"]) for index, row in enumerate(got))


@pytest.mark.parametrize(
    "device,channels_last,expected",
    [
        ("cpu", True, torch.contiguous_format),
        ("cpu", False, torch.contiguous_format),
    ],
)
def test_batches_reach_the_model_in_its_memory_format(device, channels_last, expected):
    info = DatasetInfo("memory://train.lance", schema_for(["a", "b"], "test"), 0)
    task = ImageClassification(ImageOptions(image_size=8, model="small_cnn", channels_last=channels_last), info)
    model = task.prepare_model(task.build_model(), torch.device(device))
    kernel = next(parameter for parameter in model.parameters() if parameter.dim() == 4)
    assert kernel.is_contiguous(memory_format=expected)
    images = torch.zeros(2, 8, 8, 3, dtype=torch.uint8).permute(0, 3, 1, 2)  # what the loaders deliver
    batch = {"image": images, "label": torch.zeros(2, dtype=torch.int64), ROW_ID: torch.arange(2)}
    moved = task.to_device(batch, torch.device(device))
    assert moved["image"].is_contiguous(memory_format=expected) and moved["image"].dtype == torch.float32
    assert moved["label"].dtype == torch.int64 and moved["label"].device.type == device
    assert np.allclose(moved["image"].numpy()[0, 0, 0, 0], (0 - 0.485) / 0.229)


def test_a_program_that_ends_with_its_loader_mid_epoch_exits_and_takes_the_workers_with_it(tmp_path):
    # Workers ignore SIGTERM, the signal multiprocessing's exit hook stops children with before it
    # joins them: without lance_hpc's own hook, this program would never exit.
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {os.getcwd()!r})
        from tests.support.loaders import loader_on
        from pathlib import Path
        if __name__ == "__main__":
            batches = iter(loader_on(Path({str(tmp_path)!r}) / sys.argv[1]))
            next(batches)
            import os
            from tests.support.loaders import workers_of
            print(*workers_of(os.getpid()), flush=True)
            if sys.argv[1] == "error":
                raise RuntimeError("the program fails")  # the loader still alive, held by a global

    """)
    (tmp_path / "ends.py").write_text(script)
    for how in ("end", "error"):
        ended = subprocess.run([sys.executable, str(tmp_path / "ends.py"), how], capture_output=True, text=True, timeout=300)
        assert ended.returncode == (0 if how == "end" else 1), ended.stderr
        workers = [int(pid) for pid in ended.stdout.split()]
        assert workers and not [pid for pid in workers if alive(pid)]


HEAD_START = textwrap.dedent(
    """
    import json, sys
    from multiprocessing import forkserver
    from lance_hpc.loading.worker_server import start_for_spec_file
    start_for_spec_file(sys.argv[1])
    server = forkserver._forkserver._forkserver_pid
    started = server is not None
    # forked from this process (its command line), not a fresh interpreter that imports it all again
    forked = not started or open(f"/proc/{server}/cmdline", "rb").read() == open("/proc/self/cmdline", "rb").read()
    if started:
        import os
        from torch.utils.data import DataLoader
        from lance_hpc.signals import WATCH_DIR_VARIABLE
        from lance_hpc.spec import DataSpec
        from lance_hpc.loading.workers import data_loader
        os.environ[WATCH_DIR_VARIABLE] = sys.argv[2]  # set after the server started, as a rank does
        loader = data_loader(list(range(4)), DataSpec(uri="/d", num_workers=1), False, False, batch_size=None)
        assert list(loader) == [0, 1, 2, 3]
    print(json.dumps([started, forked]))
    print(forkserver._forkserver._forkserver_pid)
    """
)


@pytest.mark.parametrize(
    "spec,starts",
    [
        ("job: infer\ndata: {uri: /d, num_workers: 2}\n", True),
        ("data: {uri: /d}\n", True),  # train, with the default workers
        ("job: infer\ndata: {uri: /d, num_workers: 0}\n", False),
        ("job: ingest\ndata: {uri: /d}\n", False),
        ("job: [unreadable\n", False),
    ],
)
def test_a_rank_forks_its_workers_server_from_itself_and_workers_find_the_rank_s_watch_dir(tmp_path, spec, starts):
    """``python -m lance_hpc.run`` forks the DataLoader workers' server from itself, as the spec
    says, before it reads any data: the server does not import torch and Lance again; a worker of a
    loader made later still gets the rank's watch dir (the server's environment is the one it
    started with), and writes its stacks' pid file there. The server ends with the rank."""
    (tmp_path / "spec.yaml").write_text(spec)
    watch = tmp_path / "watch"
    code = [sys.executable, "-c", HEAD_START, str(tmp_path / "spec.yaml"), str(watch)]
    done = subprocess.run(code, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[-3] == f"[{str(starts).lower()}, true]", done.stdout + done.stderr
    server = done.stdout.split("\n")[-2]
    assert not (server.isdigit() and alive(int(server)))  # the rank's exit took its server with it
    assert bool(list(watch.glob("stacks/rank-*-worker-0-*.pid"))) == starts
    assert "fork-safe" not in done.stderr  # the server imported Lance; its forks say nothing of it
