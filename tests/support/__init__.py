"""What the tests stand on, kept out of the product: a SLURM cluster on loopback
(``slurm_cluster``, also usable by hand), its pytest fixtures (``slurm``), a loopback S3 server
and its fixtures (``s3``), a fault-injecting proxy in front of it (``fault_proxy``), and the
digits dataset with the job specs the training tests share (``jobs``)."""
