"""``lance-hpc tokenizer train SOURCE OUT.json [--vocab-size N]``: a BPE tokenizer trained offline."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Sequence

from lance_hpc.cli.reporting import run_reporting_errors
from lance_hpc.ingest import tokenizer


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lance-hpc tokenizer",
        description="Train a byte-level BPE tokenizer offline on a text source, for text ingest "
        "(tokenizer: hf:OUT.json in a spec, --tokenizer hf:OUT.json on the command line).",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    training = commands.add_parser("train", help="train a BPE on a text source and save its tokenizer.json")
    training.add_argument(
        "source",
        help="text:<glob> (one document per file), python-stdlib[:max_mb=N], or a parquet:/jsonl:/hf:/webdataset: "
        "source with a text field",
    )
    training.add_argument("out", help="the tokenizer.json to write (never written over)")
    training.add_argument(
        "--vocab-size",
        type=int,
        default=tokenizer.DEFAULT_VOCAB,
        help=f"tokens in the vocabulary (default {tokenizer.DEFAULT_VOCAB})",
    )
    training.add_argument("--min-frequency", type=int, default=2, help="pairs seen fewer times are not merged (default 2)")
    training.add_argument(
        "--val-fraction",
        type=float,
        default=0.0,
        help="leave out the documents an ingest with this val_fraction holds out, so validation text stays unseen",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_reporting_errors(lambda: train(args.source, args.out, args.vocab_size, args.min_frequency, args.val_fraction))


def train(source: str, out: str, vocab_size: int, min_frequency: int, val_fraction: float) -> int:
    figures = tokenizer.train(source, Path(out), vocab_size, min_frequency, val_fraction)
    print(
        f"trained a {figures['vocab_size']:.0f}-token BPE on {figures['documents']:.0f} documents of {source} in "
        f"{figures['seconds']:.1f} s: {figures['bytes_per_token']:.2f} bytes per token on a sample; wrote {out}\n"
        f"use it: tokenizer: hf:{out}"
    )
    return 0
