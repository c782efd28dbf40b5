"""Reading a W&B offline run file (``run-<id>.wandb``) back, for the tracker tests.

The file is a log of protobuf ``Record`` messages in LevelDB's log framing: after a 7-byte file
header, 32 KiB blocks of chunks, each a 7-byte header (checksum, length, kind) and its bytes; a
record is one FULL chunk or a FIRST, MIDDLE... and LAST chunk.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

BLOCK = 32 * 1024
CHUNK_HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def chunks_to_records(data: bytes) -> Iterator[bytes]:
    assert data[:4] == b":W&B", "not a W&B run file"
    position, pieces = 7, []
    while position + CHUNK_HEADER <= len(data):
        left = BLOCK - position % BLOCK
        if left < CHUNK_HEADER:  # the block's tail is padding
            position += left
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + CHUNK_HEADER])
        if length == 0 and kind == 0:
            position += left
            continue
        payload = data[position + CHUNK_HEADER : position + CHUNK_HEADER + length]
        position += CHUNK_HEADER + length
        if kind == FULL:
            yield payload
        elif kind == FIRST:
            pieces = [payload]
        elif kind in (MIDDLE, LAST):
            pieces.append(payload)
            if kind == LAST:
                yield b"".join(pieces)


def read_run(path: Path) -> dict[str, Any]:
    """{"run": (id, name, group), "history": [{key: value}], "config": {key: value}} of a run file."""
    import json

    from wandb.proto import wandb_internal_pb2 as pb

    run: dict[str, Any] = {"history": [], "config": {}}
    for data in chunks_to_records(path.read_bytes()):
        record = pb.Record()
        record.ParseFromString(data)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run["run"] = (record.run.run_id, record.run.display_name, record.run.run_group)
        elif kind == "history":
            run["history"].append(
                {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            )
        elif kind == "config":
            run["config"].update(
                {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.config.update}
            )
    return run
