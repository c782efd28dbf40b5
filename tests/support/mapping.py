"""Functions a ``job: map`` spec names in the tests (infer.function): plain Python over a batch."""

from __future__ import annotations

import time

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc


def image_bytes(batch: pa.RecordBatch) -> dict[str, object]:
    """Each row's encoded image size (a pyarrow array) and its label's one-hot vector (numpy, 2-D)."""
    labels = batch.column("label").to_numpy()
    return {"image_bytes": pc.binary_length(batch.column("image")), "one_hot": np.eye(10, dtype=np.float32)[labels]}


def slow_image_bytes(batch: pa.RecordBatch) -> dict[str, object]:
    """:func:`image_bytes`, a fifth of a second per batch: time to kill a rank mid-way."""
    time.sleep(0.2)
    return image_bytes(batch)


def odd_labels_only(batch: pa.RecordBatch) -> dict[str, object]:
    """Twice the label where it is odd, null where it is even (a pyarrow array with nulls)."""
    labels = batch.column("label").to_pylist()
    return {"odd_twice": pa.array([2 * label if label % 2 else None for label in labels], pa.int64())}


def fails_on_a_seven(batch: pa.RecordBatch) -> dict[str, object]:
    """:func:`image_bytes`, raising the user's own error on a batch that holds the first row whose label is 7."""
    labels = batch.column("label").to_pylist()
    if FAILING_LABEL in labels:
        raise ValueError(f"cannot size a {FAILING_LABEL}")
    return image_bytes(batch)


FAILING_LABEL = 7
