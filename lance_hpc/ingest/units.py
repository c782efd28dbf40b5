"""The records that make a job of many workers resumable: one small JSON file per finished unit of
work (an ingest's shard, an inference's fragment), in a run's folder beside the dataset, plus a few
named files (the version an inference pinned, the commit).

Every file is written whole or not at all: one PUT on an object store; locally a temporary file,
fsynced and renamed into place (:func:`lance_hpc.storage.files.write_file`). A rerun reads what is
there and does only the units without a record.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Generic, Mapping, TypeVar

import pyarrow.fs as pafs

from lance_hpc.ingest.target import filesystem
from lance_hpc.storage.files import write_file

Record = TypeVar("Record")


def balanced(sizes: list[int], world_size: int) -> list[list[int]]:
    """Unit indices per worker: the biggest unit first, each to the worker with the least so far
    (ties to the lowest rank); each worker's list in the units' own order. The same on every worker."""
    loads = [0] * world_size
    mine: list[list[int]] = [[] for _ in range(world_size)]
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        worker = min(range(world_size), key=lambda w: (loads[w], w))
        loads[worker] += max(sizes[index], 1)
        mine[worker].append(index)
    return [sorted(indices) for indices in mine]


class UnitRecords(Generic[Record]):
    """``<prefix>-<index>.json`` files of one run, each a ``record_type`` dataclass."""

    def __init__(self, run: str, options: Mapping[str, str], prefix: str, record_type: type[Record]) -> None:
        self.store, self.path = filesystem(run, options)
        self.prefix, self.record_type = prefix, record_type

    def write_json(self, name: str, payload: Any) -> None:
        self.store.create_dir(self.path, recursive=True)
        final = f"{self.path}/{name}"
        if isinstance(self.store, pafs.LocalFileSystem):  # fsynced too: a record outlives a crash of the node
            write_file(Path(final), json.dumps(payload))
            return
        partial = f"{final}.{os.getpid()}-{uuid.uuid4().hex[:8]}.partial"
        with self.store.open_output_stream(partial) as handle:
            handle.write(json.dumps(payload).encode())
        self.store.move(partial, final)

    def read_json(self, name: str) -> Any:
        """The file's content; None when it is not there (yet)."""
        try:
            with self.store.open_input_stream(f"{self.path}/{name}") as handle:
                return json.loads(handle.read())
        except (FileNotFoundError, OSError):
            return None

    def write(self, index: int, record: Record) -> None:
        self.write_json(self._name(index), asdict(record))  # type: ignore[call-overload]

    def forget(self, index: int) -> None:
        """Drop one unit's record: the unit is done again."""
        self.store.delete_file(f"{self.path}/{self._name(index)}")

    def _name(self, index: int) -> str:
        return f"{self.prefix}-{index:06d}.json"

    def finished(self, known: dict[int, Record] | None = None) -> dict[int, Record]:
        """Every recorded unit by index; records already in ``known`` are not read again."""
        try:
            infos = self.store.get_file_info(pafs.FileSelector(self.path, allow_not_found=True))
        except OSError:
            return dict(known or {})
        found = {}
        start, end = f"{self.prefix}-", ".json"
        for info in infos:
            name = info.base_name
            if info.type == pafs.FileType.File and name.startswith(start) and name.endswith(end):
                index = int(name[len(start) : -len(end)])
                found[index] = known[index] if known and index in known else self.record_type(**self.read_json(name))
        return found


def wait_for_all(records: UnitRecords[Any], total: int, stopped: Callable[[], bool], unit: str, poll_s: float = 2.0) -> bool:
    """Rank 0 before its commit: wait until all ``total`` units are recorded (True), or ``stopped()``
    (False), saying how many are in whenever that changes. Only records not seen yet are read."""
    shown, known = -1, records.finished()
    while True:
        known = records.finished(known)
        if len(known) == total:
            return True
        if stopped():
            return False
        if len(known) != shown:
            print(f"rank 0: {len(known)}/{total} {unit}s written; waiting for the other ranks", flush=True)
            shown = len(known)
        time.sleep(poll_s)
