"""``lance-hpc ingest SOURCE URI`` or ``lance-hpc ingest --spec job.yaml`` (also ``python -m
lance_hpc.ingest``): write a source into Lance datasets (:mod:`lance_hpc.ingest.dataset`); a sharded
source by ``--nproc`` workers on this machine (:mod:`lance_hpc.cli.ingest_shards`).

USR1 does not end the command or its workers: the dispatcher ignores it before the imports
(:data:`lance_hpc.cli.UNPROFILED`).
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Sequence

from lance_hpc.cli.arguments import add_storage_options
from lance_hpc.cli.reporting import run_reporting_errors
from lance_hpc.errors import UserError
from lance_hpc.limits import DEFAULT_RECORD_MB, MAX_PIXELS, MAX_SAMPLE_FIELDS

if TYPE_CHECKING:
    from lance_hpc.ingest.target import Ingested

# Options that are fields of data.ingest too: held to the same bounds.
BOUNDED_OPTIONS = ("val_fraction", "rows_per_fragment", "sequence_length", "files_per_shard", "max_pixels", "max_record_mb")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lance-hpc ingest",
        description="Ingest: write an image classification dataset, or the token sequences of a text corpus, to Lance.",
    )
    parser.add_argument(
        "source",
        nargs="?",
        help="images: sklearn-digits | skimage-photos[:count=N] | imagefolder:<dir> | torchvision:<Name>:<root>; "
        "text: text:<glob> | python-stdlib[:max_mb=N]; any rows, by many workers: parquet:<glob> | jsonl:<glob> "
        "(.jsonl, .gz, .zst) | webdataset:<glob of .tar> | hf:<dir saved by save_to_disk>, local or s3://",
    )
    parser.add_argument("uri", nargs="?", help="training dataset to create (path or s3://bucket/x.lance)")
    parser.add_argument("--spec", help="job spec: ingest its data.ingest source to data.uri / data.val_uri")
    parser.add_argument("--val-uri", help="validation dataset to create")
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="write the source over Lance datasets already at the URIs, as a new version of each (without it they "
        "are kept); a path holding anything but a Lance dataset is refused either way, and nothing is deleted",
    )
    parser.add_argument(
        "--val-fraction", type=float, default=0.2, help="share of rows (text: of documents) for validation (default 0.2)"
    )
    parser.add_argument("--rows-per-fragment", type=int, default=1024, help="rows per Lance fragment (default 1024)")
    parser.add_argument(
        "--seed", type=int, default=0, help="sklearn-digits, skimage-photos, torchvision: seed of the split and row order"
    )
    add_storage_options(parser)
    add_shard_options(parser)
    return parser


def add_shard_options(parser: argparse.ArgumentParser) -> None:
    """The options of the sources that many workers write, shard by shard."""
    shards = parser.add_argument_group(
        "imagefolder:, text:, python-stdlib, parquet:, jsonl:, webdataset: and hf: sources (written by N workers, one "
        "commit at the end, resumable; the validation split by a hash of each row's key)"
    )
    shards.add_argument("--nproc", type=int, default=1, help="workers on this machine (default 1)")
    shards.add_argument(
        "--files-per-shard",
        type=int,
        default=1000,
        help="imagefolder: and text: files per shard (default 1000; a format of your own reads it from self.settings)",
    )
    shards.add_argument(
        "--tokenize",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="pack the text into token sequences for a language model (default: yes for text: and python-stdlib, "
        "no for others; --no-tokenize keeps one row per document)",
    )
    shards.add_argument("--sequence-length", type=int, default=256, help="tokens per training sequence (default 256)")
    shards.add_argument(
        "--tokenizer",
        default="bytes",
        help="bytes (UTF-8, the default), hf:<tokenizer.json> (see lance-hpc tokenizer train) or an import path "
        "package.module:factory",
    )
    shards.add_argument(
        "--column",
        action="append",
        default=[],
        metavar="NAME=FIELD",
        help="which source field is image, label, text or key, e.g. --column image=png --column label=class_id "
        "(FIELD empty: the source has none); other fields are kept as columns",
    )
    shards.add_argument("--append", action="store_true", help="add the rows to the Lance dataset at URI as a new version")
    shards.add_argument(
        "--on-corrupt",
        choices=("skip", "fail"),
        default="skip",
        help=f"an unreadable image, or a sample past --max-record-mb or {MAX_SAMPLE_FIELDS} fields: skip and count it "
        "(default), or fail",
    )
    shards.add_argument(
        "--max-pixels", type=int, default=MAX_PIXELS, help=f"larger images are skipped (default and most {MAX_PIXELS:,})"
    )
    shards.add_argument(
        "--max-record-mb",
        type=int,
        default=DEFAULT_RECORD_MB,
        help=f"a tar member or file over this many MiB is skipped, as --on-corrupt says (default {DEFAULT_RECORD_MB})",
    )
    shards.add_argument("--dry-run", action="store_true", help="list the shards and each worker's share; write nothing")
    shards.add_argument("--worker", help=argparse.SUPPRESS)  # RANK/WORLD: one worker process of a local run


def main(argv: Sequence[str] | None = None) -> int:
    arguments = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(arguments)
    return run_reporting_errors(lambda: ingest_command(parser, args, arguments))


def ingest_command(parser: argparse.ArgumentParser, args: argparse.Namespace, arguments: list[str]) -> int:
    from lance_hpc.ingest.dataset import ensure_dataset, ingest
    from lance_hpc.ingest.formats import is_shard_source
    from lance_hpc.ingest.target import COMMAND_LINE_NAMES, SPEC_NAMES
    from lance_hpc.spec import load_spec
    from lance_hpc.storage.options import storage_options

    check_options(args)
    if args.source and is_shard_source(args.source):
        if not args.uri:
            parser.error("give SOURCE and URI")
        from lance_hpc.cli.ingest_shards import ingest_shards

        return ingest_shards(args, arguments)
    if args.spec:
        data = load_spec(args.spec).spec.data
        if data.ingest is None:
            raise UserError(f"{args.spec}: data.ingest is not set, so there is nothing to ingest")
        done = ensure_dataset(data, overwrite=args.overwrite or data.ingest.overwrite)
        print(report(done, data.uri, data.val_uri, SPEC_NAMES.overwrite))
        print(f"dataset ready at {data.uri}")
        return 0
    if not args.source or not args.uri:
        parser.error("give SOURCE and URI, or --spec job.yaml")
    spec_options = dict(option.split("=", 1) for option in args.storage_option if "=" in option)
    done = ingest(
        args.source,
        args.uri,
        args.val_uri,
        val_fraction=args.val_fraction,
        rows_per_fragment=args.rows_per_fragment,
        seed=args.seed,
        options=storage_options(args.uri, spec_options),
        val_options=storage_options(args.val_uri, spec_options) if args.val_uri else None,
        overwrite=args.overwrite,
    )
    print(report(done, args.uri, args.val_uri, COMMAND_LINE_NAMES.overwrite))
    return 0


def check_options(args: argparse.Namespace) -> None:
    """The command line's numbers held to the bounds of data.ingest's fields of the same names."""
    from lance_hpc.spec import IngestSpec
    from lance_hpc.spec.problems import option_problems

    problems = option_problems(IngestSpec, {name: getattr(args, name) for name in BOUNDED_OPTIONS}, source="-")
    if problems:
        raise UserError("\n".join(problems))


def report(done: Ingested, uri: str, val_uri: str | None, overwrite_fix: str) -> str:
    """What an ingest did, for the command line."""
    lines = []
    if done.train or done.val:
        lines.append(
            f"wrote {done.train:,} training rows to {uri}"
            + (f" and {done.val:,} validation rows to {val_uri}" if done.val else "")
        )
    for kept in done.kept:
        lines.append(f"kept the Lance dataset already at {kept}; to write the source over it as a new version, {overwrite_fix}")
    return "\n".join(lines) or f"nothing to write to {uri}"
