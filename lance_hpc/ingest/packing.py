"""Documents into fixed-length token sequences, as a shard is read: the text half of an ingest job.

Each document is tokenised and followed by the end-of-document (EOD) token; a split's documents
within one shard make one stream, and row ``i`` of it holds ``stream[i*L : i*L + L + 1]``
(``L = sequence_length``), so consecutive rows overlap by one token and inputs ``tokens[:-1]`` /
targets ``tokens[1:]`` lose no target. Rows are cut as soon as a fragment's worth is ready, so a
worker holds at most one fragment of tokens per split, whatever the corpus size; the tokens after
a shard's last full row (fewer than ``L + 1``) are not written. The figures a reader needs
(vocabulary, EOD, documents, bytes per token) are counted per shard and combined at the commit.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from lance_hpc.errors import UserError
from lance_hpc.ingest.tokenizer import Tokenizer
from lance_hpc.tasks.formats import (
    BYTES_PER_TOKEN_KEY,
    DOCUMENTS_KEY,
    EOD_ID_KEY,
    KIND_KEY,
    SEQUENCE_LENGTH_KEY,
    SOURCE_KEY,
    TOKEN_SEQUENCES_KIND,
    TOKENIZER_KEY,
    TOKENS_COLUMN,
    VOCAB_SIZE_KEY,
)


@dataclass(frozen=True)
class Tokens:
    """How a text source becomes token sequences: the tokenizer and the sequence length."""

    tokenizer: str
    sequence_length: int


class Packer:
    """One split's token stream within one shard, cut into rows as it grows."""

    def __init__(self, tokenizer: Tokenizer, sequence_length: int) -> None:
        self.tokenizer, self.length = tokenizer, sequence_length
        self.eod = np.array([tokenizer.eod_id], tokenizer.dtype)
        self.pending: list[np.ndarray] = []
        self.pending_tokens = 0
        self.documents = 0
        self.utf8_bytes = 0
        self.tokens = 0  # the whole stream's, EOD tokens included: bytes per token is utf8_bytes / tokens

    def add(self, text: str) -> None:
        ids = self.tokenizer.encode(text)
        if not len(ids):
            return
        # ids were checked against the vocabulary, which the dtype holds: the cast cannot wrap.
        self.pending += [ids.astype(self.tokenizer.dtype, casting="unsafe", copy=False), self.eod]
        self.pending_tokens += len(ids) + 1
        self.tokens += len(ids) + 1
        self.documents += 1
        self.utf8_bytes += len(text.encode("utf-8"))

    def ready(self) -> int:
        """Full rows the stream holds now."""
        return max(self.pending_tokens - 1, 0) // self.length

    def take(self, rows: int) -> np.ndarray:
        """The next ``rows`` rows (``[rows, L + 1]``); the stream keeps what follows, starting with
        the last row's final token."""
        stream = np.concatenate(self.pending) if len(self.pending) > 1 else self.pending[0]
        cut = rows * self.length
        taken = np.lib.stride_tricks.sliding_window_view(stream[: cut + 1], self.length + 1)[:: self.length].copy()
        rest = stream[cut:]
        self.pending, self.pending_tokens = [rest], len(rest)
        return taken


def token_schema(tokenizer: Tokenizer, sequence_length: int, source: str) -> pa.Schema:
    """The ``tokens`` column and what every split's metadata shares; :func:`with_split_figures` adds
    a split's own figures at the commit."""
    value_type = pa.uint16() if tokenizer.dtype == np.uint16 else pa.int32()
    metadata = {
        KIND_KEY: TOKEN_SEQUENCES_KIND,
        VOCAB_SIZE_KEY: tokenizer.vocab_size,
        EOD_ID_KEY: tokenizer.eod_id,
        SEQUENCE_LENGTH_KEY: sequence_length,
        TOKENIZER_KEY: tokenizer.name,
        SOURCE_KEY: source,
    }
    return pa.schema(
        [pa.field(TOKENS_COLUMN, pa.list_(value_type, sequence_length + 1))],
        metadata={key: value if isinstance(value, bytes) else str(value).encode() for key, value in metadata.items()},
    )


def with_split_figures(schema: pa.Schema, documents: int, utf8_bytes: int, tokens: int) -> pa.Schema:
    metadata = dict(schema.metadata or {})
    metadata[DOCUMENTS_KEY] = str(documents).encode()
    metadata[BYTES_PER_TOKEN_KEY] = repr(utf8_bytes / tokens if tokens else 0.0).encode()
    return schema.with_metadata(metadata)


def rows_batch(rows: np.ndarray, schema: pa.Schema) -> pa.RecordBatch:
    list_type = schema.field(TOKENS_COLUMN).type
    return pa.record_batch([pa.FixedSizeListArray.from_arrays(pa.array(rows.reshape(-1)), type=list_type)], schema=schema)


def too_short(split: str, tokens: int, documents: int, sequence_length: int, where: str) -> UserError:
    name = "validation" if split == "val" else "training"
    return UserError(
        f"{where}: the {name} split has {tokens:,} tokens from {documents} documents, which fill no sequence of "
        f"{sequence_length + 1} tokens within a shard\n"
        f"  fix: lower sequence_length, {'lower' if split == 'train' else 'raise'} val_fraction, raise files_per_shard "
        "or add text"
    )
