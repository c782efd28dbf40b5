"""The node-local cache on real Lance datasets: rows read through it equal rows read from the store
(local and over the loopback S3 server), a filler killed mid-download leaves nothing a reader uses,
files are evicted least recently used beyond the size limit (never the manifest of a version in
use), a new version (or a dataset written again under the same version number) never gets another
version's bytes, and processes sharing one cache download each file once.

On a node shared by several users: each user's files live in a 0700 directory of their own,
eviction deletes nothing the cache did not write, no symlink is followed, a cached file of the
wrong size is fetched again, and a lock file that cannot be opened leaves its file uncached. A
manifest naming a data file under any name Lance does not write (``../../victim``) never makes the
cache write outside its root: those rows are read from the store, with one warning."""

import multiprocessing
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import lance
import numpy as np
import pyarrow as pa
import pytest

from lance_hpc.errors import UserError
from lance_hpc.spec import CacheSpec, SpecError, load_spec_text
from lance_hpc.storage.cache import files as cache_files
from lance_hpc.storage.cache import node_cache as cache
from lance_hpc.storage.cache.dirs import ROOT_MARKER, cache_root, user_directory
from lance_hpc.storage.cache.eviction import evict
from lance_hpc.storage.cache.files import (
    GIB,
    PARTIAL,
    CachedFile,
    Source,
    dataset_key,
    fetch,
    fragment_files,
    lock_path,
    manifest_names,
)
from lance_hpc.storage.cache.names import OutsideRoot
from lance_hpc.storage.cache.node_cache import NodeCache, open_cache
from lance_hpc.storage.datasets import ReadStats
from lance_hpc.storage.files import replaced_atomically
from lance_hpc.storage.options import storage_options
from tests.support.loaders import spec, train_loader, write_dataset

ROOT = Path(__file__).resolve().parent.parent
COLUMNS = ["x", "payload"]


def write(uri, fragments=4, rows=50, payload_bytes=1024, first=0, seed=0, options=None, mode="create"):
    """Fragments of ``rows`` rows; ``x`` counts from ``first``; ``payload`` is random (incompressible),
    so a data file is about rows * payload_bytes long. Row 3 of every fragment is deleted, so each
    fragment has a deletion file too."""
    rng = np.random.default_rng(seed)
    count = fragments * rows
    table = pa.table({"x": np.arange(first, first + count), "payload": [rng.bytes(payload_bytes) for _ in range(count)]})
    dataset = lance.write_dataset(table, uri, max_rows_per_file=rows, mode=mode, storage_options=options)
    dataset.delete(" OR ".join(f"x = {first + fragment * rows + 3}" for fragment in range(fragments)))
    return lance.dataset(uri, storage_options=options)


def node_cache(directory, dataset, uri=None, max_gb=1.0, options=None):
    return NodeCache(str(directory), max_gb, uri or dataset.uri, dataset.version, options or {}, dataset)


def take(node, dataset, ids):
    """Rows through the cache, with the store read for the rest, and the stats of that read."""
    stats = ReadStats()
    table = node.take(np.asarray(ids, dtype=np.int64), COLUMNS, stats, lambda rows: dataset.take(rows, columns=COLUMNS))
    return table, stats


def all_files(dataset):
    return {file.path for fragment in dataset.get_fragments() for file in fragment_files(fragment)}


def fragment_rows(dataset, index):
    """Row offsets of the ``index``-th fragment."""
    counts = [fragment.count_rows() for fragment in dataset.get_fragments()]
    start = sum(counts[:index])
    return np.arange(start, start + counts[index])


def test_rows_through_the_cache_equal_the_store_before_during_and_after_filling(tmp_path):
    dataset = write(str(tmp_path / "d.lance"))
    node = node_cache(tmp_path / "cache", dataset)
    rows = dataset.count_rows()
    batches = [np.sort(np.random.default_rng(seed).choice(rows, 40, replace=False)) for seed in range(6)]
    first, stats = take(node, dataset, batches[0])
    assert first.equals(dataset.take(batches[0], columns=COLUMNS))
    assert (stats.cache_hits, stats.cache_misses) == (0, 40)
    node.drain()
    assert sorted(node.fetched) == sorted(all_files(dataset))
    # half the fragments gone again: rows of both kinds in one batch, merged in row order
    for fragment in dataset.get_fragments()[::2]:
        for file in fragment_files(fragment):
            (node.root / file.path).unlink()
    node.complete.clear()
    mixed, stats = take(node, dataset, batches[1])
    assert mixed.equals(dataset.take(batches[1], columns=COLUMNS))
    assert stats.cache_hits > 0 and stats.cache_misses > 0
    node.drain()
    for ids in batches:
        table, stats = take(node, dataset, ids)
        assert table.equals(dataset.take(ids, columns=COLUMNS))
        assert (stats.cache_hits, stats.cache_misses) == (len(ids), 0)
    # the cache root is itself the dataset at this version
    assert lance.dataset(str(node.root), version=dataset.version).to_table().equals(dataset.to_table())
    node.close()


