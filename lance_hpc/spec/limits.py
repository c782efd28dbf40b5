"""Bounds that the spec and the command line hold an ingest's settings and its sources to, written
once so that ``data.ingest`` and ``lance-hpc ingest`` refuse the same values, and ingest and decode
agree on which images are too big. Nothing here imports another layer."""

from __future__ import annotations

# The most pixels an image may have, at ingest (larger ones are skipped or fail it) and at decode
# (a larger one is a corrupt row): Pillow's default decompression-bomb limit. An image ingest took
# must be one every DataLoader worker can decode, and a few header bytes can declare gigapixels.
MAX_PIXELS = 89_478_485
