"""The tokenizers of a text ingest, by name, and training one offline.

``tokenizer:`` (or ``--tokenizer``) names ``bytes`` (UTF-8 bytes, EOD 256), ``hf:<tokenizer.json>``
or an import path ``package.module:factory`` returning an object with ``encode(text)``,
``vocab_size`` and optionally ``eod_id`` (:func:`load_tokenizer`).

``tokenizer: hf:path/to/tokenizer.json`` (or ``--tokenizer hf:...``) loads any ``tokenizer.json``
the ``tokenizers`` library reads (GPT-2's, Llama's, one trained here). Its end-of-document id is
the first of the usual end-of-text special tokens it has; a vocabulary without one gets an extra
id for it. ``lance-hpc tokenizer train SOURCE OUT.json`` trains a byte-level BPE on a text source
(``text:<glob>``, ``python-stdlib[:max_mb=N]``, or the text field of ``parquet:``, ``jsonl:``,
``hf:`` and ``webdataset:`` sources), offline, with ``<|endoftext|>`` as its end of document, so a
cluster with no internet can have a tokenizer fitted to its own corpus. With ``--val-fraction``, the
documents an ingest with that fraction holds out for validation are left out of the training.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from lance_hpc.errors import UserError
from lance_hpc.imports import is_import_path, load_callable
from lance_hpc.ingest.formats import is_shard_source
from lance_hpc.ingest.shard_batches import ColumnMap, document_texts, text_batches
from lance_hpc.ingest.shards import list_shards, parse_source, split_of
from lance_hpc.spec import IngestSpec
from lance_hpc.storage.files import write_file

# End-of-document tokens, in the order one is looked for in a loaded vocabulary.
EOD_TOKENS = ("<|endoftext|>", "</s>", "<eos>", "<eod>", "[SEP]")
DEFAULT_VOCAB: int = IngestSpec.model_fields["vocab_size"].default


def load_hf(path: str) -> tuple[object, int, int]:
    """(tokenizer, vocab_size, eod_id) of a ``tokenizer.json``; eod_id may equal vocab_size - 1
    when it was added."""
    from tokenizers import Tokenizer as HfTokenizer

    if not Path(path).is_file():
        raise UserError(
            f"tokenizer hf:{path}: no such file (relative paths start from the directory you run in)\n"
            f"  fix: name a tokenizer.json, or train one offline: lance-hpc tokenizer train SOURCE {path} --vocab-size "
            f"{DEFAULT_VOCAB} (a training job, or a --local run, whose data.ingest names it trains it there itself)"
        )
    try:
        loaded = HfTokenizer.from_file(path)
    except Exception as error:  # the library's parse error, in its words
        raise UserError(f"tokenizer hf:{path} is not a tokenizers file: {error}") from None
    vocab_size = loaded.get_vocab_size(with_added_tokens=True)
    eod = next((loaded.token_to_id(token) for token in EOD_TOKENS if loaded.token_to_id(token) is not None), None)
    if eod is None:
        return loaded, vocab_size + 1, vocab_size
    return loaded, vocab_size, int(eod)


def encoder(loaded: object) -> Callable[[str], np.ndarray]:
    """``text -> ids`` for a loaded ``tokenizers`` tokenizer, without special tokens added."""

    def encode(text: str) -> np.ndarray:
        return np.asarray(loaded.encode(text, add_special_tokens=False).ids, dtype=np.int64)  # type: ignore[attr-defined]

    return encode


@dataclass(frozen=True)
class Tokenizer:
    """A loaded tokenizer: ``encode`` returns a 1-D array of ids below ``vocab_size`` (EOD included)."""

    name: str
    encode: Callable[[str], np.ndarray]
    vocab_size: int
    eod_id: int

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(np.uint16 if self.vocab_size <= 1 << 16 else np.int32)


def _bytes_tokenizer() -> Tokenizer:
    return Tokenizer("bytes", lambda text: np.frombuffer(text.encode("utf-8"), np.uint8), vocab_size=257, eod_id=256)


TOKENIZERS: dict[str, Callable[[], Tokenizer]] = {"bytes": _bytes_tokenizer}


def load_tokenizer(name: str) -> Tokenizer:
    """The tokenizer ``name``: a registered one, ``hf:<tokenizer.json>``, or the factory an import
    path names."""
    if name in TOKENIZERS:
        return TOKENIZERS[name]()
    if name.startswith("hf:"):
        hf_tokenizer, hf_vocab, hf_eod = load_hf(name[len("hf:") :])
        return Tokenizer(name, encoder(hf_tokenizer), hf_vocab, hf_eod)
    if not is_import_path(name):
        raise UserError(
            f"unknown tokenizer {name!r}: use {', '.join(TOKENIZERS)}, hf:<tokenizer.json> or an import path "
            "package.module:factory"
        )
    try:
        loaded = load_callable(name, "tokenizer")()
    except UserError:
        raise
    except Exception as error:  # the factory is the user's code
        raise UserError(f"tokenizer {name!r}: the factory raised {type(error).__name__}: {error}") from None
    vocab_size, eod_id = getattr(loaded, "vocab_size", None), getattr(loaded, "eod_id", None)
    if not callable(getattr(loaded, "encode", None)) or not isinstance(vocab_size, int) or vocab_size < 1:
        raise UserError(f"tokenizer {name!r}: the factory must return an object with encode(text) and an int vocab_size")
    if eod_id is None:
        eod_id, vocab_size = vocab_size, vocab_size + 1
    elif not 0 <= eod_id < vocab_size:
        raise UserError(f"tokenizer {name!r}: eod_id {eod_id} is outside its vocabulary 0..{vocab_size - 1}")

    def encode(text: str) -> np.ndarray:
        ids = np.asarray(loaded.encode(text), dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
            raise UserError(f"tokenizer {name!r} returned ids outside its vocabulary 0..{vocab_size - 1}")
        return ids

    return Tokenizer(name, encode, vocab_size, int(eod_id))


def documents(source_text: str, val_fraction: float = 0.0) -> Iterator[str]:
    """The text of each document of a source, in its shards' order, leaving out those an ingest
    with ``val_fraction`` puts in the validation split."""
    if not is_shard_source(source_text):
        raise UserError(
            f"source {source_text!r}: give text:<glob>, python-stdlib[:max_mb=N], or a parquet:, jsonl:, hf: or "
            "webdataset: source with a text field"
        )
    source = parse_source(source_text)
    for shard in list_shards(source):
        for key, text in document_texts(text_batches(source, shard, ColumnMap())):
            if text and not (val_fraction and split_of(key, val_fraction) == "val"):
                yield text


def train(
    source: str, out: Path, vocab_size: int = DEFAULT_VOCAB, min_frequency: int = 2, val_fraction: float = 0.0
) -> dict[str, float]:
    """A byte-level BPE trained on ``source``'s documents (less the held-out ones), saved to ``out``;
    returns its figures."""
    from tokenizers import Tokenizer as HfTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    if vocab_size < 300:
        raise UserError(f"--vocab-size {vocab_size}: a byte-level BPE needs at least 300 (256 bytes, merges, <|endoftext|>)")
    if out.exists():
        raise UserError(f"{out} exists: a tokenizer is never written over\n  fix: name a new file, or move {out} away")
    if not 0.0 <= val_fraction < 1.0:
        raise UserError(f"--val-fraction {val_fraction}: give a fraction in [0, 1)")
    count = sum(1 for _ in documents(source, val_fraction))  # the bar's length, and a clear error before training
    if not count:
        raise UserError(f"{source} holds no document with text to train on")
    tokenizer = HfTokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[EOD_TOKENS[0]],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=sys.stderr.isatty(),
    )
    started = time.monotonic()
    tokenizer.train_from_iterator(documents(source, val_fraction), trainer=trainer, length=count)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_file(out, tokenizer.to_str(pretty=True))
    sample = "".join(text for _, text in zip(range(50), documents(source, val_fraction)))
    tokens = len(tokenizer.encode(sample).ids) if sample else 0
    return {
        "documents": float(count),
        "vocab_size": float(tokenizer.get_vocab_size()),
        "bytes_per_token": len(sample.encode()) / tokens if tokens else 0.0,
        "seconds": time.monotonic() - started,
    }


def ensure_tokenizer(ingest: IngestSpec, val_fraction: float) -> None:
    """Train the BPE that ``ingest.tokenizer`` (``hf:<file>``) names when the file does not exist
    yet, on the documents the ingest trains on (those a ``val_fraction`` holds out are left out),
    saying so: a job ingests its data on first use, and makes its tokenizer first."""
    if not ingest.tokenizer.startswith("hf:") or Path(ingest.tokenizer[len("hf:") :]).exists():
        return
    path = Path(ingest.tokenizer[len("hf:") :])
    print(
        f"tokenizer {ingest.tokenizer} does not exist yet: training a {ingest.vocab_size:,}-token byte-level BPE "
        f"on the training documents of {ingest.source} (data.ingest.vocab_size), as lance-hpc tokenizer train does",
        flush=True,
    )
    figures = train(ingest.source, path, ingest.vocab_size, val_fraction=val_fraction)
    print(
        f"  trained on {figures['documents']:,.0f} documents in {figures['seconds']:.1f} s, "
        f"{figures['bytes_per_token']:.2f} bytes per token on a sample; wrote {path}",
        flush=True,
    )
