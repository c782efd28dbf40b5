"""Day-two commands for submitted jobs: ``lance-hpc status | logs | cancel``, by job spec or job id,
and ``lance-hpc lineage``, where a dataset's columns and a checkpoint came from.

``lance_hpc.slurm`` asks SLURM (scontrol, squeue, sacct where there is accounting) and maps a spec
to its jobs and back, ``progress`` reads what a job leaves behind (checkpoint, TensorBoard, log),
and ``status``, ``logs``, ``cancel`` and ``lineage`` do what those commands do (their parsers are
in :mod:`lance_hpc.cli`).

Looking at a job never runs its code: any user's job id can be named, so these commands read only
spec files the caller owns, and validate them without importing the task or entry they name
(:func:`~lance_hpc.slurm.records.load_own_spec`).
"""