KILLED_FILLER = """
import sys, time
from pathlib import Path
from lance_hpc.storage.cache import files as cache_files
def one_chunk_then_hang(self, path):
    with self.filesystem.open_input_stream(f"{self.root}/{path}") as stream:
        yield stream.read(4096)
    Path(sys.argv[3]).write_text("started")
    time.sleep(600)
cache_files.Source.chunks = one_chunk_then_hang
cache_files.fetch(cache_files.Source(sys.argv[1], {}), Path(sys.argv[2]), cache_files.CachedFile(sys.argv[4]))
"""


def test_a_filler_killed_mid_download_leaves_no_file_a_reader_uses(tmp_path):
    dataset = write(str(tmp_path / "d.lance"), payload_bytes=4096)
    node = node_cache(tmp_path / "cache", dataset)
    victim = fragment_files(dataset.get_fragments()[1])[0]
    marker = tmp_path / "started"
    filler = subprocess.Popen(
        [sys.executable, "-c", KILLED_FILLER, dataset.uri, str(node.root), str(marker), victim.path], cwd=ROOT
    )
    try:
        deadline = time.monotonic() + 120
        while not marker.exists():
            assert filler.poll() is None, "the filler ended before downloading"
            assert time.monotonic() < deadline, "the filler never started downloading"
            time.sleep(0.05)
        final = node.root / victim.path
        assert not final.exists() and len(list(final.parent.glob(f"{final.name}.*{PARTIAL}"))) == 1
        # the filler holds the file's lock: nobody downloads it a second time meanwhile
        assert fetch(node.source, node.root, victim) is None
    finally:
        filler.send_signal(signal.SIGKILL)
        filler.wait()
    assert not final.exists()
    ids = fragment_rows(dataset, 1)
    table, stats = take(node, dataset, ids)
    assert table.equals(dataset.take(ids, columns=COLUMNS)) and stats.cache_misses == len(ids)
    node.drain()
    assert victim.path in node.fetched  # the next reader downloaded it again, whole
    assert final.read_bytes() == (Path(dataset.uri) / victim.path).read_bytes()
    assert not list(final.parent.glob(f"*{PARTIAL}"))
    table, stats = take(node, dataset, ids)
    assert table.equals(dataset.take(ids, columns=COLUMNS)) and stats.cache_hits == len(ids)
    node.close()


def test_a_download_shorter_than_the_manifest_says_is_never_renamed_into_place(tmp_path):
    dataset = write(str(tmp_path / "d.lance"))
    data_file = fragment_files(dataset.get_fragments()[0])[0]
    root = tmp_path / "cache" / "d"
    with pytest.raises(OSError, match="the manifest says"):
        fetch(Source(dataset.uri, {}), root, CachedFile(data_file.path, data_file.size + 1))
    assert not (root / data_file.path).exists() and not list((root / "data").glob("*"))


def cached_fragments(node, dataset):
    return [
        index
        for index, files in enumerate(map(fragment_files, dataset.get_fragments()))
        if files is not None and all((node.root / file.path).exists() for file in files)
    ]


