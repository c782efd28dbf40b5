"""A job kind of your own: each rank counts the rows of its share of data.uri's fragments, and
rank 0 prints the total.

lance_hpc starts the ranks (locally or under SLURM), hands each the spec and its place in the job,
and asks this class what to check before they start, what a dry run shows, what each rank runs
and what ``lance-hpc status`` says; the kind uses only the public face, ``from lance_hpc import``.

    lance-hpc submit examples/job_kind/job.yaml --local
    lance-hpc submit examples/job_kind/job.yaml --dry-run
"""

from __future__ import annotations

import lance
import torch
import torch.distributed as dist

from lance_hpc import DistEnv, JobKind, JobSpec, Summary, ensure_dataset, process_group


class CountRows(JobKind):
    """Rows per rank over a round-robin share of the fragments, summed in one all-reduce."""

    name = "count_rows"

    def check(self, spec: JobSpec, nproc: int | None) -> list[str]:
        """The dataset ingested once (data.ingest, on first use) and its fragments counted."""
        ensure_dataset(spec.data)
        fragments = len(lance.dataset(spec.data.uri).get_fragments())
        return [f"count_rows: {fragments} fragment(s) of {spec.data.uri} over {nproc or spec.slurm.world_size} rank(s)"]

    def plan(self, spec: JobSpec, source: str) -> str:
        """The fragments each rank would count, without counting them."""
        try:
            fragments = len(lance.dataset(spec.data.uri).get_fragments())
        except (FileNotFoundError, ValueError):  # Lance's error for a missing dataset
            return f"{spec.data.uri} does not exist yet: the job's check ingests data.ingest's source first"
        ranks = spec.slurm.world_size
        shares = [len(range(rank, fragments, ranks)) for rank in range(ranks)]
        return f"{fragments} fragment(s) of {spec.data.uri}; fragments per rank: {shares}"

    def run(self, spec: JobSpec, env: DistEnv, requeue: object, signals: tuple[int, ...]) -> Summary:
        """This rank's fragments counted, the counts summed over the ranks, the total on rank 0."""
        with process_group(env, spec.train.collective_timeout_s) as device:
            fragments = lance.dataset(spec.data.uri).get_fragments()
            mine = fragments[env.rank :: env.world_size]
            rows = sum(fragment.count_rows() for fragment in mine)
            print(f"rank {env.rank}: {rows} rows in {len(mine)} fragment(s)", flush=True)
            total = torch.tensor([rows], dtype=torch.int64, device=device)
            dist.all_reduce(total)  # every rank takes part: the sum arrives everywhere
            if env.is_main:
                print(f"count_rows: {int(total.item())} rows in {spec.data.uri}", flush=True)
            dist.barrier()  # rank 0 hosts the rendezvous store: nobody leaves while others still use it
        return Summary("completed", 0, 0, None, {"rows": float(total.item())})

    def progress(self, spec: JobSpec) -> list[str] | None:
        """A count leaves nothing behind but its log line."""
        return ["the total is the last line of the log (count_rows: N rows in ...)"]
