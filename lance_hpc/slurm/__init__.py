"""The SLURM client every step shares: the queue as scontrol, squeue and sacct show it."""
