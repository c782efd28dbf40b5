"""``infer.on_error``: what a write-back job does with a row its function (or the model) raises on.

The function runs a batch at a time. When a batch raises, it runs again a row at a time to find
the rows at fault: with ``fail`` the job stops at the first one, its message the user's own error
and the row (no traceback of ours: the same row fails the same way after a restart, so there is
none); with ``skip`` those rows get nulls in every new column, each is named in the rank's log and
counted in the commit's line, and the other rows keep their values.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, NoReturn

import numpy as np

from lance_hpc.errors import RepeatingError, UserError

# The skipped rows a commit's line names (the rank's log names every one).
NAMED_IN_SUMMARY = 5

Outputs = dict[str, np.ndarray]
Computed = Callable[[], tuple[Outputs, np.ndarray]]  # a batch's (or a row's) outputs and which rows have them


def is_fault(error: BaseException) -> bool:
    """An error of the machine rather than of a row: out of memory, or the GPU's own (CUDA) errors,
    which another attempt (on another node) may not meet."""
    return isinstance(error, MemoryError) or type(error).__name__ == "OutOfMemoryError" or "CUDA" in str(error)


@dataclass
class RowErrors:
    """One rank's rows that raised, under ``policy`` (infer.on_error); ``what`` names the code that
    raised (``infer.function`` or ``the model``) and ``name_row`` a row of the fragment by its offset
    there (its key when the dataset has one)."""

    policy: str
    rank: int
    what: str
    outputs: list[str]
    template: Outputs = field(default_factory=dict)  # a row's outputs: the shape of a skipped row's nulls
    skipped: list[str] = field(default_factory=list)  # the current fragment's, named
    failure: RepeatingError | None = None

    def run(
        self, rows: int, whole: Computed, one: Callable[[int], tuple[Outputs, np.ndarray]], name_row: Callable[[int], str]
    ) -> tuple[Outputs, np.ndarray]:
        """``whole()``'s outputs for a batch of ``rows`` rows and which rows have them; when it raises,
        ``one(i)`` for each row ``i`` instead, and what the policy says for the rows that raise."""
        try:
            values, valid = whole()
        except UserError:  # ours, about what the code returned: the message says the fix
            raise
        except Exception as error:  # the user's code, or the device or store under it
            if is_fault(error):
                raise
            found: list[tuple[Outputs, np.ndarray] | None] = []
            failures: list[tuple[int, Exception]] = []
            for row in range(rows):
                try:
                    found.append(one(row))
                except UserError:
                    raise
                except Exception as row_error:
                    if is_fault(row_error):
                        raise
                    found.append(None)
                    failures.append((row, row_error))
            # No row raises alone (the batch as a whole was at fault: its size, a passing fault), or
            # every row of several does (nothing points at a row): the error is not a row's, and
            # takes the path of any other error (a restart; the same error twice stops the job).
            if not failures or (rows > 1 and len(failures) == rows):
                raise error
            for row, raised in failures:
                self.raised(name_row(row), raised)
            return self.stack(found)
        self.template = {name: value[:1] for name, value in values.items()}
        return values, valid

    def raised(self, row: str, error: BaseException) -> None:
        """Row ``row`` raised ``error``: skipped and said, or (``fail``) the job's failure, raised."""
        own = f"{type(error).__name__}: {error}".strip()
        if self.policy == "skip":
            self.skipped.append(row)
            print(f"rank {self.rank}: {row} skipped (infer.on_error: skip), its columns null: {own}", flush=True)
            return
        self.failure = RepeatingError(
            f"{self.what} raised on {row}: {own}\n"
            "  fix: make it handle this row, or set infer.on_error: skip to write nulls for the rows it raises on"
        )
        raise self.failure

    def fragment_done(self) -> list[str]:
        """The current fragment's skipped rows, and none for the next."""
        skipped, self.skipped = self.skipped, []
        return skipped

    def reraise(self, error: BaseException) -> NoReturn:
        """Raise the row's failure in place of ``error`` (Lance wraps an exception raised while it
        reads the batches in its own), or ``error`` itself when no row failed."""
        if self.failure is not None:
            raise self.failure from None
        raise error

    def stack(self, found: list[tuple[Outputs, np.ndarray] | None]) -> tuple[Outputs, np.ndarray]:
        """Per-row outputs (None: the row raised) as one batch's, and which rows have them; a row
        that raised takes zeros shaped like another row's outputs (null once written)."""
        valid = np.concatenate([row[1] if row is not None else np.zeros(1, bool) for row in found])
        template = next((row[0] for row in found if row is not None), None)
        if template is None:  # every row raised: shaped like an earlier batch's, if any
            template = {name: self.template.get(name, np.zeros(1)) for name in self.outputs}
        values = {
            name: np.concatenate([row[0][name] if row is not None else np.zeros_like(first) for row in found])
            for name, first in template.items()
        }
        return values, valid


def summary(skipped: list[str]) -> str:
    """`` (2 rows skipped (infer.on_error: skip), null: row 13 ..., row 20 ...)`` for a commit's line."""
    if not skipped:
        return ""
    named = "; ".join(skipped[:NAMED_IN_SUMMARY]) + (
        f"; and {len(skipped) - NAMED_IN_SUMMARY} more" if len(skipped) > NAMED_IN_SUMMARY else ""
    )
    return f" ({len(skipped)} row(s) skipped (infer.on_error: skip), null: {named})"


def row_name(opened: Callable[[], Any], fragment_id: int, start: int, offset: int) -> str:
    """``row 13 (key 'a-13') of fragment 1``: the row's index in the dataset version, its key when
    the dataset (``opened()``, only now: most rows never need it) has a key column, and its fragment."""
    dataset, key = opened(), ""
    if "key" in dataset.schema.names:
        value = dataset.get_fragment(fragment_id).take([offset], columns=["key"]).column("key")[0].as_py()
        key = f" (key {value!r})"
    return f"row {start + offset}{key} of fragment {fragment_id}"
