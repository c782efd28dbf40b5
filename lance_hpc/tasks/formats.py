"""The datasets the built-in tasks read, as ingest writes them: what their columns and schema
metadata hold. Ingest writes these names and the tasks read them, so both take them from here
(nothing here imports torch, which ingest workers never load).

- An image dataset (``image_classification``): an ``image`` column of encoded bytes, a ``label``
  column, and the class names as JSON under :data:`CLASS_NAMES_KEY`.
- A token-sequence dataset (``language_model``; an ingest of a text source,
  :mod:`lance_hpc.ingest.packing`): one column, :data:`TOKENS_COLUMN`, a fixed-size list of
  ``sequence_length + 1`` uint16 (int32 when the vocabulary does not fit); its schema metadata (the
  other ``*_KEY`` constants) holds what a reader needs, bytes per token included (for bits per byte),
  read back as a :class:`TokenInfo`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from lance_hpc.errors import UserError

# Schema metadata of an image dataset: the class names as JSON (image_classification reads them).
CLASS_NAMES_KEY = b"class_names"

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
