"""Inside every rank: the cluster environment and process group (``environment``), the rank's
entry (``rank``), preemption from signal to requeue (``preemption``), checkpoints and the writer
lease (``checkpoint``, ``lease``), the public :class:`~lance_hpc.runtime.context.Context` that a
job's entry function gets (``context``), the built-in training loop (``trainer``), and metrics."""
