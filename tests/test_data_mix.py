"""Weighted mixtures (data.mix): the draw order against its definition, proportions per rank,
equal steps, exactly once within each source epoch, and resume at any layout and after new
weights, first as properties of the plan, then through the loader on real Lance datasets."""

import collections

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lance_hpc.errors import UserError
from lance_hpc.loading.mix import MixPart, MixSchedule, draw_counts, offset_of, source_of
from lance_hpc.loading.sampling import FragmentTable
from lance_hpc.spec import DataSpec, MixSource
from tests.support.loaders import train_loader, write_dataset

property_settings = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
weights = st.lists(st.floats(0.05, 10), min_size=1, max_size=4)


@property_settings
@given(weights=weights, n=st.integers(0, 2000))
def test_draws_are_the_first_n_in_virtual_time_order(weights, n):
    probs = np.asarray(weights) / sum(weights)
    merged = sorted(((k + 0.5) / probs[i], i) for i in range(len(probs)) for k in range(n + 1))
    expected = np.bincount([i for _, i in merged[:n]], minlength=len(probs))
    counts = draw_counts(n, probs)
    assert counts.tolist() == expected.tolist()
    assert (np.abs(counts - n * probs) <= len(probs)).all()
    assert (draw_counts(n + 1, probs) >= counts).all()  # a source's draws never shrink


def schedule_of(sizes, weights, sampler="distributed"):
    parts = tuple(MixPart(FragmentTable.from_rows(size), None, run_rows=3) for size in sizes)
    return MixSchedule(parts, tuple(weights), sampler=sampler, seed=9)


def per_source(ids):
    """{source: Counter of row offsets} of row ids."""
    counts = collections.defaultdict(collections.Counter)
    for source, offset in zip(source_of(ids).tolist(), offset_of(ids).tolist()):
        counts[source][offset] += 1
    return counts


def drawn_rows(schedule, segments):
    """Row ids drawn by ``segments`` [(world_size, batch_size, steps)] one after another, checking
    equal steps, full batches and per-rank proportions in each; and the rows drawn."""
    ids, start = [], 0
    for world_size, batch_size, steps in segments:
        ranks = [schedule.rank_batches(start, steps, world_size, batch_size, rank) for rank in range(world_size)]
        assert {len(batches) for batches in ranks} == {steps}
        assert all(len(batch) == batch_size for batches in ranks for batch in batches)
        for batches in ranks:
            for batch in batches:
                counts = np.bincount(source_of(batch), minlength=len(schedule.parts))
                assert (np.abs(counts - batch_size * schedule.probs) < len(schedule.parts) + 1.5).all()
        ids += [batch for batches in ranks for batch in batches]
        start += steps * world_size * batch_size
    return np.concatenate(ids) if ids else np.zeros(0, dtype=np.int64), start


@property_settings
@given(
    sizes=st.lists(st.lists(st.integers(1, 30), min_size=1, max_size=3), min_size=1, max_size=4),
    segments=st.lists(st.tuples(st.integers(1, 8), st.integers(1, 12), st.integers(0, 6)), min_size=1, max_size=4),
    sampler=st.sampled_from(["distributed", "block", "sharded_fragment"]),
    data=st.data(),
)
def test_any_sequence_of_layouts_draws_the_same_rows_each_source_epoch_once(sizes, segments, sampler, data):
    """Saved on 1..8 ranks at any step, resumed on 1..8 ranks with any batch, any number of times:
    the rows drawn are the rows one rank drawing as many would get, and within each source's epoch
    no row comes twice (a row's count is its source's whole epochs, or one more)."""
    chosen = data.draw(st.lists(st.floats(0.1, 5), min_size=len(sizes), max_size=len(sizes)))
    schedule = schedule_of(sizes, chosen, sampler)
    ids, total = drawn_rows(schedule, segments)
    alone = schedule.rank_batches(0, 1, 1, total, 0) if total else []
    assert sorted(ids.tolist()) == sorted(np.concatenate(alone).tolist() if alone else [])
    draws = schedule.draws_at(total)
    for source, counts in per_source(ids).items():
        rows = schedule.parts[source].rows
        whole = int(draws[source]) // rows
        assert set(counts.values()) <= {whole, whole + 1}
        assert sum(counts.values()) == draws[source]


