"""From a validated spec to running ranks: the sbatch script (``render``, with ``container``),
submission through submitit (``submit``), and local runs on this machine (``local``)."""
