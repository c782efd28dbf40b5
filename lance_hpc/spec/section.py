"""What every section of the job spec shares: a frozen model that forbids unknown keys, a validator
for a name from :mod:`lance_hpc.spec.choices`, and the bounds of counts and seeds."""

from __future__ import annotations

from typing import Any, Callable

from pydantic import BaseModel, ConfigDict
from pydantic_core import PydanticCustomError

# Bounds of every count and seed: what SLURM's and numpy's 32-bit fields hold. Past them a value
# passes validation and then fails on every rank (numpy refuses a seed of -1 or 2**32).
MAX_INT = 2**31 - 1
MAX_SEED = 2**32 - 1


def choice(names: Callable[[], Any]) -> Callable[[str], str]:
    """A validator: the value must be one of ``names()`` (imported when first checked)."""

    def check(value: str) -> str:
        valid = list(names())
        if value not in valid:
            raise PydanticCustomError("choice", "'{value}' is not a valid choice", {"value": value, "expected": ", ".join(valid)})
        return value

    return check


class Section(BaseModel):
    # allow_inf_nan=False: every float field is finite (a cache of .inf GiB never evicts).
    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True, allow_inf_nan=False)
