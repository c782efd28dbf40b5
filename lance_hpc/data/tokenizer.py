"""Real tokenizers for text ingest: a Hugging Face ``tokenizers`` file, and training one offline.

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
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from lance_hpc.data.shards import (
    ColumnMap,
    document_texts,
    is_shard_source,
    list_shards,
    parse_source,
    split_of,
    text_batches,
)
from lance_hpc.errors import UserError
from lance_hpc.storage.files import write_file

# End-of-document tokens, in the order one is looked for in a loaded vocabulary.
EOD_TOKENS = ("<|endoftext|>", "</s>", "<eos>", "<eod>", "[SEP]")
DEFAULT_VOCAB = 8192


def load_hf(path: str) -> tuple[object, int, int]:
    """(tokenizer, vocab_size, eod_id) of a ``tokenizer.json``; eod_id may equal vocab_size - 1
    when it was added."""
    from tokenizers import Tokenizer as HfTokenizer

    if not Path(path).is_file():
        raise UserError(
            f"tokenizer hf:{path}: no such file (relative paths start from the directory you run in)\n"
            f"  fix: name a tokenizer.json, or train one offline: lance-hpc tokenizer train SOURCE {path} --vocab-size 8192"
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