def test_eviction_keeps_the_cache_under_its_limit_least_recently_used_first(tmp_path, monkeypatch):
    monkeypatch.setattr(cache, "TOUCH_INTERVAL_S", 0.0)
    dataset = write(str(tmp_path / "d.lance"))
    fragment_bytes = sum((Path(dataset.uri) / file.path).stat().st_size for file in fragment_files(dataset.get_fragments()[0]))
    limit = int(2.5 * fragment_bytes)  # two fragments and the manifest fit, three do not
    node = node_cache(tmp_path / "cache", dataset, max_gb=limit / GIB)

    def read(index):
        ids = fragment_rows(dataset, index)
        table, _ = take(node, dataset, ids)
        assert table.equals(dataset.take(ids, columns=COLUMNS))
        node.drain()

    read(0)
    read(1)
    assert cached_fragments(node, dataset) == [0, 1]
    for index, age_s in ((0, 2000), (1, 1000)):  # filled long ago, 0 first
        for file in fragment_files(dataset.get_fragments()[index]):
            os.utime(node.root / file.path, (time.time() - age_s, time.time() - age_s))
    read(0)  # 0 is now used more recently than 1
    read(2)
    assert cached_fragments(node, dataset) == [0, 2]
    read(1)
    assert cached_fragments(node, dataset) == [1, 2]
    total = sum(path.stat().st_size for path in node.root.rglob("*") if path.is_file() and ".locks" not in path.parts)
    assert total <= limit

    # deleted while known to be cached: its rows come from the store
    monkeypatch.setattr(cache, "TOUCH_INTERVAL_S", 3600.0)
    evict(node.directory, 0)
    assert cached_fragments(node, dataset) == []
    assert len(list((node.root / "_versions").glob("*.manifest"))) == 1  # in use: kept
    ids = np.concatenate([fragment_rows(dataset, 1), fragment_rows(dataset, 2)])
    table, stats = take(node, dataset, ids)
    assert table.equals(dataset.take(ids, columns=COLUMNS)) and stats.cache_misses == len(ids)
    node.close()
    evict(node.directory, 0)
    assert not list((node.root / "_versions").glob("*.manifest"))  # no longer in use


def test_a_new_version_never_reads_the_bytes_of_another(tmp_path):
    uri = str(tmp_path / "d.lance")
    first = write(uri)
    node_1 = node_cache(tmp_path / "cache", first)
    ids = np.arange(first.count_rows())
    take(node_1, first, ids)
    node_1.drain()

    lance.dataset(uri).update({"x": "x + 1000"}, where="x % 10 = 1")  # rewrites those rows, deletes the old ones
    second = lance.dataset(uri)
    assert second.version > first.version
    expected = second.take(ids, columns=COLUMNS)
    assert not expected.equals(first.take(ids, columns=COLUMNS))
    node_2 = node_cache(tmp_path / "cache", second)
    for _ in range(2):
        table, _ = take(node_2, second, ids)
        assert table.equals(expected)
        node_2.drain()
    assert take(node_2, second, ids)[1].cache_misses == 0
    table, stats = take(node_1, first, ids)  # the older version, still open, still its own rows
    assert table.equals(first.take(ids, columns=COLUMNS)) and stats.cache_misses == 0
    node_1.close()
    node_2.close()

    # deleted and written again: the same version number, other files and rows
    for path in sorted(Path(uri).rglob("*"), reverse=True):
        path.unlink() if path.is_file() else path.rmdir()
    again = write(uri, first=5000, seed=1)
    assert again.version == first.version
    node_again = node_cache(tmp_path / "cache", again)
    for _ in range(2):
        table, _ = take(node_again, again, ids)
        assert table.equals(again.take(ids, columns=COLUMNS))
        node_again.drain()
    assert take(node_again, again, ids)[1].cache_misses == 0
    node_again.close()


def share_one_cache(uri, directory, barrier, results):
    """One of two processes: read every row (same order as the other, so they race for the same
    files) with small chunks (slow downloads), then read again; report what it downloaded."""
    cache_files.CHUNK_BYTES = 2048
    dataset = lance.dataset(uri)
    node = node_cache(directory, dataset)
    barrier.wait()
    rows = dataset.count_rows()
    for start in range(0, rows, 16):
        take(node, dataset, np.arange(start, min(start + 16, rows)))
    node.drain()
    while set(cached_fragments(node, dataset)) != set(range(len(dataset.get_fragments()))):
        time.sleep(0.05)  # files the other process was fetching
    _, again = take(node, dataset, np.arange(rows))
    results.put((node.fetched, again.cache_hits, again.cache_misses))
    node.close()


def test_two_processes_share_one_cache_and_download_each_file_once(tmp_path):
    dataset = write(str(tmp_path / "d.lance"), fragments=6)
    context = multiprocessing.get_context("spawn")
    barrier, results = context.Barrier(2), context.Queue()
    processes = [
        context.Process(target=share_one_cache, args=(dataset.uri, str(tmp_path / "cache"), barrier, results)) for _ in range(2)
    ]
    for process in processes:
        process.start()
    reports = [results.get(timeout=300) for _ in processes]
    for process in processes:
        process.join(timeout=60)
        assert process.exitcode == 0
    downloaded = [path for fetched, _, _ in reports for path in fetched]
    assert sorted(downloaded) == sorted(all_files(dataset))  # every file once, over both processes
    assert [(hits, misses) for _, hits, misses in reports] == [(dataset.count_rows(), 0)] * 2


