"""The data plan (``lance-hpc plan job.yaml``, ``--dry-run``) and the preflight check.

Both read metadata only: the manifest's fragment list and row counts, never a data file. A
dataset that ``data.ingest`` has yet to create is planned from the source's size instead.
"""

from __future__ import annotations

from dataclasses import replace

from lance_hpc.ingest.dataset import resolve_source
from lance_hpc.ingest.formats import is_shard_source
from lance_hpc.ingest.plan import estimate_rows, plan_for_data
from lance_hpc.loading.epoch_plan import DataPlan, plan_from_table, spec_plan
from lance_hpc.loading.mix import MixPart, epoch_rows, mix_steps, probabilities, source_name
from lance_hpc.loading.sampling import FragmentTable, eval_batches
from lance_hpc.loading.selection import select_training_rows
from lance_hpc.spec import DataSpec
from lance_hpc.storage.datasets import dataset_exists, open_dataset, preflight_uri
from lance_hpc.storage.integrity import check_data_files
from lance_hpc.storage.options import storage_options


def _table_before_ingest(data: DataSpec) -> FragmentTable:
    """The fragment layout ingest will write for the training split (for a sharded source, estimated
    from a sample of its first shard)."""
    spec = data.ingest
    assert spec is not None
    if is_shard_source(spec.source):
        rows = estimate_rows(plan_for_data(data))["train"]
    else:
        train, official_val = resolve_source(spec.source)
        rows = len(train)
        if official_val is None and data.val_uri:
            rows -= int(round(rows * spec.val_fraction))
    per_fragment = spec.rows_per_fragment
    sizes = [per_fragment] * (rows // per_fragment) + ([rows % per_fragment] if rows % per_fragment else [])
    return FragmentTable.from_rows(sizes)


def plan_data(data: DataSpec, world_size: int) -> DataPlan:
    """One epoch of the job's training data for ``world_size`` ranks, from metadata only."""
    options = storage_options(data.uri, data.storage_options)
    if not dataset_exists(data.uri, options) and data.ingest is not None:
        return spec_plan(
            data, _table_before_ingest(data), world_size, uri=f"{data.uri} (to be ingested from {data.ingest.source})"
        )
    if data.mix is not None:
        return plan_mix(data, world_size)
    _, selection = select_training_rows(data.uri, options, data.version, data.tag, data.filter)
    selected = selection.describe() if data.filter else ""
    return spec_plan(data, selection.table, world_size, uri=data.uri, version=selection.version, selected=selected)


def plan_mix(data: DataSpec, world_size: int) -> DataPlan:
    """The plan of a mix: each source's selected rows and share, then one job epoch's steps."""
    assert data.mix is not None
    selections = []
    for index, source in enumerate(data.mix):
        options = storage_options(
            source.uri, source.storage_options if source.storage_options is not None else data.storage_options
        )
        selections.append(
            select_training_rows(source.uri, options, source.version, source.tag, source.filter, f"data.mix[{index}]")[1]
        )
    parts = [MixPart(selection.table, selection.offsets) for selection in selections]
    rows = epoch_rows(data, parts)
    steps = mix_steps(rows, world_size, data.batch_size)
    drawn = steps * world_size * data.batch_size
    probs = probabilities([source.weight for source in data.mix])
    lines = []
    for index, (source, selection, share) in enumerate(zip(data.mix, selections, probs)):
        epochs = drawn * share / selection.rows
        lines.append(
            f"{source_name(source, index)}: {source.uri} version {selection.version}, {selection.describe()}, "
            f"weight {source.weight:g} ({share:.1%}, ~{share * data.batch_size:.1f} per rank per step), "
            f"{epochs:.2f} of its epochs per job epoch"
        )
    return replace(
        plan_from_table(
            FragmentTable.from_rows([drawn]), world_size, data.batch_size, style=data.style, sampler=data.sampler, uri=data.uri
        ),
        rows=drawn,
        fragments=sum(len(selection.table.rows) for selection in selections),
        sources=tuple(lines),
    )


def describe_eval(data: DataSpec, world_size: int) -> str:
    """One line on the validation split: rows and steps per rank."""
    if not data.val_uri:
        return "  validation  none (data.val_uri is not set)"
    options = storage_options(data.val_uri, data.storage_options)
    if not dataset_exists(data.val_uri, options):
        return f"  validation  {data.val_uri} (to be ingested)"
    rows = open_dataset(data.val_uri, None, options).count_rows()
    steps = [len(eval_batches(rows, rank, world_size, data.batch_size, data.val_sampler)) for rank in {0, world_size - 1}]
    return f"  validation  {rows:,} rows, {data.val_sampler}: {min(steps):,}..{max(steps):,} steps per rank"


def preflight(data: DataSpec) -> None:
    """Raise a UserError with a clear message if the job could not open or read its data:
    unreachable endpoint or bucket, rejected credentials, missing dataset or version, a data file
    missing or cut short. Never prints secrets."""
    may_create = data.ingest is not None
    sources = [(data.uri, data.version, data.storage_options)] if data.mix is None else []
    for source in data.mix or []:
        sources.append(
            (source.uri, source.version, source.storage_options if source.storage_options is not None else data.storage_options)
        )
    for uri, version, store in (*sources, (data.val_uri, None, data.storage_options)):
        if uri:
            options = storage_options(uri, store)
            preflight_uri(uri, options, version, may_create and uri in (data.uri, data.val_uri))
            check_data_files(uri, options, version)
    check_selection(data)


def check_selection(data: DataSpec) -> list[str]:
    """Resolve every tag and filter of the training data once, before any rank starts: a missing
    tag, a filter Lance cannot apply, or one that selects no rows is one clear error here. Returns
    a line per filtered or tagged source."""
    sources = [("data", data.uri, data.version, data.tag, data.filter, data.storage_options)] if data.mix is None else []
    for index, source in enumerate(data.mix or []):
        store = source.storage_options if source.storage_options is not None else data.storage_options
        sources.append((f"data.mix[{index}]", source.uri, source.version, source.tag, source.filter, store))
    lines = []
    for where, uri, version, tag, predicate, store in sources:
        if tag is None and predicate is None:
            continue
        options = storage_options(uri, store)
        if data.ingest is not None and not dataset_exists(uri, options):
            continue  # ingest creates it first; the ranks check it then
        _, selection = select_training_rows(uri, options, version, tag, predicate, where)
        lines.append(
            f"{where}: {uri} version {selection.version}" + (f" (tag {tag!r})" if tag else "") + f", {selection.describe()}"
        )
    return lines
