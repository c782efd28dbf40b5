"""The environment variables between the restart supervisor (:mod:`lance_hpc.launch.restarts`, or
the local launcher) and the ranks of each attempt it starts, named once for both sides.

The supervisor runs from a zip application of the standard-library modules it needs
(:mod:`lance_hpc.launch.restart_script`), which holds this module: it imports nothing.
"""

from __future__ import annotations

ATTEMPT_VARIABLE = "LANCE_HPC_ATTEMPT"  # 0 for the first attempt in the allocation
RESTARTS_LEFT_VARIABLE = "LANCE_HPC_RESTARTS_LEFT"  # whether a hang may end the step (the watchdog)
FAILED_AT_VARIABLE = "LANCE_HPC_FAILED_AT"  # when the previous attempt failed (seconds since the epoch)
FAILED_STEP_VARIABLE = "LANCE_HPC_FAILED_STEP"  # the furthest step it reached, when known
STANDBY_VARIABLE = "LANCE_HPC_STANDBY"  # a standby rank's go file (lance_hpc.kinds.standby)
FAILURE_DIR_VARIABLE = "LANCE_HPC_FAILURE_DIR"  # where each rank notes how it failed (lance_hpc.runtime.failures)
# Set by the batch script of a job in a container: a file there means rank 0 asked for a requeue
# (lance_hpc.runtime.preemption), which the script carries out once the supervisor ends.
REQUEUE_REQUEST_VARIABLE = "LANCE_HPC_REQUEUE_REQUEST"
