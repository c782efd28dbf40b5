"""Bounds that the spec and the command line hold an ingest's settings and its sources to, written
once so that ``data.ingest`` and ``lance-hpc ingest`` refuse the same values, and ingest and decode
agree on which images are too big. Nothing here imports another layer."""

from __future__ import annotations

# The most pixels an image may have, at ingest (larger ones are skipped or fail it) and at decode
# (a larger one is a corrupt row): Pillow's default decompression-bomb limit. An image ingest took
# must be one every DataLoader worker can decode, and a few header bytes can declare gigapixels.
MAX_PIXELS = 89_478_485
# A record (a WebDataset member, an image-folder or text file) larger than this many MiB is skipped
# or fails the ingest. The default is past any photo or caption; the bound keeps one batch of
# records, however few, within a binary column's 2 GiB of 32-bit offsets.
DEFAULT_RECORD_MB = 64
MAX_RECORD_MB = 1024
# The most fields one WebDataset sample may have (its files' extensions and its JSON's fields):
# each becomes a column, and a tar of a few KB can name tens of thousands.
MAX_SAMPLE_FIELDS = 256
# Tokens per training sequence: each row holds sequence_length + 1 tokens in a fixed-size list
# (at most 2**31 - 1 values), and a fragment's rows are packed in memory before they are written.
MAX_SEQUENCE_LENGTH = 1 << 20
