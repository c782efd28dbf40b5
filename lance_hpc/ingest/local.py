"""A training job's own ingest of a sharded source at its start, by the one process that prepares
the dataset (:func:`ingest_here`), with the tokenizer it names trained first when it does not exist
yet. ``lance-hpc ingest parquet:... URI [--nproc N]`` runs the same steps from the command line
(:mod:`lance_hpc.cli.ingest_shards`).
"""

from __future__ import annotations

from typing import Any

from lance_hpc.ingest.commit import commit
from lance_hpc.ingest.plan import plan_for_data, resume_lines, tokens_of
from lance_hpc.ingest.tokenizer import ensure_tokenizer
from lance_hpc.ingest.write import run_worker


def prepare_tokenizer(data: Any) -> None:
    """A spec's ingest that tokenises with ``hf:<file>``: the tokenizer trained there first when the
    file does not exist yet (:func:`~lance_hpc.ingest.tokenizer.ensure_tokenizer`)."""
    ingest = data.ingest
    if ingest is not None and tokens_of(ingest.source, ingest.tokenize, ingest.tokenizer, ingest.sequence_length):
        ensure_tokenizer(ingest, ingest.val_fraction if data.val_uri else 0.0)


def ingest_here(data: Any, *, overwrite: bool = False) -> tuple[int, int]:
    """A spec's shard source ingested by this process alone (a training job's start); (train, val) rows."""
    prepare_tokenizer(data)
    plan = plan_for_data(data, overwrite=overwrite)
    for line in resume_lines(plan):
        print(line, flush=True)
    if not plan.complete:
        run_worker(plan, 0, 1)
    done = commit(plan)
    return done.rows.get("train", 0), done.rows.get("val", 0)