def test_the_train_loader_reads_the_same_batches_through_the_cache_and_counts_hits(tmp_path):
    uri = write_dataset(str(tmp_path / "photos.lance"), [25] * 4 + [7])
    directory = str(tmp_path / "cache")
    plain = train_loader(spec(uri), 0, 1)
    cached = train_loader(spec(uri, cache=CacheSpec(dir=directory, max_gb=1.0)), 0, 1)
    plain.set_epoch(0)
    cached.set_epoch(0)
    labels = [b["label"].tolist() for b in plain]
    assert labels == [b["label"].tolist() for b in cached]
    rows = sum(len(batch) for batch in labels)
    hits, misses = cached.stats.cache_hits, cached.stats.cache_misses  # fills run behind the first reads
    assert hits + misses == rows and misses > 0
    dataset = lance.dataset(uri)
    open_cache(directory, 1.0, uri, dataset.version, {}, lambda: dataset).drain()  # this process's cache
    plain.set_epoch(1)
    cached.set_epoch(1)
    assert [b["label"].tolist() for b in plain] == [b["label"].tolist() for b in cached]
    assert (cached.stats.cache_hits - hits, cached.stats.cache_misses - misses) == (rows, 0)


@pytest.mark.slow
def test_loader_workers_fill_and_read_the_cache(tmp_path):
    uri = write_dataset(str(tmp_path / "photos.lance"), [25] * 4 + [7])
    dataset = lance.dataset(uri)
    directory = tmp_path / "cache"
    loader = train_loader(spec(uri, num_workers=1, cache=CacheSpec(dir=str(directory), max_gb=1.0)), 0, 1)
    plain = train_loader(spec(uri), 0, 1)
    loader.set_epoch(0)
    plain.set_epoch(0)
    labels = [b["label"].tolist() for b in plain]
    assert [b["label"].tolist() for b in loader] == labels
    node = open_cache(str(directory), 1.0, uri, dataset.version, {}, lambda: dataset)  # only to look
    deadline = time.monotonic() + 120
    while len(cached_fragments(node, dataset)) < 5:  # the worker's fetches end after its last batch
        assert time.monotonic() < deadline, "the worker never cached every fragment"
        time.sleep(0.1)
    before = loader.stats.cache_hits
    loader.set_epoch(1)
    plain.set_epoch(1)
    assert [b["label"].tolist() for b in loader] == [b["label"].tolist() for b in plain]
    assert loader.stats.cache_hits - before == sum(len(batch) for batch in labels)


@pytest.mark.s3
def test_rows_through_the_cache_equal_the_store_over_s3(s3_server, monkeypatch, tmp_path):
    for key, value in s3_server.env.items():
        monkeypatch.setenv(key, value)
    uri = s3_server.uri("cached.lance")
    options = storage_options(uri, s3_server.storage_options)
    dataset = write(uri, options=options)
    node = node_cache(tmp_path / "cache", dataset, uri=uri, options=options)
    ids = np.sort(np.random.default_rng(0).choice(dataset.count_rows(), 60, replace=False))
    table, stats = take(node, dataset, ids)
    assert table.equals(dataset.take(ids, columns=COLUMNS)) and stats.cache_misses == 60
    node.drain()
    assert sorted(node.fetched) == sorted(all_files(dataset))
    table, stats = take(node, dataset, ids)
    assert table.equals(dataset.take(ids, columns=COLUMNS)) and stats.cache_hits == 60
    for file in node.fetched:
        assert os.path.getsize(node.root / file) == len(
            node.source.filesystem.open_input_stream(f"{node.source.root}/{file}").read()
        )
    node.close()


def test_the_cache_section_is_checked_with_yaml_paths():
    text = "name: x\ndata: {uri: /tmp/x.lance, cache: {dir: %s, max_gb: %s}}\n"
    with pytest.raises(SpecError) as error:
        load_spec_text(text % ("relative/cache", "0"), "job.yaml")
    message = str(error.value)
    assert "data.cache.dir: 'relative/cache' is not an absolute local path" in message
    assert "data.cache.max_gb: must be > 0" in message
    with pytest.raises(SpecError, match="data.cache.dir: 's3://b/c' is not an absolute local path"):
        load_spec_text(text % ("s3://b/c", "1"), "job.yaml")
    loaded = load_spec_text(text % ("$TMPDIR/lance-cache", "2.5"), "job.yaml").spec
    assert loaded.data.cache == CacheSpec(dir="$TMPDIR/lance-cache", max_gb=2.5)