@property_settings
@given(
    sizes=st.lists(st.integers(5, 40), min_size=2, max_size=3),
    before=st.tuples(st.integers(1, 6), st.integers(1, 8), st.integers(1, 5)),
    after=st.tuples(st.integers(1, 6), st.integers(1, 8), st.integers(1, 5)),
    data=st.data(),
)
def test_new_weights_keep_every_draw_so_far_and_follow_the_new_proportions(sizes, before, after, data):
    old = data.draw(st.lists(st.floats(0.2, 5), min_size=len(sizes), max_size=len(sizes)))
    new = data.draw(st.lists(st.floats(0.2, 5), min_size=len(sizes), max_size=len(sizes)))
    schedule = schedule_of([[size] for size in sizes], old)
    first, drawn = drawn_rows(schedule, [before])
    rebased = schedule.rebased(drawn, new)
    assert rebased.draws_at(drawn).tolist() == schedule.draws_at(drawn).tolist()
    world_size, batch_size, steps = after
    rest = [rebased.rank_batches(drawn, steps, world_size, batch_size, rank) for rank in range(world_size)]
    added = rebased.draws_at(drawn + steps * world_size * batch_size) - rebased.draws_at(drawn)
    probs = np.asarray(new) / sum(new)
    assert (np.abs(added - steps * world_size * batch_size * probs) <= len(sizes)).all()
    ids = np.concatenate([first, *[batch for batches in rest for batch in batches]])
    for source, counts in per_source(ids).items():
        total = int(rebased.draws_at(drawn + steps * world_size * batch_size)[source])
        whole = total // sizes[source]
        assert set(counts.values()) <= {whole, whole + 1}


@pytest.mark.parametrize(
    "weights,shares",
    [
        ([1e308, 1e308], [0.5, 0.5]),  # their sum is infinite
        ([1e308, 1e308, 0.5e308], [0.4, 0.4, 0.2]),
        ([1.7e308, 0.3e308], [0.85, 0.15]),
        ([5e-324, 5e-324], [0.5, 0.5]),  # the smallest float: subnormal, but the same share
    ],
)
def test_weights_near_the_float_limits_draw_in_their_proportion(weights, shares):
    schedule = schedule_of([[40]] * len(weights), weights)
    assert np.allclose(schedule.probs, shares), f"shares of {weights}: {schedule.probs}"
    ids, drawn = drawn_rows(schedule, [(2, 10, 20)])
    counts = np.bincount(source_of(ids), minlength=len(weights))
    assert (np.abs(counts - drawn * np.asarray(shares)) <= len(weights)).all(), f"draws per source: {counts}"


# ---- the loader, on real datasets ----------------------------------------------------------------


@pytest.fixture
def two_sources(tmp_path):
    small = write_dataset(str(tmp_path / "small.lance"), [9, 4])  # labels 0..12
    big = write_dataset(str(tmp_path / "big.lance"), [30, 30, 17])  # labels 0..76
    return small, big


def mix_spec(sources, weights, **fields):
    mix = [MixSource(uri=uri, weight=weight, **extra) for (uri, extra), weight in zip(sources, weights)]
    return DataSpec(mix=mix, **({"batch_size": 8, "num_workers": 0, "seed": 3} | fields))


def read(loader, epoch, steps=None):
    loader.set_epoch(epoch)
    batches = []
    for index, batch in enumerate(loader):
        batches.append(batch["row_id"].numpy())
        if steps is not None and index + 1 == steps:
            break
    return batches


