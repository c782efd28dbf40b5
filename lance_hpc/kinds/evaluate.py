"""``job: evaluate``: a checkpoint's metrics on data.uri, the same fragment-by-fragment run as
``job: infer``'s (:class:`~lance_hpc.kinds.infer.ModelKind`), reported instead of written
(:mod:`lance_hpc.writeback.evaluation`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lance_hpc.kinds.infer import ModelKind
from lance_hpc.spec.kinds.columns import EvaluateRules

if TYPE_CHECKING:
    from lance_hpc.writeback.job import ModelPass


class Evaluate(EvaluateRules, ModelKind):
    """Evaluation: each fragment's metric sums recorded, and on rank 0 the metrics reported."""

    def work(self) -> ModelPass:
        """The metric sums, and the report."""
        from lance_hpc.writeback.evaluation import Evaluation

        return Evaluation()
