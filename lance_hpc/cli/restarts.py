"""``python3 -I <log_dir>/<name>.restarts.pyz OPTIONS -- srun ...``: the restart supervisor's
command line, as the batch script runs it (:mod:`lance_hpc.launch.restart_script` writes the
options from the spec's slurm section). Not a ``lance-hpc`` command: the program beside the script
holds this module and what it imports (:mod:`lance_hpc.launch.restarts`), which run with the
standard library only, outside any container.
"""

from __future__ import annotations

import argparse
from typing import Sequence

from lance_hpc.launch.restarts.supervisor import Options, Supervisor


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python3 -I <name>.restarts.pyz",
        description="Run a job step with srun; start it again inside the allocation when it fails.",
    )
    parser.add_argument("--max-restarts", type=int, required=True, help="slurm.max_restarts")
    parser.add_argument("--nodes", type=int, required=True, help="slurm.nodes: the nodes a step runs on")
    parser.add_argument("--min-nodes", type=int, required=True, help="slurm.min_nodes: the fewest a restart may use")
    parser.add_argument("--tasks-per-node", type=int, required=True, help="ranks per node")
    parser.add_argument("--record", required=True, help="directory of attempts.jsonl and the ranks' failure notes")
    parser.add_argument("--progress", help="the watchdog's directory, where the ranks publish their step")
    parser.add_argument(
        "--no-standby",
        dest="standby",
        action="store_false",
        help="start no ranks ahead for the next attempt (slurm.restart_standby)",
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- srun ...")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the step's command after --")
    options = Options(
        args.max_restarts, args.nodes, args.min_nodes, args.tasks_per_node, args.record, args.progress, args.standby, command
    )
    return Supervisor(options).main()
