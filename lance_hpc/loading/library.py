"""The trainer's data loader for any training script (plain torchrun DDP, Lightning, Accelerate):
:class:`Loader`, built from the keys of a spec's ``data:`` section given as keyword arguments.

It is the trainer's :class:`~lance_hpc.loading.loader.TrainLoader` (same strategies, equal steps on
every rank, resume at any world size or batch size) reading dict batches
(:mod:`lance_hpc.loading.dict_batches`), with a state in torchdata's ``StatefulDataLoader``
protocol that is the same on every rank.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterator, Sequence
from typing import Any

import pyarrow as pa
import torch.distributed as dist
from pydantic import ValidationError

from lance_hpc.errors import UserError
from lance_hpc.loading.loader import STATE_VERSION, build_train_loader, dataset_info
from lance_hpc.spec import DataSpec
from lance_hpc.spec.problems import from_pydantic
from lance_hpc.tasks.columns import ColumnsDecoder, Transform

# What a state must have been read from to continue here: (state key, argument that sets it).
IDENTITY = (("uri", "uri"), ("version", "version"), ("filter", "filter"))


def data_spec(uri: str | None, arguments: dict[str, Any]) -> DataSpec:
    """The ``data:`` section the arguments make, checked as a spec's: every bad argument in one error."""
    given = {name: value for name, value in arguments.items() if value is not None}
    if uri is not None:
        given["uri"] = uri
    try:
        return DataSpec(**given)
    except ValidationError as error:
        problems = [from_pydantic(item, DataSpec) for item in error.errors()]
        lines = [
            f"  {problem.path or 'arguments'}: {problem.message}" + (f"\n      fix: {problem.fix}" if problem.fix else "")
            for problem in problems
        ]
        raise UserError(f"Loader: {len(lines)} bad argument{'s' if len(lines) != 1 else ''}\n" + "\n".join(lines)) from None


def check_columns(data: DataSpec, columns: Sequence[str] | None) -> tuple[tuple[str, ...], pa.Schema]:
    """``columns``, each in every dataset read (all the first dataset's columns when None), and the
    first dataset's schema."""
    uris = [source.uri for source in data.mix] if data.mix else [data.uri]
    schemas = []
    for uri in uris:
        info = dataset_info(data, uri)
        schemas.append(info.schema)
        if columns is None:
            columns = info.schema.names
        missing = [name for name in columns if name not in info.schema.names]
        if missing:
            raise UserError(
                f"Loader: column{'s' if len(missing) > 1 else ''} {', '.join(map(repr, missing))} not in {uri}; "
                f"its columns:{info.describe_columns()}\n  fix: name columns of the dataset in columns=[...]"
            )
    return tuple(columns or ()), schemas[0]


def check_picklable(transform: Transform | None, num_workers: int) -> None:
    """A transform runs in worker processes, so it must travel there by pickle."""
    if transform is None or num_workers == 0:
        return
    try:
        pickle.dumps(transform)
    except Exception as error:
        raise UserError(
            f"Loader: the transform cannot be sent to the worker processes ({type(error).__name__}: {error})\n"
            "  fix: pass a function defined at the top of a module, or an instance of such a class, not a lambda "
            "or a nested function (or num_workers=0)"
        ) from None


