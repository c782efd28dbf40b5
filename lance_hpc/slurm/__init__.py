"""The SLURM client every step shares: the queue as scontrol, squeue and sacct show it
(:mod:`~lance_hpc.slurm.queue`), and the records of which jobs were submitted for a spec
(:mod:`~lance_hpc.slurm.records`), which submit writes and status, logs and cancel read."""