@pytest.mark.parametrize("style,sampler", [("map", "distributed"), ("iterable", "block")])
def test_a_mix_resumed_on_another_world_size_with_new_weights_reads_each_source_epoch_once(two_sources, style, sampler):
    small, big = two_sources
    sources = [(small, {}), (big, {"filter": "label >= 10"})]  # 67 of the big source's rows
    data = mix_spec(sources, [1, 3], style=style, sampler=sampler)
    loaders = [train_loader(data, rank, 3) for rank in range(3)]
    assert loaders[0].steps_per_epoch == (13 + 67) // 24
    ids = [batch for loader in loaders for batch in read(loader, 0, steps=2)]
    for batch in ids:  # every batch holds both sources in about their proportion: 2 and 6 of 8
        assert abs(int((source_of(batch) == 0).sum()) - 2) <= 1
    labels = np.concatenate([batch["label"].numpy() for batch in loaders[0]])
    assert len(labels)  # the rest of rank 0's epoch decodes
    saved = loaders[1].state_dict()
    saved_drawn = 2 * 24
    later = mix_spec(sources, [1, 1], style=style, sampler=sampler, batch_size=5, num_workers=2)
    resumed = [train_loader(later, rank, 2) for rank in range(2)]
    for loader in resumed:
        loader.load_state_dict(saved)
    rest = [read(loader, 0) for loader in resumed]
    assert len({len(batches) for batches in rest}) == 1
    assert len(rest[0]) == (loaders[0].steps_per_epoch * 24 - saved_drawn) // 10
    drawn = np.concatenate(ids + [batch for batches in rest for batch in batches])
    offsets = offset_of(drawn[source_of(drawn) == 1])
    assert offsets.min() >= 10  # the filter holds
    counts = per_source(drawn)
    for source, rows in ((0, 13), (1, 67)):
        whole = sum(counts[source].values()) // rows
        assert set(counts[source].values()) <= {whole, whole + 1}, source
    figures = resumed[0].source_figures()
    assert figures["data/mix/0_small/rows"] + figures["data/mix/1_big/rows"] == len(drawn)


def test_a_mix_of_weights_whose_sum_overflows_reads_both_sources_through_the_loader(two_sources):
    small, big = two_sources
    loader = train_loader(mix_spec([(small, {}), (big, {})], [1e308, 1e308]), 0, 1)
    drawn = np.concatenate(read(loader, 0))
    counts = np.bincount(source_of(drawn), minlength=2)
    assert abs(int(counts[0]) - int(counts[1])) <= 2, f"rows of each source: {counts.tolist()}"


def test_a_mix_checkpoint_resumes_only_with_its_sources(two_sources, tmp_path):
    from lance_hpc.loading.mix import pinned_mix

    small, big = two_sources
    data = mix_spec([(small, {}), (big, {})], [1, 1])
    pinned = train_loader(data, 0, 1).pinned["sources"]
    assert [source["version"] for source in pinned] == [2, 3]
    moved = mix_spec([(small, {}), (big, {"filter": "label < 5"})], [2, 1])
    with pytest.raises(UserError, match="other sources or filters"):
        pinned_mix(moved, pinned, "start over")
    write_dataset(big, [5], mode="append")  # a new version: the checkpoint's is kept
    kept = pinned_mix(mix_spec([(small, {}), (big, {})], [5, 1]), pinned, "start over")
    assert [source.version for source in kept] == [2, 3] and [source.weight for source in kept] == [5, 1]


def test_a_mix_spec_resolves_each_source_like_data_uri_and_names_the_first_as_data_uri(tmp_path):
    from pathlib import Path

    from lance_hpc.spec import load_spec

    job = tmp_path / "mix.yaml"
    job.write_text(
        "name: mixed\n"
        "data:\n"
        "  mix:\n"
        "    - {uri: data/web.lance, weight: 7, filter: \"lang = 'en'\", val_uri: data/web_val.lance}\n"
        "    - {uri: s3://bucket/code.lance, weight: 3, tag: v3}\n"
    )
    spec = load_spec(job).spec
    here = Path.cwd()  # relative paths resolve where the command runs, as data.uri's do
    assert spec.data.uri == spec.data.mix[0].uri == str(here / "data" / "web.lance")
    assert spec.data.mix[0].val_uri == str(here / "data" / "web_val.lance")
    assert spec.data.mix[1].uri == "s3://bucket/code.lance"
    resolved = tmp_path / "resolved.yaml"  # what the ranks read: the resolved spec loads as it is
    resolved.write_text(spec.to_yaml())
    assert load_spec(resolved).spec.data == spec.data
