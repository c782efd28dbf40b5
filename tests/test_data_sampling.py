"""Property tests of the pure planning layer: every strategy, world sizes 1..8, any fragment layout.

What they prove: equal step counts on every rank (the DDP hang of the reference example cannot
happen), exactly-once coverage matching the reported drop/pad counts, determinism per seed+epoch
and a new order per epoch, and that a resumed epoch continues exactly (worker split included),
also when it is resumed on other world sizes and batch sizes, any number of times.
"""

import collections
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from lance_hpc.loading.epoch_plan import plan_from_table
from lance_hpc.loading.resume import EpochOrigin, ResumedEpoch, Segment, remainder_share_rows, rows_read
from lance_hpc.loading.sampling import (
    BlockPlan,
    FragmentTable,
    epoch_batches,
    eval_batches,
    rank_share,
    read_hints,
    runs_of,
    worker_steps,
)

TRAIN_SAMPLERS = ("distributed", "block", "sharded_batch", "sharded_fragment")
REFERENCE_LAYOUT = [12_500] * 6 + [750]  # the reference example's Food101 train set


def scaled(layout, divisor):
    return [max(1, rows // divisor) for rows in layout]


fragment_layouts = st.one_of(
    st.lists(st.integers(1, 60), min_size=1, max_size=12),
    st.sampled_from([scaled(REFERENCE_LAYOUT, 50), scaled(REFERENCE_LAYOUT, 125), scaled(REFERENCE_LAYOUT, 500)]),
    st.builds(lambda n, rows, last: [rows] * n + [last], st.integers(1, 8), st.integers(5, 40), st.integers(1, 5)),
)
property_settings = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def all_ranks(layout, sampler, world_size, batch_size, uneven="drop", shuffle=True, seed=0, epoch=0):
    table = FragmentTable.from_rows(layout)
    return [
        epoch_batches(table, sampler, rank, world_size, batch_size, uneven=uneven, shuffle=shuffle, seed=seed, epoch=epoch)
        for rank in range(world_size)
    ]


@property_settings
@given(
    layout=fragment_layouts,
    sampler=st.sampled_from(TRAIN_SAMPLERS),
    world_size=st.integers(1, 8),
    batch_size=st.integers(1, 48),
    uneven=st.sampled_from(["drop", "pad"]),
    shuffle=st.booleans(),
    seed=st.integers(-5, 2**40),
    epoch=st.integers(0, 50),
)
def test_equal_steps_and_exactly_once_coverage(layout, sampler, world_size, batch_size, uneven, shuffle, seed, epoch):
    ranks = all_ranks(layout, sampler, world_size, batch_size, uneven, shuffle, seed, epoch)
    plan = plan_from_table(FragmentTable.from_rows(layout), world_size, batch_size, sampler=sampler, uneven=uneven)
    total = sum(layout)
    # Equal steps, and equal batch sizes at every step: no rank can wait alone in an all-reduce.
    assert {len(batches) for batches in ranks} == {plan.steps_per_rank}
    for step in range(plan.steps_per_rank):
        sizes = {len(batches[step]) for batches in ranks}
        assert len(sizes) == 1 and 1 <= sizes.pop() <= batch_size
    assert all(sum(map(len, batches)) == plan.rows_per_rank for batches in ranks)
    counts = collections.Counter(int(row) for batches in ranks for batch in batches for row in batch)
    assert all(0 <= row < total for row in counts)
    if uneven == "drop":
        # Every row at most once; the ones missing are exactly the reported dropped rows.
        assert max(counts.values(), default=1) == 1
        assert total - len(counts) == plan.dropped < world_size
        assert plan.padded == 0
    else:
        # Every row at least once; the repeats are exactly the reported padded rows.
        assert len(counts) == total
        assert sum(counts.values()) - total == plan.padded
        assert plan.dropped == 0
        assert all(len(batch) == batch_size for batches in ranks for batch in batches)


@property_settings
@given(
    layout=fragment_layouts,
    sampler=st.sampled_from(TRAIN_SAMPLERS + ("full_scan",)),
    world_size=st.integers(1, 8),
    batch_size=st.integers(1, 16),
    seed=st.integers(0, 1000),
    epoch=st.integers(0, 50),
)
def test_same_order_for_same_seed_and_epoch_new_order_for_new_epoch(layout, sampler, world_size, batch_size, seed, epoch):
    first = all_ranks(layout, sampler, world_size, batch_size, seed=seed, epoch=epoch)
    again = all_ranks(layout, sampler, world_size, batch_size, seed=seed, epoch=epoch)
    assert all(np.array_equal(a, b) for ra, rb in zip(first, again) for a, b in zip(ra, rb))
    # What a strategy can permute: rows, whole blocks of batch_size rows, or fragments.
    units = {
        "distributed": sum(layout) if sum(layout) // world_size else 0,
        "block": sum(layout) if sum(layout) // world_size else 0,  # runs of one row by default
        "full_scan": sum(layout),
        "sharded_batch": sum(layout) // batch_size,
        "sharded_fragment": len(layout),
    }[sampler]
    assume(units >= 4 and rank_share(sum(layout), world_size, batch_size, "drop").rows_per_rank >= 2)
    flat = lambda ranks: [int(row) for batches in ranks for batch in batches for row in batch]  # noqa: E731
    later = [flat(all_ranks(layout, sampler, world_size, batch_size, seed=seed, epoch=epoch + k)) for k in range(1, 6)]
    assert any(order != flat(first) for order in later)


def test_global_numpy_random_state_is_untouched():
    np.random.seed(123)
    before = np.random.get_state()[1].copy()
    for sampler in TRAIN_SAMPLERS:
        all_ranks([17, 5, 30], sampler, 3, 4, epoch=2)
    assert np.array_equal(np.random.get_state()[1], before)


@property_settings
@given(
    layout=fragment_layouts,
    sampler=st.sampled_from(TRAIN_SAMPLERS),
    world_size=st.integers(1, 8),
    batch_size=st.integers(1, 16),
    num_workers=st.integers(1, 4),
    data=st.data(),
)
def test_resume_from_any_step_continues_exactly(layout, sampler, world_size, batch_size, num_workers, data):
    table = FragmentTable.from_rows(layout)
    rank = data.draw(st.integers(0, world_size - 1))
    batches = epoch_batches(table, sampler, rank, world_size, batch_size, seed=7, epoch=3)
    start = data.draw(st.integers(0, len(batches)))
    # A fresh process plans the same epoch again and its workers split the rest between them.
    replanned = epoch_batches(table, sampler, rank, world_size, batch_size, seed=7, epoch=3)
    per_worker = [[replanned[i] for i in worker_steps(len(replanned), start, w, num_workers)] for w in range(num_workers)]
    # The DataLoader takes one batch from each worker in turn.
    merged = []
    for round_index in range(max(map(len, per_worker), default=0)):
        merged += [worker[round_index] for worker in per_worker if round_index < len(worker)]
    assert [b.tolist() for b in batches[:start]] + [b.tolist() for b in merged] == [b.tolist() for b in batches]


@property_settings
@given(
    layout=fragment_layouts,
    sampler=st.sampled_from(TRAIN_SAMPLERS),
    uneven=st.sampled_from(["drop", "pad"]),
    shuffle=st.booleans(),
    first=st.tuples(st.integers(1, 8), st.integers(1, 16)),
    resumes=st.lists(st.tuples(st.integers(1, 8), st.integers(1, 16)), min_size=1, max_size=3),
    data=st.data(),
)
def test_an_epoch_resumed_on_other_world_sizes_reads_every_planned_row_once(
    layout, sampler, uneven, shuffle, first, resumes, data
):
    """Saved on 1..8 ranks at any step, resumed on 1..8 ranks (with any batch size), perhaps cut
    and resumed again: every rank takes the same steps, no batch exceeds its batch size, and the
    rows read over all segments are exactly the rows the epoch was planned with."""
    table = FragmentTable.from_rows(layout)
    world_size, batch_size = first
    assume(rank_share(table.total_rows, world_size, batch_size, uneven).steps > 0)
    origin = EpochOrigin(sampler, uneven, shuffle, seed=11, epoch=4)
    planned = collections.Counter(
        row
        for rank in range(world_size)
        for batch in epoch_batches(table, sampler, rank, world_size, batch_size, uneven=uneven, shuffle=shuffle, seed=11, epoch=4)
        for row in batch.tolist()
    )
    read: collections.Counter = collections.Counter()
    repeated: collections.Counter = collections.Counter()
    segments: list[Segment] = []
    layouts = [first, *resumes]
    for index, (world_size, batch_size) in enumerate(layouts):
        epoch = ResumedEpoch(origin, (*segments, Segment(world_size, batch_size, 0)))
        per_rank = [epoch.batches(table, rank) for rank in range(world_size)]
        steps = len(per_rank[0])
        assert all(len(batches) == steps for batches in per_rank)  # equal steps on every rank
        # one row more only for a batch of 1 whose rows do not split evenly (a row is never left out)
        assert all(0 < len(batch) <= max(batch_size, 2 if batch_size == 1 else 0) for batches in per_rank for batch in batches)
        last = index == len(layouts) - 1
        consumed = steps if last else data.draw(st.integers(0, steps))
        total, before = epoch.epoch_rows(table), epoch.rows_before(table)
        shares = np.full(world_size, total // world_size) if index == 0 else remainder_share_rows(total - before, world_size)
        for rank, batches in enumerate(per_rank):
            # a rank with no share of its own (fewer rows left than ranks) repeats rows
            counter = read if shares[rank] else repeated
            for batch in batches[:consumed]:
                counter.update(batch.tolist())
        assert before + rows_read(shares, steps, batch_size, index > 0, consumed) == sum(read.values())
        segments.append(Segment(world_size, batch_size, consumed))
    assert read == planned and sum(repeated.values()) < 8 * len(resumes)


@property_settings
@given(
    layout=fragment_layouts,
    world_size=st.integers(1, 8),
    batch_size=st.integers(1, 16),
    uneven=st.sampled_from(["drop", "pad"]),
    run_rows=st.integers(1, 12),
    window_runs=st.integers(1, 6),
    num_workers=st.integers(1, 4),
    epoch=st.integers(0, 20),
)
def test_block_reads_whole_runs_one_window_per_worker_with_equal_steps(
    layout, world_size, batch_size, uneven, run_rows, window_runs, num_workers, epoch
):
    """sampler: block: equal steps and exactly-once coverage like every strategy; each batch lies in
    one window, each window is read by one DataLoader worker only (the one the DataLoader deals its
    batches to), and a run is split only where a window, a worker's part or a rank's share ends, so
    the reads of an epoch (a window's runs, one request each) number at most the runs plus those
    cuts: about one read per run."""
    table = FragmentTable.from_rows(layout)
    options = dict(uneven=uneven, seed=5, epoch=epoch, num_workers=num_workers, run_rows=run_rows, window_runs=window_runs)
    ranks = [epoch_batches(table, "block", rank, world_size, batch_size, **options) for rank in range(world_size)]
    share = rank_share(table.total_rows, world_size, batch_size, uneven)
    assert {len(batches) for batches in ranks} == {share.steps}
    counts = collections.Counter(int(row) for batches in ranks for batch in batches for row in batch)
    if uneven == "drop":
        assert max(counts.values(), default=1) == 1 and table.total_rows - len(counts) == share.dropped
    else:
        assert len(counts) == table.total_rows
    starts, _ = runs_of(table, run_rows)
    run_of_row = np.searchsorted(starts, np.arange(table.total_rows), side="right") - 1
    for batches in ranks:
        assert isinstance(batches, BlockPlan)
        owners = collections.defaultdict(set)
        for index, batch in enumerate(batches):
            window = batches.windows[batches.window_of[index]]
            assert np.isin(batch, window).all()
            owners[int(batches.window_of[index])].add(index % num_workers)
            hint, _ = read_hints(batches, index, num_workers, depth=1)
            assert hint is window
        assert all(len(workers) == 1 for workers in owners.values())
        reads = sum(len(np.unique(run_of_row[window])) for window in batches.windows)
        touched = len(np.unique(run_of_row[np.concatenate(batches.windows)])) if batches.windows else 0
        cuts = len(batches.windows) + num_workers + 1
        assert reads <= touched + cuts + (uneven == "pad") * share.rows_per_rank


@property_settings
@given(
    layout=fragment_layouts,
    first=st.tuples(st.integers(1, 8), st.integers(1, 16), st.integers(1, 4)),
    resumed=st.tuples(st.integers(1, 8), st.integers(1, 16)),
    run_rows=st.integers(1, 9),
    data=st.data(),
)
def test_a_block_epoch_resumed_on_another_layout_reads_every_row_once(layout, first, resumed, run_rows, data):
    """Cut at any step on 1..8 ranks with 1..4 workers, resumed on 1..8 ranks with another batch:
    the block plan of the first layout (its worker count included) is what the rest is cut from."""
    table = FragmentTable.from_rows(layout)
    world_size, batch_size, workers = first
    assume(rank_share(table.total_rows, world_size, batch_size, "drop").steps > 0)
    origin = EpochOrigin("block", "drop", True, seed=2, epoch=1, num_workers=workers, run_rows=run_rows, window_runs=3)
    options = dict(seed=2, epoch=1, num_workers=workers, run_rows=run_rows, window_runs=3)
    plans = [epoch_batches(table, "block", rank, world_size, batch_size, **options) for rank in range(world_size)]
    consumed = data.draw(st.integers(0, len(plans[0])))
    read = collections.Counter(int(row) for batches in plans for batch in batches[:consumed] for row in batch)
    epoch = ResumedEpoch(origin, (Segment(world_size, batch_size, consumed), Segment(*resumed, 0)))
    rest = [epoch.batches(table, rank) for rank in range(resumed[0])]
    assert len({len(batches) for batches in rest}) == 1
    shares = remainder_share_rows(epoch.epoch_rows(table) - epoch.rows_before(table), resumed[0])
    read.update(int(row) for rank, batches in enumerate(rest) if shares[rank] for batch in batches for row in batch)
    planned = collections.Counter(int(row) for batches in plans for batch in batches for row in batch)
    assert read == planned


@property_settings
@given(rows=st.integers(0, 500), world_size=st.integers(1, 8), batch_size=st.integers(1, 32))
def test_eval_sharded_covers_every_row_once_and_full_scan_all_rows_per_rank(rows, world_size, batch_size):
    sharded = [eval_batches(rows, rank, world_size, batch_size, "sharded") for rank in range(world_size)]
    flat = sorted(int(row) for batches in sharded for batch in batches for row in batch)
    assert flat == list(range(rows))
    for rank in range(world_size):
        full = eval_batches(rows, rank, world_size, batch_size, "full_scan")
        assert [int(row) for batch in full for row in batch] == list(range(rows))


def test_reference_layout_never_gives_ranks_different_steps():
    """The reference example: 6 x 12,500 + 750 rows, 2 GPUs, batch 128 - where ShardedFragmentSampler hung."""
    for sampler in TRAIN_SAMPLERS:
        for uneven in ("drop", "pad"):
            plan = plan_from_table(FragmentTable.from_rows(REFERENCE_LAYOUT), 2, 128, sampler=sampler, uneven=uneven)
            steps = {
                len(epoch_batches(FragmentTable.from_rows(REFERENCE_LAYOUT), sampler, r, 2, 128, uneven=uneven)) for r in (0, 1)
            }
            assert steps == {plan.steps_per_rank}
    plan = plan_from_table(FragmentTable.from_rows(REFERENCE_LAYOUT), 2, 128, sampler="sharded_fragment")
    assert (plan.rows_per_rank, plan.steps_per_rank, plan.dropped) == (37_875, 296, 0)


def test_plan_of_a_million_rows_in_a_thousand_fragments_for_512_ranks_is_fast():
    rng = np.random.default_rng(0)
    layout = rng.integers(500, 1500, size=1000)
    layout = (layout * (1_000_000 / layout.sum())).astype(int)
    layout[-1] += 1_000_000 - layout.sum()
    table = FragmentTable.from_rows(layout.tolist())
    began = time.perf_counter()
    for sampler in TRAIN_SAMPLERS:
        for uneven in ("drop", "pad"):
            plan = plan_from_table(table, 512, 256, sampler=sampler, uneven=uneven)
            assert plan.rows == 1_000_000 and plan.fragments == 1000
    assert time.perf_counter() - began < 1.0
    # One rank's own epoch layout is cheap too (it is computed every epoch on every rank).
    began = time.perf_counter()
    batches = epoch_batches(table, "sharded_fragment", 511, 512, 256, seed=1, epoch=4)
    assert len(batches) == plan_from_table(table, 512, 256, sampler="sharded_fragment").steps_per_rank
    assert time.perf_counter() - began < 2.0


def test_plan_text_is_a_readable_table():
    plan = plan_from_table(FragmentTable.from_rows([100] * 6 + [6]), 4, 32, style="iterable", sampler="sharded_fragment")
    text = str(plan)
    assert "steps per rank" in text and "dropped" in text and "padded" in text
    assert "606 in 7 fragments (6..100 rows each)" in text
    assert plan.dropped == 2 and plan.steps_per_rank == 5 and plan.last_batch_rows == 23


@pytest.mark.parametrize("bad", [dict(sampler="nope"), dict(uneven="nope")])
def test_unknown_names_list_the_valid_ones(bad):
    args = dict(sampler="distributed", uneven="drop") | bad
    with pytest.raises(ValueError, match="use one of"):
        epoch_batches(FragmentTable.from_rows([10]), args["sampler"], 0, 1, 4, uneven=args["uneven"])
