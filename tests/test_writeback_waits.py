"""A rank that waits for rank 0 during a write-back: it waits for a record that stays (not a
state it can miss between two looks), and a stop signal ends the wait at once."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import lance
import pyarrow as pa
import pytest

from lance_hpc.writeback import rerun, waits
from lance_hpc.writeback.new_columns import Records


@pytest.fixture
def stale(tmp_path: Path) -> tuple[str, Records]:
    """A dataset without the column ``twice`` and a run's record that it committed the column: stale."""
    uri = str(tmp_path / "digits.lance")
    lance.write_dataset(pa.table({"label": list(range(10))}), uri)
    records = Records(str(tmp_path / ".digits.lance.infer" / "run"), {})
    records.mark_committed(1)
    return uri, records


def test_a_waiting_rank_sees_rank_0_clear_and_commit_between_two_of_its_looks(stale, monkeypatch) -> None:
    uri, records = stale
    monkeypatch.setattr(waits, "WAIT_LIMIT_S", 3.0)  # a missed commit fails in seconds, not 600 s
    real = rerun.stale_commit
    moved: list[int] = []

    def rank_0_done_meanwhile(*args: Any, **kwargs: Any) -> str | None:
        reason = real(*args, **kwargs)
        if not moved:  # right after rank 1 found the record stale: rank 0 clears, starts over and commits
            records.clear()
            lance.dataset(uri).add_columns({"twice": "label * 2"})
            records.mark_committed(2)
            moved.append(2)
        return reason

    monkeypatch.setattr(rerun, "stale_commit", rank_0_done_meanwhile)
    started = time.monotonic()
    found = rerun.earlier_commit(records, uri, {}, {"twice": "int64"}, main=False, stopped=lambda: False)
    assert found == 2 and time.monotonic() - started < 2.0


def test_a_stop_signal_ends_a_rank_waiting_for_rank_0_within_seconds(stale, monkeypatch) -> None:
    from lance_hpc.runtime.preemption import Preemption
    from lance_hpc.writeback.waits import Stopped, until_stopped

    uri, records = stale  # rank 0 never clears the records: the wait would last its whole limit
    with Preemption((signal.SIGTERM,)) as preemption:
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()
        started = time.monotonic()
        with pytest.raises(Stopped):
            rerun.earlier_commit(
                records, uri, {}, {"twice": "int64"}, main=False, stopped=lambda: preemption.received is not None
            )
        assert time.monotonic() - started < 5.0
    assert preemption.received == signal.SIGTERM

    def waiting() -> Any:
        raise Stopped("commit")

    assert until_stopped(waiting, 1).status == "stopped"


@pytest.mark.parametrize("code", ["x", ["function"], None])
def test_an_earlier_runs_record_of_another_shape_is_discarded_as_other_code(tmp_path, capsys, code) -> None:
    """``job.json`` beside a shared dataset may have been written by anyone: a ``code`` that is no
    mapping says nothing of the code, so the earlier run is discarded, never an AttributeError."""
    import json

    from lance_hpc.writeback.earlier_runs import JOB_RECORD, claim

    root = tmp_path / ".data.infer"
    (root / "old").mkdir(parents=True)
    (root / "old" / JOB_RECORD).write_text(json.dumps({"job": "job-key", "code": code}))
    claim(str(root), "job-key", str(root / "new"), {"function": "abc"}, {})
    assert "starting over: infer.function's source changed" in capsys.readouterr().out
    assert json.loads((root / "new" / JOB_RECORD).read_text()) == {"job": "job-key", "code": {"function": "abc"}}


def test_an_append_to_a_column_with_several_metadata_keys_keeps_every_fragment(tmp_path: Path) -> None:
    """A schema is the same after an append, whatever order Lance lists a field's metadata in
    (each read of the schema lists a map in an order of its own)."""
    from lance_hpc.writeback.repin import unchanged

    uri = str(tmp_path / "data.lance")
    field = pa.field("image", pa.binary(), metadata={f"key{index}": f"value{index}" for index in range(8)})
    lance.write_dataset(pa.table({"image": [b"a", b"b"]}, schema=pa.schema([field])), uri, max_rows_per_file=1)
    lance.write_dataset(lance.dataset(uri).to_table(), uri, mode="append")
    assert unchanged(lance.dataset(uri, version=1), lance.dataset(uri)) == [0, 1]
