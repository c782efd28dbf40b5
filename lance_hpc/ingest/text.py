"""Token sequences for a language model: the tokenizer and what a dataset's metadata says.

A token-sequence dataset (written by an ingest of a text source, :mod:`lance_hpc.ingest.packing`)
has one column, ``tokens``: a fixed-size list of ``sequence_length + 1`` uint16 (int32 when the
vocabulary does not fit). Its schema metadata (the ``*_KEY`` constants) holds what a reader
needs, bytes per token included (for bits per byte). Tokenizers: ``bytes`` (UTF-8 bytes, EOD 256),
``hf:<tokenizer.json>`` (:mod:`lance_hpc.ingest.tokenizer`) or an import path
``package.module:factory`` returning an object with ``encode(text)``, ``vocab_size`` and optionally
``eod_id``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

import numpy as np

from lance_hpc.errors import UserError
from lance_hpc.imports import is_import_path, load_callable
from lance_hpc.ingest.tokenizer import encoder, load_hf

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
                f"{TOKEN_SEQUENCES_KIND.decode()}): ingest it from text:<glob> or python-stdlib, or another source's text with tokenize: true"
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
