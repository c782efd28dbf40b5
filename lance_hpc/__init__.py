"""lance_hpc: DDP training of PyTorch models on Lance datasets across SLURM clusters."""

__version__ = "0.1.0"
