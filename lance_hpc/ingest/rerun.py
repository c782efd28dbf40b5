"""Ingest commits that a rerun recognises in the datasets themselves.

Each split's commit carries the run's id (and the split) in its Lance transaction's properties,
and is recorded beside the dataset as it lands: ``commit-<split>.json`` names the version the
commit is made on before it is made, and the version it made once it has. A process killed at any
point between the commits (or before the ingest's ``committed.json``) leaves a state a rerun reads
back from the datasets: the versions after the recorded one are searched for the transaction that
carries this run's id, so a rerun commits only what is missing and never a split twice.

A record counts only while the dataset still holds what it names: a version recorded as this run's
that the dataset lacks (deleted, rewritten), or a shard's fragment files gone from a split not yet
committed, make the run start over, with the records of its shards discarded.
"""

from __future__ import annotations

import json
from typing import Any, Iterable, Mapping

import pyarrow.fs as pafs

from lance_hpc.ingest.target import Target, filesystem
from lance_hpc.ingest.units import UnitRecords
from lance_hpc.storage.datasets import dataset_exists, open_dataset

RUN_PROPERTY = "lance_hpc.ingest.run"
SPLIT_PROPERTY = "lance_hpc.ingest.split"
COMMITTED_FILE = "committed.json"


def properties(run_id: str, split: str) -> dict[str, str]:
    """The transaction properties of a split's commit: what a rerun looks for."""
    return {RUN_PROPERTY: run_id, SPLIT_PROPERTY: split}


def claim_file(split: str) -> str:
    return f"commit-{split}.json"


def _dataset(target: Target) -> Any | None:
    return open_dataset(target.uri, None, target.options) if dataset_exists(target.uri, target.options) else None


def _carries(dataset: Any, version: int, run_id: str, split: str) -> bool:
    """Whether ``version`` of ``dataset`` is there and was made by this run's commit of ``split``."""
    try:
        transaction = dataset.read_transaction(version)
    except (OSError, ValueError, RuntimeError):  # the version is not there (never was, or cleaned up)
        return False
    found = (transaction.transaction_properties if transaction is not None else None) or {}
    return found.get(RUN_PROPERTY) == run_id and found.get(SPLIT_PROPERTY) == split


def _has_version(dataset: Any, version: int) -> bool:
    try:
        dataset.checkout_version(version)
    except (OSError, ValueError, RuntimeError):
        return False
    return True


def landed(records: UnitRecords[Any], target: Target, run_id: str, split: str) -> int | None:
    """The version this run's commit of ``split`` made, as the dataset shows it; None when the
    commit was never made, did not land, or the dataset no longer holds it."""
    claim = records.read_json(claim_file(split))
    if not isinstance(claim, dict):
        legacy = (records.read_json(COMMITTED_FILE) or {}).get(split)
        if legacy is None:
            return None
        # a record from before commits carried the run's id: its version must still be there
        dataset = _dataset(target)
        return int(legacy) if dataset is not None and _has_version(dataset, int(legacy)) else None
    dataset = _dataset(target)
    if dataset is None:
        return None
    if claim.get("version") is not None:
        version = int(claim["version"])
        return version if _carries(dataset, version, run_id, split) else None
    # Killed between Lance's commit and its record: the commit, if it landed, is after the version it read.
    since = int(claim.get("read_version") or 0)
    for version in range(int(dataset.latest_version), since, -1):
        if _carries(dataset, version, run_id, split):
            return version
    return None


def landed_splits(records: UnitRecords[Any], targets: Mapping[str, Target], run_id: str) -> dict[str, int]:
    """Each split whose commit by this run the datasets hold, with the version it made."""
    found = {split: landed(records, target, run_id, split) for split, target in targets.items()}
    return {split: version for split, version in found.items() if version is not None}


def record_intent(records: UnitRecords[Any], split: str, read_version: int | None) -> None:
    """Before a split's commit: the version it is made on, after which a rerun searches for it."""
    records.write_json(claim_file(split), {"read_version": read_version, "version": None})


def read_version_of(records: UnitRecords[Any], split: str) -> int | None:
    """The version a split's recorded commit was made on (None: it made a new dataset)."""
    claim = records.read_json(claim_file(split))
    found = claim.get("read_version") if isinstance(claim, dict) else None
    return int(found) if found is not None else None


def record_landed(records: UnitRecords[Any], split: str, read_version: int | None, version: int) -> None:
    records.write_json(claim_file(split), {"read_version": read_version, "version": version})


def stale_records(
    records: UnitRecords[Any],
    targets: Mapping[str, Target],
    run_id: str,
    fragments: Mapping[str, Iterable[str]],
) -> list[str]:
    """What the records name that the datasets no longer hold, in a few words each (none: they all
    count). ``fragments``: per split, the Lance JSON of every fragment the shard records name."""
    reasons = []
    committed = records.read_json(COMMITTED_FILE) or {}
    landed_now = landed_splits(records, targets, run_id)
    for split, target in targets.items():
        claim = records.read_json(claim_file(split))
        named = claim.get("version") if isinstance(claim, dict) else None
        named = named if named is not None else committed.get(split)
        if named is not None and landed_now.get(split) != int(named):
            reasons.append(f"{target.uri} version {named}, which is not there")
        elif split not in landed_now:
            missing = _missing_files(target, fragments.get(split, ()))
            if missing:
                reasons.append(f"{len(missing)} fragment file(s) under {target.uri}/data that are not there ({missing[0]})")
    return reasons


def _missing_files(target: Target, fragments: Iterable[str]) -> list[str]:
    """The data files of ``fragments`` (Lance JSON) absent from the target's data folder."""
    wanted = [item["path"] for text in fragments for item in json.loads(text)["files"]]
    if not wanted:
        return []
    store, root = filesystem(f"{target.uri.rstrip('/')}/data", target.options)
    present = {info.base_name for info in store.get_file_info(pafs.FileSelector(root, allow_not_found=True))}
    return [name for name in wanted if name not in present]


def start_over(records: UnitRecords[Any], keep: Iterable[str]) -> int:
    """Discard the run's records except the commits of the splits in ``keep`` (landed and still
    there); returns the number of shard records discarded. Shard records go first and the commit
    records last: a rank that waits for them to go may then start writing shards."""
    try:
        names = [info.base_name for info in records.store.get_file_info(pafs.FileSelector(records.path, allow_not_found=True))]
    except OSError:
        return 0
    kept = {claim_file(split) for split in keep}
    shards = [name for name in names if name.startswith(f"{records.prefix}-") and name.endswith(".json")]
    claims = [name for name in names if name.startswith("commit-") and name.endswith(".json") and name not in kept]
    for name in [*shards, *claims, *([COMMITTED_FILE] if COMMITTED_FILE in names else [])]:
        records.store.delete_file(f"{records.path}/{name}")
    return len(shards)
