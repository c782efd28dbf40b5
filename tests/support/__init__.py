"""What the tests stand on, kept out of the product: a SLURM cluster on loopback
(``slurm_cluster``, also usable by hand), its pytest fixtures and job helpers (``slurm``), a
loopback S3 server and its fixtures (``s3``), a fault-injecting proxy in front of it
(``fault_proxy``), the digits dataset with the job specs the training tests share (``jobs``),
local ranks and the ``single_rank`` fixture (``ranks``), row-id datasets and their loaders
(``loaders``), checkpoint helpers (``checkpoints``), golden scripts (``render``) and free ports
(``ports``). Test modules import their shared helpers from here, never from one another."""