def this_rank(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """The rank and world size given, else torch.distributed's when initialised, else a single process."""
    if rank is not None or world_size is not None:
        if rank is None or world_size is None or not 0 <= rank < world_size:
            raise UserError(
                f"Loader: rank={rank}, world_size={world_size}\n  fix: give both, with 0 <= rank < world_size, "
                "or neither (torch.distributed's are used)"
            )
        return rank, world_size
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class Loader:
    """Batches of a Lance dataset for this rank of a training script of your own.

    ``Loader(uri, batch_size=64, columns=[...], transform=None, shuffle=True, seed=0, ...)``: the
    other keyword arguments are the keys of a spec's ``data:`` section (``sampler``, ``style``,
    ``filter``, ``tag``, ``version``, ``mix``, ``storage_options``, ``cache``, ``num_workers``,
    ``prefetch_factor``, ``io_depth``, ``uneven``, ...; docs: own-script.md), checked as a spec's.
    The rank and world size are torch.distributed's when it is initialised (or ``rank=`` and
    ``world_size=``); a single process otherwise.

    Iterating gives one epoch of :func:`len` batches, the same number on every rank. A batch is a
    dict of the columns (numbers and fixed-size lists of numbers as tensors, the rest as lists) and
    ``row_id``, or what ``transform`` (a picklable callable, run in the worker processes) returns.
    :meth:`set_epoch` selects the epoch's order; :meth:`state_dict` and :meth:`load_state_dict`
    follow torchdata's ``StatefulDataLoader``.
    """

    def __init__(
        self,
        uri: str | None = None,
        *,
        batch_size: int = 64,
        columns: Sequence[str] | None = None,
        transform: Transform | None = None,
        shuffle: bool = True,
        seed: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
        pin_memory: bool = False,
        **data: Any,
    ) -> None:
        self.data = data_spec(uri, {"batch_size": batch_size, "shuffle": shuffle, "seed": seed, **data})
        self.columns, schema = check_columns(self.data, columns)
        check_picklable(transform, self.data.num_workers)
        self.rank, self.world_size = this_rank(rank, world_size)
        decoder = ColumnsDecoder(self.columns, transform, schema)
        self._loader = build_train_loader(self.data, decoder, self.rank, self.world_size, pin_memory=pin_memory)

    def __len__(self) -> int:
        """Batches of an epoch (steps per epoch), the same on every rank."""
        return self._loader.steps_per_epoch

    # Frameworks set a DataLoader's epoch through its sampler: Lightning's fit loop calls
    # ``loader.sampler.set_epoch(epoch)`` (else ``loader.batch_sampler.sampler``) on every train
    # dataloader at each epoch's start, a resumed one included. Without these the order would never change.
    batch_sampler = None

    @property
    def sampler(self) -> Loader:
        """This loader, whose :meth:`set_epoch` a framework reaches as a DataLoader's sampler's."""
        return self

    @property
    def epoch(self) -> int:
        """The epoch the next pass reads (a restored state's, until :meth:`set_epoch` selects another)."""
        return self._loader.epoch

    def set_epoch(self, epoch: int) -> None:
        """Read ``epoch``'s order next (shuffled from seed + epoch); a restored epoch keeps its position."""
        self._loader.set_epoch(epoch)

    def __iter__(self) -> Iterator[Any]:
        """One epoch's batches (the rest of it, after :meth:`load_state_dict`)."""
        return iter(self._loader)

    def state_dict(self) -> dict[str, Any]:
        """Where the loop is: the epoch and the batches handed out, the same on every rank (rank 0's
        is enough), of plain ints, strings and lists (JSON-able)."""
        return {**self._loader.state_dict(), "seed": self.data.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``, saved at any world size or batch size: the next pass starts at
        the first batch not yet handed out, and every row of the epoch is read once."""
        pinned = state.get("pinned") if isinstance(state, dict) else None
        sources = pinned.get("sources", []) if isinstance(pinned, dict) else None
        if (
            not isinstance(state, dict)
            or state.get("version") != STATE_VERSION
            or not isinstance(sources, list)
            or not all(isinstance(source, dict) for source in sources)
        ):
            raise UserError(
                "Loader: this is not a state of lance_hpc.Loader's state_dict()\n  fix: pass what state_dict() returned"
            )
        differ = self._differences(state)
        if differ:
            raise UserError(
                "Loader: the state was saved reading other data: "
                + "; ".join(differ)
                + "\n  fix: build the Loader with the values the state was saved with, or start without the state"
            )
        try:
            self._loader.load_state_dict(state)
        except (KeyError, TypeError, ValueError) as error:  # a state edited or cut short
            raise UserError(
                f"Loader: the state is incomplete or damaged ({type(error).__name__}: {error})\n"
                "  fix: pass what state_dict() returned, unchanged"
            ) from None

    def _differences(self, state: dict[str, Any]) -> list[str]:
        """What the state read that this loader does not: dataset, version, filter, seed."""
        saved, here = state["pinned"], self._loader.pinned
        differ = []
        if "sources" in here or "sources" in saved:
            mine = [[source.get(key) for key, _ in IDENTITY] for source in here.get("sources", ())]
            theirs = [[source.get(key) for key, _ in IDENTITY] for source in saved.get("sources", ())]
            if mine != theirs:
                differ.append(f"mix= (uri, version, filter of each source) was {theirs}, is {mine}")
        else:
            differ += [
                f"{argument}= was {saved.get(key)!r}, is {here.get(key)!r}"
                for key, argument in IDENTITY
                if saved.get(key) != here.get(key)
            ]
        if state.get("seed") != self.data.seed:
            differ.append(f"seed= was {state.get('seed')!r}, is {self.data.seed!r}")
        return differ
