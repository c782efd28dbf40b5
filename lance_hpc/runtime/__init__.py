"""Inside every rank: the cluster environment and process group (``environment``), the rank's
ports (``ports``), preemption from signal to requeue (``preemption``), the public :class:`~lance_hpc.runtime.context.Context` that a
job's entry function gets (``context``, a face over the step clock, the step loop, the metric
window, the watchdog hookup, the profiler, the progress bar and the model's setup) and the code that
runs that function (``entry``), the built-in training loop (``trainer``), and metrics."""