def drained(node, timeout_s=120.0):
    """Wait for the node's fetches like ``node.drain()``, but fail instead of hanging when the fill
    thread has died with jobs left."""
    deadline = time.monotonic() + timeout_s
    while node.todo.unfinished_tasks:
        assert time.monotonic() < deadline, "the fill thread stopped with fetches left"
        time.sleep(0.02)


def read_everything(node, dataset, batch=16):
    """Every row through the cache, in batches, checked against the store."""
    rows = dataset.count_rows()
    for start in range(0, rows, batch):
        ids = np.arange(start, min(start + batch, rows))
        table, _ = take(node, dataset, ids)
        assert table.equals(dataset.take(ids, columns=COLUMNS))


def snapshot(*directories):
    """Every file under ``directories`` (symlinks followed, so what a link points to counts too)
    with its bytes."""
    found = {}
    for directory in directories:
        for parent, _, names in os.walk(directory, followlinks=True):
            for name in names:
                path = Path(parent, name)
                found[str(path)] = path.read_bytes()
    return found


@pytest.mark.parametrize("store", ["local", pytest.param("s3", marks=pytest.mark.s3)])
def test_eviction_in_a_shared_directory_deletes_only_what_the_cache_wrote(store, request, monkeypatch, tmp_path):
    if store == "s3":
        server = request.getfixturevalue("s3_server")
        for key, value in server.env.items():
            monkeypatch.setenv(key, value)
        uri = server.uri(f"evicted-{os.getpid()}-{time.time_ns()}.lance")
        options = storage_options(uri, server.storage_options)
    else:
        uri, options = str(tmp_path / "store" / "d.lance"), {}
    dataset = write(uri, fragments=8, rows=10, payload_bytes=20_000, options=options)  # ~200 KB a fragment
    shared, elsewhere = tmp_path / "shared", tmp_path / "elsewhere"
    write(str(shared / "neighbour.lance"), seed=1)  # another user's dataset beside the cache
    (shared / "project" / "data").mkdir(parents=True)
    (shared / "project" / "data" / "results.csv").write_text("epoch,loss\n0,2.3\n")
    write(str(elsewhere / "linked.lance"), seed=2)
    (shared / "linked").symlink_to(elsewhere)
    before = snapshot(shared, elsewhere)
    max_gb = 0.0005  # ~537 KB: two fragments fit, the dataset does not
    node = node_cache(shared, dataset, uri=uri, max_gb=max_gb, options=options)
    # a link under the cache's own names, inside its own root: neither it nor its target is deleted
    (node.root / "data").mkdir(exist_ok=True)
    (node.root / "data" / "linked.lance").symlink_to(elsewhere / "linked.lance" / "_versions")
    for _ in range(3):
        read_everything(node, dataset)
        drained(node)
    assert node.fetched_bytes > max_gb * GIB  # eviction ran, more than once
    assert snapshot(shared / "neighbour.lance", shared / "project", shared / "linked", elsewhere) == before
    assert sorted(path.name for path in shared.iterdir()) == sorted(["neighbour.lance", "project", "linked", node.directory.name])
    assert (node.root / "data" / "linked.lance").is_symlink()
    cached = sum(
        path.stat().st_size
        for path in node.root.rglob("*")
        if path.is_file() and not path.is_symlink() and ".locks" not in path.parts
    )
    assert cached <= max_gb * GIB
    node.close()


def test_each_user_gets_a_directory_only_they_can_read_whatever_the_umask(tmp_path):
    dataset = write(str(tmp_path / "d.lance"))
    previous = os.umask(0o002)
    try:
        node = node_cache(tmp_path / "cache", dataset)
        read_everything(node, dataset)
        drained(node)
    finally:
        os.umask(previous)
    assert node.directory == tmp_path / "cache" / f"lance_hpc-{os.geteuid()}"
    info = os.lstat(node.directory)
    assert (stat.S_IMODE(info.st_mode), info.st_uid) == (0o700, os.geteuid())
    files = [path for path in node.directory.rglob("*") if path.is_file()]
    assert len(files) > len(all_files(dataset))  # data, deletions, manifest, locks, the marker
    assert {oct(stat.S_IMODE(path.stat().st_mode)) for path in files} == {oct(0o600)}
    node.close()


