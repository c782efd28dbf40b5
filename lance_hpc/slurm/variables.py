"""The names of the SLURM environment variables a job's processes read (the launcher, the ranks),
in a module of their own that imports nothing: the launcher reads them without importing torch."""

# Every SLURM variable lance_hpc reads, in one place (submitit's JobEnvironment._env does the same).
SLURM_VARS = {
    "job_id": "SLURM_JOB_ID",
    "step_id": "SLURM_STEP_ID",
    "rank": "SLURM_PROCID",
    "local_rank": "SLURM_LOCALID",
    "node_rank": "SLURM_NODEID",
    "world_size": "SLURM_NTASKS",
    "step_world_size": "SLURM_STEP_NUM_TASKS",
    "num_nodes": "SLURM_JOB_NUM_NODES",
    "step_num_nodes": "SLURM_STEP_NUM_NODES",
    "nodelist": "SLURM_JOB_NODELIST",
    "step_nodelist": "SLURM_STEP_NODELIST",
    "ntasks_per_node": "SLURM_NTASKS_PER_NODE",
    "step_tasks_per_node": "SLURM_STEP_TASKS_PER_NODE",
    "tasks_per_node": "SLURM_TASKS_PER_NODE",
    "gpus_on_node": "SLURM_GPUS_ON_NODE",
    "restart_count": "SLURM_RESTART_COUNT",
    "node_name": "SLURMD_NODENAME",
    "array_job_id": "SLURM_ARRAY_JOB_ID",
    "array_task_id": "SLURM_ARRAY_TASK_ID",
}
