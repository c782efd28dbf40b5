"""Inside every rank: the cluster environment and process group (``environment``, ``ports``),
preemption from signal to requeue (``preemption``), the public
:class:`~lance_hpc.runtime.context.Context` that a job's entry function gets (``context``), the
built-in training loop (``trainer``), the watchdog, metrics, and the failure notes a local run's
launcher reads (``failures``)."""
