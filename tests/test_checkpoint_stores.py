"""One interface for checkpoint stores: every store implements all of it and behaves the same
through it, and nothing outside the stores asks which kind of store it holds."""

from __future__ import annotations

import ast
import uuid
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import lance_hpc
from lance_hpc.checkpoint.lease.holders import this_process
from lance_hpc.checkpoint.shards import reading
from lance_hpc.checkpoint.stores import STORES, LocalDirectory, ObjectStore, Store, open_store
from lance_hpc.checkpoint.weights import load_weights
from lance_hpc.errors import UserError
from lance_hpc.storage.files import Refused

PACKAGE = Path(lance_hpc.__file__).parent
STORES_PACKAGE = PACKAGE / "checkpoint" / "stores"
# The store types, and the pieces of a store only it may choose between: its lease and its DCP files.
STORE_TYPES = frozenset({"Store", "LocalDirectory", "ObjectStore", "LeaseFile", "LeaseObject", "ObjectFiles"})


@pytest.mark.parametrize("kind", [LocalDirectory, ObjectStore])
def test_every_store_implements_every_method_of_the_interface(kind: type[Store]) -> None:
    assert issubclass(kind, Store) and not kind.__abstractmethods__
    inherited = sorted(name for name in Store.__abstractmethods__ if name not in vars(kind))
    assert not inherited, f"{kind.__name__} leaves {inherited} to the interface"
    assert isinstance(kind.needs_flush, bool)


def test_every_scheme_of_checkpoint_dir_opens_a_store() -> None:
    assert all(isinstance(make, type) and issubclass(make, Store) for make in STORES.values())
    assert isinstance(open_store("s3://bucket/runs/a/"), ObjectStore)
    assert isinstance(open_store("/tmp/runs/a"), LocalDirectory)


def store_type_checks(source: str, where: str = "<source>") -> list[str]:
    """``where:line`` of each isinstance or issubclass in ``source`` that names a store type."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and len(node.args) == 2):
            continue
        if node.func.id not in ("isinstance", "issubclass"):
            continue
        kinds = node.args[1].elts if isinstance(node.args[1], ast.Tuple) else [node.args[1]]
        names = {
            kind.id if isinstance(kind, ast.Name) else kind.attr for kind in kinds if isinstance(kind, (ast.Name, ast.Attribute))
        }
        if names & STORE_TYPES:
            found.append(f"{where}:{node.lineno}")
    return found


def test_only_the_stores_ask_which_kind_of_store_they_hold() -> None:
    """Whatever depends on the kind of store is a method of the store: a check of the type elsewhere
    is a branch that a third store would have to find."""
    sample = "isinstance(store, stores.ObjectStore)\nisinstance(x, (int, LocalDirectory))\nisinstance(x, dict)\nlen(x)\n"
    assert store_type_checks(sample) == ["<source>:1", "<source>:2"]
    found = [
        check
        for path in sorted(PACKAGE.rglob("*.py"))
        if STORES_PACKAGE not in path.parents
        for check in store_type_checks(path.read_text(), str(path.relative_to(PACKAGE.parent)))
    ]
    assert not found, "checks of a store's type outside lance_hpc/checkpoint/stores/: " + ", ".join(found)


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.s3)])
def store(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Store:
    """An empty checkpoint.dir of each kind."""
    if request.param == "local":
        return open_store(tmp_path / "checkpoints")
    server = request.getfixturevalue("s3_server")
    for key, value in {**server.env, "AWS_ENDPOINT_URL": server.endpoint}.items():
        monkeypatch.setenv(key, value)
    return open_store(server.uri(f"runs/{uuid.uuid4().hex[:8]}/"))


def test_every_store_keeps_files_shards_and_its_lease_the_same_way(store: Store) -> None:
    assert store.names() == [] and store.shard_directories() == []
    store.write("step-00000001.pt", {"step": 1, "weight": torch.ones(3)})
    store.write_bytes("step-00000001.json", b"{}")
    assert sorted(store.names()) == ["step-00000001.json", "step-00000001.pt"]
    assert str(store.location("step-00000001.pt")).endswith("/step-00000001.pt")
    assert torch.equal(store.read("step-00000001.pt")["weight"], torch.ones(3))
    assert store.read_bytes("step-00000001.json", 2) == b"{}"
    with pytest.raises(Refused, match="larger than 10 bytes"):
        store.read_bytes("step-00000001.pt", 10)
    with pytest.raises(FileNotFoundError):  # gone: both stores say so alike (a manifest an old save lacks)
        store.read_bytes("step-00000002.json", 10)

    shards = "step-00000001.dcp"
    dcp.save({"model": {"w": torch.arange(4.0)}}, storage_writer=store.shard_writer(shards, synced=False), no_dist=True)
    store.flush_shards(shards)
    assert store.shard_directories() == [shards]
    assert sorted(store.names()) == ["step-00000001.json", "step-00000001.pt"]  # a shard directory is not a file
    loaded = {"model": {"w": torch.zeros(4)}}
    reading.load(loaded, store.shard_reader(shards), no_dist=True)
    assert torch.equal(loaded["model"]["w"], torch.arange(4.0))
    with pytest.raises(UserError, match="refusing checkpoint file"):
        store.shard_reader("../elsewhere")
    store.delete_shards(shards)
    store.delete_shards(shards)  # gone already: nothing to do
    assert store.shard_directories() == []

    store.delete("step-00000001.json")
    store.delete("step-00000001.json")
    assert store.names() == ["step-00000001.pt"]

    leases = store.lease()
    record = this_process(None, 0).encode()
    assert leases.read() is None and leases.claim(None, record)
    snapshot = leases.read()
    assert snapshot is not None and snapshot.payload == record
    assert not leases.claim(None, this_process(None, 0).encode())  # taken: another taker loses
    leases.remove(snapshot)
    assert leases.read() is None


def test_initial_weights_come_from_a_state_dict_or_from_a_checkpoints_model(tmp_path: Path) -> None:
    """task.options.weights names either; only the checkpoint package reads a checkpoint's layout."""
    model = torch.nn.Linear(3, 2)
    plain, checkpoint, earlier = tmp_path / "plain.pt", tmp_path / "step-00000004.pt", tmp_path / "earlier.pt"
    torch.save(model.state_dict(), plain)
    open_store(tmp_path).write(checkpoint.name, {"step": 4, "objects": {"model": model.state_dict(), "optimizer": {}}})
    torch.save({"model": model.state_dict(), "optimizer": {}}, earlier)  # the earlier built-in trainer's layout
    for path in (plain, checkpoint, earlier):
        fresh = torch.nn.Linear(3, 2)
        load_weights(fresh, str(path))
        assert torch.equal(fresh.weight, model.weight), path
    with pytest.raises(UserError, match="does not fit this model"):
        load_weights(torch.nn.Linear(3, 5), str(checkpoint))
