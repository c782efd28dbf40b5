"""Text ingest: documents -> tokens -> packed fixed-length sequences -> Lance, for a language model.

Each document is followed by the end-of-document (EOD) token and a split's documents make one
stream; row ``i`` holds ``stream[i*L : i*L + L + 1]`` (``L = sequence_length``), so consecutive
rows overlap by one token and inputs ``tokens[:-1]`` / targets ``tokens[1:]`` lose no target. A
final partial row is dropped. The split is by document, so training never sees a validation
document; training rows are written in a seeded random order, validation rows in stream order.

Schema: ``tokens``, a fixed-size list of ``L + 1`` uint16 (int32 when the vocabulary does not fit);
the schema metadata (the ``*_KEY`` constants) holds what a reader needs, bytes per token included.
Sources: ``text:<glob>`` (each file one document; ``**`` recurses) and ``python-stdlib[:max_mb=N]``
(this interpreter's standard library: no download). Tokenizers: ``bytes`` (UTF-8 bytes, EOD 256) or
an import path ``package.module:factory`` returning an object with ``encode(text)``, ``vocab_size``
and optionally ``eod_id``.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Mapping, Sequence

import numpy as np
import pyarrow as pa

from lance_hpc.data.corpus import document_paths
from lance_hpc.data.target import (
    COMMAND_LINE_NAMES,
    Ingested,
    Target,
    TargetNames,
    find_datasets,
    keeps,
    targets,
    write_lance,
)
from lance_hpc.data.tokenizer import encoder, load_hf
from lance_hpc.errors import UserError
from lance_hpc.imports import is_import_path, load_callable

TOKENS_COLUMN = "tokens"
KIND_KEY = b"lance_hpc.kind"
TOKEN_SEQUENCES_KIND = b"token_sequences"
VOCAB_SIZE_KEY = b"vocab_size"
EOD_ID_KEY = b"eod_id"
SEQUENCE_LENGTH_KEY = b"sequence_length"
TOKENIZER_KEY = b"tokenizer"
BYTES_PER_TOKEN_KEY = b"bytes_per_token"
DOCUMENTS_KEY = b"documents"
SOURCE_KEY = b"source"

WRITE_CHUNK_ROWS = 4096


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


@dataclass(frozen=True)
class TokenSplit:
    """The tokenized documents of one split, as one stream with an EOD after each document;
    :func:`tokenize_splits` makes only splits that fill at least one sequence."""

    name: str
    documents: int
    utf8_bytes: int
    stream: np.ndarray

    @property
    def bytes_per_token(self) -> float:
        return self.utf8_bytes / len(self.stream)

    def rows(self, sequence_length: int) -> np.ndarray:
        """Row ``i`` is ``stream[i*L : i*L + L + 1]``: a view of the stream, not a copy."""
        count = (len(self.stream) - 1) // sequence_length
        return np.lib.stride_tricks.sliding_window_view(self.stream, sequence_length + 1)[::sequence_length][:count]


def _tokenize(paths: Sequence[Path], tokenizer: Tokenizer, source: str, progress: bool) -> list[tuple[np.ndarray, int]]:
    """(tokens, UTF-8 bytes) of each non-empty document, in order."""
    from tqdm import tqdm

    documents = []
    with tqdm(
        total=len(paths), desc=f"tokenize {source}", unit="doc", file=sys.stderr, mininterval=1.0, disable=not progress
    ) as bar:
        for path in paths:
            text = path.read_bytes().decode("utf-8", errors="replace")
            tokens = tokenizer.encode(text)
            if len(tokens):
                documents.append((tokens, len(text.encode("utf-8"))))
            bar.update(1)
    return documents


def _token_split(name: str, documents: Sequence[tuple[np.ndarray, int]], tokenizer: Tokenizer) -> TokenSplit:
    eod = np.array([tokenizer.eod_id], tokenizer.dtype)
    parts = [part for tokens, _ in documents for part in (tokens, eod)]
    # ids were checked against the vocabulary, which the dtype holds: the cast cannot wrap.
    stream = np.concatenate(parts, dtype=tokenizer.dtype, casting="unsafe") if parts else np.empty(0, tokenizer.dtype)
    return TokenSplit(name, len(documents), sum(size for _, size in documents), stream)


def tokenize_splits(
    source: str, sequence_length: int, tokenizer: Tokenizer, val_fraction: float, seed: int, has_val: bool, progress: bool = True
) -> tuple[TokenSplit, TokenSplit | None]:
    """(training, validation or None) splits of ``source``, split by document; a UserError when a
    split cannot fill one sequence."""
    if sequence_length < 1 or not 0.0 <= val_fraction < 1.0:
        raise UserError(f"sequence_length must be >= 1 (got {sequence_length}) and val_fraction in [0, 1) (got {val_fraction})")
    documents = _tokenize(document_paths(source), tokenizer, source, progress)
    with_val = has_val and val_fraction > 0
    if with_val and len(documents) < 2:
        raise UserError(
            f"{source}: {len(documents)} non-empty document(s); the validation split takes whole "
            "documents, so it needs at least 2: add documents or drop the validation dataset"
        )
    val_count = min(max(round(len(documents) * val_fraction), 1), len(documents) - 1) if with_val else 0
    order = np.random.default_rng(seed).permutation(len(documents))
    train_ids, val_ids = np.sort(order[val_count:]), np.sort(order[:val_count])
    splits = [_token_split("training", [documents[i] for i in train_ids], tokenizer)]
    if with_val:
        splits.append(_token_split("validation", [documents[i] for i in val_ids], tokenizer))
    for split in splits:
        if len(split.stream) <= sequence_length:
            raise UserError(
                f"{source}: the {split.name} split has {len(split.stream):,} tokens from {split.documents} documents, "
                f"but sequence_length {sequence_length} needs at least {sequence_length + 1} for one sequence: "
                f"lower sequence_length, {'lower' if split.name == 'training' else 'raise'} val_fraction or add text"
            )
    return splits[0], (splits[1] if with_val else None)


def token_schema(split: TokenSplit, tokenizer: Tokenizer, sequence_length: int, source: str) -> pa.Schema:
    """The ``tokens`` column and the metadata of one split (every value as bytes)."""
    value_type = pa.uint16() if tokenizer.dtype == np.uint16 else pa.int32()
    metadata = {
        KIND_KEY: TOKEN_SEQUENCES_KIND,
        VOCAB_SIZE_KEY: tokenizer.vocab_size,
        EOD_ID_KEY: tokenizer.eod_id,
        SEQUENCE_LENGTH_KEY: sequence_length,
        TOKENIZER_KEY: tokenizer.name,
        BYTES_PER_TOKEN_KEY: repr(split.bytes_per_token),
        DOCUMENTS_KEY: split.documents,
        SOURCE_KEY: source,
    }
    return pa.schema(
        [pa.field(TOKENS_COLUMN, pa.list_(value_type, sequence_length + 1))],
        metadata={key: value if isinstance(value, bytes) else str(value).encode() for key, value in metadata.items()},
    )


def _row_batches(rows: np.ndarray, order: np.ndarray, schema: pa.Schema) -> Iterator[pa.RecordBatch]:
    list_type = schema.field(TOKENS_COLUMN).type
    for start in range(0, len(order), WRITE_CHUNK_ROWS):
        chunk = rows[order[start : start + WRITE_CHUNK_ROWS]]
        yield pa.record_batch([pa.FixedSizeListArray.from_arrays(pa.array(chunk.reshape(-1)), type=list_type)], schema=schema)


def _write_split(
    rows: np.ndarray, order: np.ndarray, schema: pa.Schema, target: Target, *, rows_per_fragment: int, replace: bool = False
) -> bool:
    """Write ``rows[order]`` to ``target`` as one Lance commit; False when another ingest created
    the dataset first."""
    reader = pa.RecordBatchReader.from_batches(schema, _row_batches(rows, order, schema))
    return write_lance(reader, target, rows_per_fragment=rows_per_fragment, replace=replace)


def ingest_text(
    source: str,
    uri: str,
    val_uri: str | None,
    *,
    sequence_length: int,
    tokenizer: str = "bytes",
    val_fraction: float = 0.1,
    rows_per_fragment: int = 1024,
    seed: int = 0,
    options: dict[str, str] | None = None,
    val_options: dict[str, str] | None = None,
    overwrite: bool = False,
    names: TargetNames | None = None,
) -> Ingested:
    """Tokenize ``source``, pack it into sequences and write the training (and validation) split.
    Everything is tokenized before anything is written, so a failing tokenizer leaves no dataset;
    validation is written before training. What is already at the URIs is treated as by
    :func:`lance_hpc.data.ingest.ingest`."""
    if rows_per_fragment < 1:
        raise UserError("rows_per_fragment must be >= 1")
    names = names or COMMAND_LINE_NAMES
    train_target, val_target = targets(uri, val_uri, options, val_options, names)
    train_found, val_found = find_datasets(train_target, val_target)
    if train_found is not None and not overwrite:
        return Ingested(kept=(uri,))
    loaded = load_tokenizer(tokenizer)
    train, val = tokenize_splits(source, sequence_length, loaded, val_fraction, seed, has_val=bool(val_uri))
    written, kept = {"train": 0, "val": 0}, []
    if val_target is not None and val is not None:
        rows = val.rows(sequence_length)
        if keeps(val_found, val_target, source, overwrite=overwrite, names=names) or not _write_split(
            rows,
            np.arange(len(rows)),
            token_schema(val, loaded, sequence_length, source),
            val_target,
            rows_per_fragment=rows_per_fragment,
            replace=val_found is not None,
        ):
            kept.append(val_target.uri)
        else:
            written["val"] = len(rows)
    rows = train.rows(sequence_length)
    if _write_split(
        rows,
        np.random.default_rng(seed + 1).permutation(len(rows)),
        token_schema(train, loaded, sequence_length, source),
        train_target,
        rows_per_fragment=rows_per_fragment,
        replace=train_found is not None,
    ):
        written["train"] = len(rows)
    else:
        kept.append(train_target.uri)
    return Ingested(written["train"], written["val"], tuple(kept))


def sequences_before_ingest(
    source: str, sequence_length: int, tokenizer: str, val_fraction: float, seed: int, has_val: bool
) -> int:
    """Training rows :func:`ingest_text` would write, for the data plan before the dataset exists."""
    train, _ = tokenize_splits(source, sequence_length, load_tokenizer(tokenizer), val_fraction, seed, has_val, progress=False)
    return len(train.rows(sequence_length))


@dataclass(frozen=True)
class TokenInfo:
    """What the schema metadata of a token-sequence dataset says about its tokens."""

    vocab_size: int
    eod_id: int
    sequence_length: int
    tokenizer: str
    bytes_per_token: float
    documents: int
    source: str

    @classmethod
    def from_metadata(cls, metadata: Mapping[bytes, bytes] | None, uri: str) -> TokenInfo:
        """Read it from a dataset's schema metadata; a UserError when ``uri`` holds no token sequences."""
        metadata = metadata or {}
        if metadata.get(KIND_KEY) != TOKEN_SEQUENCES_KIND:
            raise UserError(
                f"{uri} holds no token sequences (its schema metadata lacks {KIND_KEY.decode()}="
                f"{TOKEN_SEQUENCES_KIND.decode()}): ingest it from text:<glob> or python-stdlib"
            )
        text = {key: value.decode() for key, value in metadata.items()}
        return cls(
            int(text[VOCAB_SIZE_KEY]),
            int(text[EOD_ID_KEY]),
            int(text[SEQUENCE_LENGTH_KEY]),
            text[TOKENIZER_KEY],
            float(text[BYTES_PER_TOKEN_KEY]),
            int(text[DOCUMENTS_KEY]),
            text[SOURCE_KEY],
        )