@pytest.mark.parametrize(
    "problem, message",
    [
        pytest.param(
            "foreign",
            r"belongs to uid 4242, not to you",
            marks=pytest.mark.skipif(os.geteuid() != 0, reason="giving a directory to another user needs root"),
        ),
        ("world-writable", r"is open to other users \(mode drwxrwxrwx\).*run chmod 700"),
        ("group-readable", r"is open to other users \(mode drwxr-x---\).*run chmod 700"),
        ("symlink", r"is not a directory \(a symlink or a file\)"),
    ],
)
def test_a_user_directory_that_is_not_safely_theirs_is_refused(problem, message, tmp_path):
    dataset = write(str(tmp_path / "d.lance"))
    mine = tmp_path / "cache" / f"lance_hpc-{os.geteuid()}"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    if problem == "symlink":
        mine.parent.mkdir()
        mine.symlink_to(elsewhere)
    else:
        mine.mkdir(parents=True)
        os.chmod(mine, {"foreign": 0o700, "world-writable": 0o777, "group-readable": 0o750}[problem])
        if problem == "foreign":
            os.chown(mine, 4242, 4242)
    with pytest.raises(UserError, match=message) as error:
        open_cache(str(tmp_path / "cache"), 1.0, dataset.uri, dataset.version, {}, lambda: dataset)
    assert "data.cache.dir" in str(error.value)
    assert not list(elsewhere.iterdir()) and not list(mine.iterdir())


def test_a_missing_shared_directory_is_made_sticky_and_open_to_every_user_whatever_the_umask(tmp_path):
    previous = os.umask(0o077)
    try:
        mine = user_directory(tmp_path / "scratch" / "cache")
    finally:
        os.umask(previous)
    assert stat.S_IMODE(os.stat(tmp_path / "scratch" / "cache").st_mode) == 0o1777
    assert stat.S_IMODE(os.lstat(mine).st_mode) == 0o700


@pytest.mark.parametrize("mode", [0o777, 0o775])
def test_a_shared_directory_others_may_write_without_the_sticky_bit_is_refused(mode, tmp_path):
    shared = tmp_path / "cache"
    shared.mkdir()
    os.chmod(shared, mode)
    with pytest.raises(
        UserError,
        match=rf"{shared} is writable by other users without the sticky bit.*"
        rf"\n  fix: have its owner run chmod \+t {shared}",
    ):
        user_directory(shared)
    assert not list(shared.iterdir())
    os.chmod(shared, mode | stat.S_ISVTX)
    assert user_directory(shared) == shared / f"lance_hpc-{os.geteuid()}"


def test_a_shared_directory_this_user_cannot_write_is_a_user_error(tmp_path, monkeypatch):
    shared = tmp_path / "cache"
    shared.mkdir(mode=0o755)
    real_mkdir = os.mkdir

    def refused(path, *args, **kwargs):  # as for a user who is not root and does not own the directory
        if Path(path).parent == shared:
            raise PermissionError(13, "Permission denied", str(path))
        return real_mkdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", refused)
    with pytest.raises(
        UserError,
        match=rf"cannot create your cache directory .*: {shared} is not writable by you"
        rf".*\n  fix: have its owner run chmod 1777 {shared}",
    ):
        user_directory(shared)
    # A directory this user made there before is used as it is.
    real_mkdir(shared / f"lance_hpc-{os.geteuid()}", 0o700)
    assert user_directory(shared) == shared / f"lance_hpc-{os.geteuid()}"


@pytest.mark.parametrize("exclusive", [False, True])
def test_a_symlink_planted_at_a_temporary_path_is_not_followed(exclusive, tmp_path):
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    temp, final = tmp_path / "file.partial", tmp_path / "file"
    temp.symlink_to(victim)
    with pytest.raises(OSError):
        with replaced_atomically(final, temp, mode=0o600, exclusive=exclusive) as out:
            out.write(b"overwritten")
    assert victim.read_bytes() == b"precious" and temp.is_symlink() and not final.exists()


