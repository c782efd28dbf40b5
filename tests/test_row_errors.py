"""``infer.on_error`` at the level of one batch: only a row that raises on its own is that row's
error (named, skipped or fatal); a batch whose rows all pass alone, a batch whose every row raises,
and a fault of the machine (out of memory, CUDA) take the path of any other error (a restart)."""

from __future__ import annotations

import numpy as np
import pytest

from lance_hpc.errors import RepeatingError
from lance_hpc.writeback.row_errors import RowErrors


def errors(policy: str) -> RowErrors:
    return RowErrors(policy=policy, rank=0, what="infer.function", outputs=["y"])


def batch(rows: int, raises: Exception) -> tuple:
    """``whole`` raising ``raises``; ``one(i)`` giving 3 * i."""

    def whole() -> tuple:
        raise raises

    def one(row: int) -> tuple:
        return {"y": np.array([3 * row])}, np.ones(1, bool)

    return whole, one


@pytest.mark.parametrize("policy", ["fail", "skip"])
def test_a_batch_whose_rows_all_pass_alone_raises_its_own_error(policy: str) -> None:
    whole, one = batch(4, ValueError("too big as a batch"))
    rows = errors(policy)
    with pytest.raises(ValueError, match="too big as a batch"):
        rows.run(4, whole, one, lambda row: f"row {row}")
    assert rows.skipped == [] and rows.failure is None


@pytest.mark.parametrize("policy", ["fail", "skip"])
def test_a_batch_whose_every_row_raises_names_no_row(policy: str) -> None:
    def one(row: int) -> tuple:
        raise ValueError("nothing works")

    rows = errors(policy)
    with pytest.raises(ValueError, match="nothing works"):
        rows.run(3, batch(3, ValueError("nothing works"))[0], one, lambda row: f"row {row}")
    assert rows.skipped == [] and rows.failure is None


@pytest.mark.parametrize("fault", [MemoryError(), RuntimeError("CUDA error: an illegal memory access was encountered")])
def test_a_fault_of_the_machine_is_never_a_rows(fault: Exception) -> None:
    whole, one = batch(2, fault)
    with pytest.raises(type(fault)):
        errors("skip").run(2, whole, one, lambda row: f"row {row}")


def odd_rows_raise(row: int) -> tuple:
    if row % 2:
        raise KeyError(f"no field in row {row}")
    return {"y": np.array([3 * row])}, np.ones(1, bool)


def test_a_row_that_raises_alone_is_skipped_and_the_others_keep_their_values() -> None:
    rows = errors("skip")
    values, valid = rows.run(4, batch(4, KeyError("x"))[0], odd_rows_raise, lambda row: f"row {row}")
    assert rows.skipped == ["row 1", "row 3"]
    assert valid.tolist() == [True, False, True, False] and values["y"][valid].tolist() == [0, 6]


def test_a_row_that_raises_alone_fails_the_job_naming_it() -> None:
    with pytest.raises(RepeatingError, match="infer.function raised on row 1: KeyError"):
        errors("fail").run(4, batch(4, KeyError("x"))[0], odd_rows_raise, lambda row: f"row {row}")
