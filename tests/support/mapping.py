"""Functions a ``job: map`` spec names in the tests (infer.function): plain Python over a batch."""

from __future__ import annotations

import os
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


# When set, image_bytes_with_an_append appends rows to the dataset this names, once per job.
APPEND_TO = "LANCE_HPC_TEST_APPEND_TO"


def image_bytes_with_an_append(batch: pa.RecordBatch) -> dict[str, object]:
    """:func:`image_bytes`, and with ``APPEND_TO`` set, another writer's append of 10 rows while the
    job runs (by whichever rank gets there first: a file created once says it is done)."""
    uri = os.environ.get(APPEND_TO)
    if uri:
        try:
            os.close(os.open(f"{uri}.appended", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return image_bytes(batch)
        import lance

        lance.write_dataset(lance.dataset(uri).to_table().slice(0, 10), uri, mode="append")
    return image_bytes(batch)