def test_a_file_planted_at_a_cached_path_is_replaced_and_its_target_left_alone(tmp_path):
    dataset = write(str(tmp_path / "d.lance"))
    node = node_cache(tmp_path / "cache", dataset)
    data_file = fragment_files(dataset.get_fragments()[1])[0]
    victim = tmp_path / "victim"
    victim.write_bytes(os.urandom(data_file.size))  # the right size, other bytes
    before = victim.read_bytes()
    (node.root / "data").mkdir(exist_ok=True)
    (node.root / data_file.path).symlink_to(victim)
    ids = fragment_rows(dataset, 1)
    for _ in range(2):
        table, _ = take(node, dataset, ids)
        assert table.equals(dataset.take(ids, columns=COLUMNS))
        drained(node)
    assert victim.read_bytes() == before
    assert not (node.root / data_file.path).is_symlink()
    assert (node.root / data_file.path).read_bytes() == (Path(dataset.uri) / data_file.path).read_bytes()
    node.close()


def test_a_truncated_cached_file_is_fetched_again(tmp_path):
    dataset = write(str(tmp_path / "d.lance"))
    node = node_cache(tmp_path / "cache", dataset)
    read_everything(node, dataset)
    drained(node)
    node.close()
    data_file = fragment_files(dataset.get_fragments()[1])[0]
    manifest = next(name for name in manifest_names(dataset.version) if (node.root / name).exists())
    for path in (node.root / data_file.path, node.root / manifest):
        os.truncate(path, path.stat().st_size // 2)
    again = node_cache(tmp_path / "cache", dataset)  # a later process: nothing known yet
    ids = fragment_rows(dataset, 1)
    table, stats = take(again, dataset, ids)
    assert table.equals(dataset.take(ids, columns=COLUMNS)) and stats.cache_misses == len(ids)
    drained(again)
    assert again.fetched == [data_file.path]
    for name in (data_file.path, manifest):
        assert (again.root / name).read_bytes() == (Path(dataset.uri) / name).read_bytes()
    table, stats = take(again, dataset, ids)
    assert table.equals(dataset.take(ids, columns=COLUMNS)) and stats.cache_hits == len(ids)
    again.close()


@pytest.mark.parametrize("lock", ["fill", "use", "evict"])
@pytest.mark.parametrize("planted", ["dangling symlink", "directory"])
def test_a_lock_file_that_cannot_be_opened_warns_once_and_rows_come_from_the_store(lock, planted, tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(cache, "RETRY_FETCH_S", 0.0)  # ask for the fragment again at every batch
    dataset = write(str(tmp_path / "d.lance"))
    directory = tmp_path / "cache"
    mine = user_directory(directory)
    root = cache_root(mine, dataset_key(dataset.uri, {}), dataset.uri)
    blocked = fragment_files(dataset.get_fragments()[1])[0]
    manifest = next(name for name in manifest_names(dataset.version) if (Path(dataset.uri) / name).exists())
    path = {
        "fill": lock_path(root, blocked.path, "fill"),
        "use": lock_path(root, manifest, "use"),
        "evict": mine / ".evict.lock",
    }[lock]
    path.parent.mkdir(parents=True, exist_ok=True)
    target = tmp_path / "elsewhere" / "created-through-the-link"
    if planted == "directory":
        path.mkdir()
    else:
        target.parent.mkdir()
        path.symlink_to(target)
    with caplog.at_level("WARNING", logger="lance_hpc.data"):
        node = node_cache(directory, dataset)
        for _ in range(3):
            read_everything(node, dataset)
            drained(node)
    assert not target.exists()
    assert len([record for record in caplog.records if str(path) in record.getMessage()]) == 1
    everything = set(range(len(dataset.get_fragments())))
    expected = {"fill": everything - {1}, "use": set(), "evict": everything}[lock]
    assert set(cached_fragments(node, dataset)) == expected
    ids = np.arange(dataset.count_rows())
    table, stats = take(node, dataset, ids)
    assert table.equals(dataset.take(ids, columns=COLUMNS))
    assert stats.cache_hits == sum(len(fragment_rows(dataset, index)) for index in expected)
    node.close()


ESCAPING_NAME = "../../../../victim/file"  # from <root>/data/: three levels above the root


def craft_escaping_version(uri):
    """Commit a version of ``uri`` whose first fragment names its data file ``ESCAPING_NAME``, as
    a dataset's author could: the bytes lie both where Lance reads that name (escaped, inside
    ``data/``) and where a path joined from it without checking leads, three levels above the
    dataset. Returns where the latter is."""
    dataset = lance.dataset(uri)
    fragments = [fragment.metadata for fragment in dataset.get_fragments()]
    honest = fragments[0].files[0]
    data = Path(uri) / "data"
    escaped = data / ESCAPING_NAME.replace("/", "%2F")  # the name Lance reads
    joined = Path(os.path.normpath(data / ESCAPING_NAME))  # the name a plain join reaches
    joined.parent.mkdir(parents=True)
    for copy in (escaped, joined):
        copy.write_bytes((data / honest.path).read_bytes())
    fragments[0].files[0] = lance.fragment.DataFile(
        ESCAPING_NAME,
        honest.fields,
        honest.column_indices,
        honest.file_major_version,
        honest.file_minor_version,
        honest.file_size_bytes,
    )
    operation = lance.LanceOperation.Overwrite(dataset.schema, fragments)
    lance.LanceDataset.commit(uri, operation, read_version=dataset.version)
    return joined


def test_a_manifest_naming_a_data_file_outside_the_dataset_never_makes_the_cache_write_outside(tmp_path, caplog):
    uri = write_dataset(str(tmp_path / "a" / "b" / "c" / "photos.lance"), [25] * 4)
    planted = craft_escaping_version(uri)
    directory = tmp_path / "cache"
    # where <dir>/lance_hpc-<uid>/<key>/data/ESCAPING_NAME leads: the reading user's ~/.bashrc, say
    victim = Path(os.path.normpath(directory / "lance_hpc-uid" / "key" / "data" / ESCAPING_NAME))
    victim.parent.mkdir(parents=True)
    victim.write_bytes(b"the user's own file\n")
    outside = [path for path in tmp_path.iterdir() if path != directory]
    before = snapshot(*outside)
    plain = train_loader(spec(uri), 0, 1)
    cached = train_loader(spec(uri, cache=CacheSpec(dir=str(directory), max_gb=1.0)), 0, 1)
    dataset = lance.dataset(uri)
    with caplog.at_level("WARNING", logger="lance_hpc.data"):
        for epoch in range(2):
            plain.set_epoch(epoch)
            cached.set_epoch(epoch)
            labels = [b["label"].tolist() for b in plain]
            assert [b["label"].tolist() for b in cached] == labels, "rows differ through the cache"
            drained(open_cache(str(directory), 1.0, uri, dataset.version, {}, lambda: dataset))  # this process's
    assert victim.read_bytes() == b"the user's own file\n", f"the cache wrote over {victim}"
    assert snapshot(*outside) == before, "the cache changed files outside its directory"
    node = open_cache(str(directory), 1.0, uri, dataset.version, {}, lambda: dataset)
    assert node.files[0] is None and set(cached_fragments(node, dataset)) == {1, 2, 3}
    rows_of_the_first = len(fragment_rows(dataset, 0))
    assert cached.stats.cache_misses >= 2 * rows_of_the_first  # read from the store in both epochs
    warnings = [record.getMessage() for record in caplog.records if ESCAPING_NAME in record.getMessage()]
    assert len(warnings) == 1 and uri in warnings[0], f"warnings naming the data file: {warnings}"
    assert planted.exists()


@pytest.mark.parametrize(
    "name",
    [
        "data/../../../victim.lance",
        "data/../data/x.lance",
        "/etc/victim.lance",
        "data//x.lance",
        "data/sub/x.lance",
        "data/.lance",
        "data/x.lance/",
        "data/x.lance\n",
        "data/ｘ.lance",  # a fullwidth letter: Lance writes only ASCII names
        "data/x.partial",
        "_versions/../../1.manifest",
        "_deletions/1-2-3.arrow/..",
        ".locks/data%x.lance.fill",
        "x.lance",
    ],
)
def test_fetch_refuses_a_name_lance_does_not_write(name, tmp_path):
    root = cache_root(user_directory(tmp_path / "cache"), "key", "uri")
    store = tmp_path / "store"
    (store / "data").mkdir(parents=True)
    with pytest.raises(OutsideRoot):
        fetch(Source(str(store), {}), root, CachedFile(name))
    written = [str(path) for path in tmp_path.rglob("*") if path.is_file() and path.name != ROOT_MARKER]
    assert written == [], f"a refused name still wrote {written}"


def test_fetch_refuses_a_directory_of_the_root_that_leads_outside_it(tmp_path):
    dataset = write(str(tmp_path / "d.lance"))
    root = cache_root(user_directory(tmp_path / "cache"), "key", dataset.uri)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (root / "data").symlink_to(elsewhere)  # made by hand: the cache never makes one
    data_file = fragment_files(dataset.get_fragments()[0])[0]
    with pytest.raises(OutsideRoot, match="resolves outside the cache root"):
        fetch(Source(dataset.uri, {}), root, data_file)
    assert list(elsewhere.iterdir()) == []
