"""Rules between the fields that say how a job restarts inside its allocation (slurm.max_restarts,
slurm.min_nodes, slurm.spare_nodes); see lance_hpc.launch.restarts for what they do."""

from __future__ import annotations

from typing import Any, Mapping

from lance_hpc.spec.problems import Problem
from lance_hpc.spec.slurm_section import SlurmSpec


def restart_problems(slurm: Mapping[str, Any]) -> list[Problem]:
    """min_nodes within nodes; spares and fewer nodes only where a restart can use them."""
    defaults = SlurmSpec.model_fields
    nodes = slurm.get("nodes", defaults["nodes"].default)
    restarts = slurm.get("max_restarts", defaults["max_restarts"].default)
    fewest, spares = slurm.get("min_nodes"), slurm.get("spare_nodes", 0)
    if not all(isinstance(value, int) for value in (nodes, restarts, spares)) or not isinstance(fewest, (int, type(None))):
        return []  # the field's own check reports it
    problems = []
    if fewest is not None and fewest > nodes:
        problems.append(
            Problem(
                "slurm.min_nodes",
                f"{fewest} is more than slurm.nodes ({nodes}): it is the fewest nodes a restart may go on with",
                f"set min_nodes to at most {nodes}, or remove it",
            )
        )
    if restarts == 0:
        unused = [
            (path, what)
            for path, what, used in (
                ("slurm.spare_nodes", "spare nodes take a failed node's place at a restart", spares > 0),
                ("slurm.min_nodes", "a restart goes on with fewer nodes", fewest is not None and fewest < nodes),
            )
            if used
        ]
        problems += [
            Problem(path, f"{what}, but slurm.max_restarts is 0", "set slurm.max_restarts (default 2), or remove this key")
            for path, what in unused
        ]
    return problems
