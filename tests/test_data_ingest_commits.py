"""Ingest commits a rerun can trust: the real command killed between the commits of its splits,
then run again, commits only what is missing (every row exactly once in each split); a record
whose dataset was deleted does not count, and the run starts over."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import lance
import pytest

from lance_hpc.cli.ingest import main as ingest_main
from lance_hpc.ingest.plan import make_plan
from lance_hpc.ingest.shards import split_of
from lance_hpc.ingest.target import COMMAND_LINE_NAMES, targets
from lance_hpc.ingest.write import run_worker
from tests.support.crash import CRASHED
from tests.support.shards import digit_rows, ingest_job_spec, write_webdataset

ROOT = Path(__file__).resolve().parents[1]
FRACTION = 0.3
ROWS = digit_rows(40)


def ingest(*args: object) -> int:
    return ingest_main([str(arg) for arg in args])


def ingest_killed_at(point: str, *args: object) -> subprocess.CompletedProcess[str]:
    """The real ingest command in its own process, killed at ``point`` (tests/support/crash.py)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    command = [sys.executable, "-m", "tests.support.crash", point, "--", *map(str, args)]
    return subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env)


def assert_every_row_once(train: Path, val: Path, ids: list[str]) -> None:
    """Each split holds each of its keys exactly once: the duplicated and the missing are named."""
    for split, uri in (("train", train), ("val", val)):
        found = Counter(lance.dataset(str(uri)).to_table(columns=["key"]).column("key").to_pylist())
        wanted = Counter(key for key in ids if split_of(key, FRACTION) == split)
        doubled = sorted(key for key, count in found.items() if count > 1)
        missing = sorted((wanted - found).elements())
        assert found == wanted, (
            f"{split} at {uri}: {len(doubled)} keys more than once {doubled[:5]}, {len(missing)} missing {missing[:5]}"
        )


def splits(tmp_path: Path, source: Path) -> list[object]:
    return [
        f"webdataset:{source}/*.tar",
        tmp_path / "train.lance",
        "--val-uri",
        tmp_path / "val.lance",
        "--val-fraction",
        FRACTION,
    ]


# (what the first run did, where it was killed): the commits are val's, then train's
CRASHES = [
    ("create", "after-commit:1"),  # val landed, its version not recorded
    ("create", "before-commit:2"),  # val landed and recorded, train not committed
    ("create", "after-commit:2"),  # both landed, train's version not recorded
    ("create", "before-record"),  # both landed and recorded, the whole ingest not
    ("append", "after-commit:1"),
    ("append", "after-commit:2"),
]


@pytest.mark.parametrize(("mode", "point"), CRASHES)
def test_a_rerun_after_a_crash_between_the_commits_commits_what_is_missing_once(
    tmp_path: Path, capsys, mode: str, point: str
) -> None:
    write_webdataset(tmp_path / "before", ROWS[:16], per_tar=4)
    write_webdataset(tmp_path / "wds", ROWS[16:], per_tar=4)
    command = splits(tmp_path, tmp_path / "wds") + (["--append"] if mode == "append" else [])
    if mode == "append":  # datasets that hold rows already: the crashed run adds to them
        assert ingest(*splits(tmp_path, tmp_path / "before")) == 0, capsys.readouterr().err
    killed = ingest_killed_at(point, *command)
    assert killed.returncode == CRASHED, f"not killed at {point}:\n{killed.stdout}\n{killed.stderr}"
    capsys.readouterr()
    assert ingest(*command) == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    ingested = ROWS if mode == "append" else ROWS[16:]
    assert_every_row_once(tmp_path / "train.lance", tmp_path / "val.lance", [row["id"] for row in ingested])
    assert f"earlier run of this ingest that stopped before the rest: val ({tmp_path / 'val.lance'} version" in printed, printed
    assert printed.count("committed:") == 1 and "already committed" not in printed, printed
    first = 1 if mode == "create" else 2  # one commit per split and per run
    assert [lance.dataset(str(tmp_path / name)).version for name in ("train.lance", "val.lance")] == [first, first]
    capsys.readouterr()
    assert ingest(*command) == 0 and "already committed" in capsys.readouterr().out  # and now nothing is left


@pytest.mark.parametrize("deleted", [("train.lance", "val.lance"), ("val.lance",)])
def test_the_record_of_a_deleted_dataset_does_not_count_and_the_ingest_starts_over(
    tmp_path: Path, capsys, deleted: tuple[str, ...]
) -> None:
    write_webdataset(tmp_path / "wds", ROWS, per_tar=5)
    command = splits(tmp_path, tmp_path / "wds")
    assert ingest(*command) == 0, capsys.readouterr().err
    for name in deleted:
        shutil.rmtree(tmp_path / name)
    capsys.readouterr()
    assert ingest(*command) == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    assert "starting over" in printed and "already committed" not in printed, printed
    assert_every_row_once(tmp_path / "train.lance", tmp_path / "val.lance", [row["id"] for row in ROWS])
    # a split still there is this ingest's own commit: it is kept, not committed again
    assert lance.dataset(str(tmp_path / "train.lance")).version == 1


def test_shard_records_whose_fragments_were_deleted_do_not_count(tmp_path: Path, capsys) -> None:
    write_webdataset(tmp_path / "wds", ROWS, per_tar=5)
    command = splits(tmp_path, tmp_path / "wds")
    train, val = targets(str(command[1]), str(command[3]), {}, None, COMMAND_LINE_NAMES)
    plan = make_plan(str(command[0]), train, val, val_fraction=FRACTION)
    calls = iter([False, False, True])  # two shards written, then stopped: no commit yet
    assert len(run_worker(plan, 0, 2, stop=lambda: next(calls)).done) == 2
    shutil.rmtree(tmp_path / "train.lance")  # the uncommitted fragments those shard records name
    capsys.readouterr()
    assert ingest(*command) == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    assert "starting over" in printed and "resuming" not in printed, printed
    assert_every_row_once(tmp_path / "train.lance", tmp_path / "val.lance", [row["id"] for row in ROWS])


def test_an_ingest_job_run_again_after_its_datasets_were_deleted_starts_over(tmp_path: Path) -> None:
    write_webdataset(tmp_path / "wds", ROWS, per_tar=5)
    job = ingest_job_spec(tmp_path, FRACTION)
    command = [sys.executable, "-m", "lance_hpc.submit", str(job), "--local", "--nproc", "2"]
    first = subprocess.run(command, capture_output=True, text=True)
    assert first.returncode == 0, first.stdout + first.stderr
    shutil.rmtree(tmp_path / "train.lance")
    shutil.rmtree(tmp_path / "val.lance")
    again = subprocess.run(command, capture_output=True, text=True)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "starting over" in again.stdout and "already committed" not in again.stdout, again.stdout
    assert_every_row_once(tmp_path / "train.lance", tmp_path / "val.lance", [row["id"] for row in ROWS])
