"""The loaders on real Lance datasets: every strategy yields the planned steps and rows, a resumed
epoch continues exactly (also with persistent worker processes), corrupt rows never change step
counts, versions are pinned, evaluation covers every row once; plan and preflight on local data."""

import collections
import threading

import pytest
import torch

from lance_hpc.cli.plan import main as plan_main
from lance_hpc.errors import UserError
from lance_hpc.loading import dataset_info, plan_data, preflight
from lance_hpc.spec import DataSpec, IngestSpec
from lance_hpc.tasks.image import ImageClassification, ImageOptions
from tests.support.loaders import eval_loader, spec, train_loader, write_dataset

STRATEGIES = [
    ("map", "distributed"),
    ("map", "block"),
    ("iterable", "block"),
    ("iterable", "sharded_batch"),
    ("iterable", "sharded_fragment"),
]


@pytest.fixture
def layout_dataset(tmp_path):
    # The reference shape scaled down: 6 fragments of 25 rows and one of 7.
    return write_dataset(str(tmp_path / "ref.lance"), [25] * 6 + [7])


def epoch_labels(loader, epoch):
    loader.set_epoch(epoch)
    return [batch["label"].tolist() for batch in loader]


@pytest.mark.parametrize("style,sampler", STRATEGIES)
@pytest.mark.parametrize("uneven", ["drop", "pad"])
def test_every_strategy_reads_the_planned_rows_with_equal_steps(layout_dataset, style, sampler, uneven):
    world_size = 3
    loaders = [
        train_loader(spec(layout_dataset, style=style, sampler=sampler, uneven=uneven), r, world_size) for r in range(world_size)
    ]
    plan = loaders[0].source.plan
    per_rank = [epoch_labels(loader, 1) for loader in loaders]
    assert [len(batches) for batches in per_rank] == [plan.steps_per_rank] * world_size
    for step in range(plan.steps_per_rank):
        assert len({len(batches[step]) for batches in per_rank}) == 1
    counts = collections.Counter(row for batches in per_rank for batch in batches for row in batch)
    if uneven == "drop":
        assert max(counts.values()) == 1 and len(counts) == 157 - plan.dropped
    else:
        assert len(counts) == 157 and sum(counts.values()) == 157 + plan.padded
    first = loaders[0]
    task = ImageClassification(ImageOptions(image_size=16), dataset_info(first.data, layout_dataset))
    assert task.num_classes == 157 and first.dataset_version == 7 and task.class_names[:2] == ["0", "1"]
    batch = next(iter(first))
    assert set(batch) == {"image", "label", "row_id"}
    assert batch["image"].dtype == torch.uint8 and batch["image"].shape[1:] == (3, 16, 16)
    assert batch["image"].is_contiguous(memory_format=torch.channels_last)
    assert batch["label"].dtype == torch.int64 and batch["row_id"].dtype == torch.int64
    assert torch.equal(batch["row_id"], batch["label"])  # the label is the row id: row_id names the row read


@pytest.mark.parametrize("style,sampler", STRATEGIES)
def test_resume_mid_epoch_in_process(layout_dataset, style, sampler):
    data = spec(layout_dataset, style=style, sampler=sampler)
    loader = train_loader(data, 1, 2)
    full = epoch_labels(loader, 4)
    loader.set_epoch(4)
    batches = iter(loader)
    head = [next(batches)["label"].tolist() for _ in range(3)]
    state = loader.state_dict()
    assert state["epoch"] == 4 and state["batches_consumed"] == 3
    restored = train_loader(data, 1, 2)
    restored.load_state_dict(state)
    restored.set_epoch(4)  # the trainer sets the epoch again: the offset survives
    assert restored.steps_remaining == len(full) - 3
    tail = [batch["label"].tolist() for batch in restored]
    assert head + tail == full
    assert epoch_labels(restored, 5) != full and len(epoch_labels(restored, 5)) == len(full)


@pytest.mark.slow
@pytest.mark.parametrize("style,sampler", [("map", "distributed"), ("iterable", "sharded_fragment")])
def test_persistent_workers_reshuffle_per_epoch_and_resume_exactly(layout_dataset, style, sampler):
    data = spec(layout_dataset, style=style, sampler=sampler, num_workers=2)
    in_process = train_loader(spec(layout_dataset, style=style, sampler=sampler), 0, 2)
    loader = train_loader(data, 0, 2)
    epochs = [epoch_labels(loader, epoch) for epoch in (0, 1)]
    # Workers read the same rows as the in-process loader: no duplicates across workers, new epoch order.
    assert epochs == [epoch_labels(in_process, epoch) for epoch in (0, 1)]
    assert epochs[0] != epochs[1]
    loader.set_epoch(1)
    batches = iter(loader)
    head = [next(batches)["label"].tolist() for _ in range(5)]
    state = loader.state_dict()
    restored = train_loader(data, 0, 2)
    restored.load_state_dict(state)
    assert head + [batch["label"].tolist() for batch in restored] == epochs[1]


def test_corrupt_rows_are_skipped_without_changing_step_counts(tmp_path):
    uri = write_dataset(str(tmp_path / "c.lance"), [30, 30], corrupt={3, 17, 44})
    loaders = [train_loader(spec(uri, sampler="distributed"), rank, 2) for rank in range(2)]
    steps = [len(epoch_labels(loader, 0)) for loader in loaders]
    assert steps == [loaders[0].steps_per_epoch] * 2
    assert sum(loader.stats.skipped for loader in loaders) == 3
    assert loaders[0].state_dict()["skipped_rows"] == loaders[0].stats.skipped


def test_corrupt_rows_fail_names_the_row(tmp_path):
    uri = write_dataset(str(tmp_path / "c.lance"), [10], corrupt={6})
    loader = train_loader(spec(uri, on_corrupt="fail", shuffle=False), 0, 1)
    with pytest.raises(UserError, match=f"row 6 of {uri}"):
        list(loader)


def test_version_is_pinned(tmp_path):
    uri = write_dataset(str(tmp_path / "v.lance"), [20])
    write_dataset(uri, [12], mode="append")
    latest = train_loader(spec(uri), 0, 1)
    pinned = train_loader(spec(uri, version=1), 0, 1)
    assert (latest.dataset_version, latest.source.plan.rows) == (2, 32)
    assert (pinned.dataset_version, pinned.source.plan.rows) == (1, 20)
    assert max(row for batch in epoch_labels(pinned, 0) for row in batch) < 20


@pytest.mark.parametrize("style,sampler", STRATEGIES)
def test_a_filter_is_planned_like_a_dataset_of_its_rows_and_resumes_on_another_world_size(layout_dataset, style, sampler):
    """data.filter: only the matching rows, each once per epoch, equal steps; cut on 3 ranks and
    resumed on 2 with another batch, the epoch's rows are read once."""
    predicate = "label < 40 OR label >= 120"  # 77 rows in 3 fragments of the 7
    data = spec(layout_dataset, style=style, sampler=sampler, filter=predicate)
    before = [train_loader(data, rank, 3) for rank in range(3)]
    assert before[0].source.plan.rows == 77 and "77 of 157 rows (49.0%) selected" in str(before[0].source.plan)
    planned = collections.Counter(row for loader in before for batch in epoch_labels(loader, 2) for row in batch)
    assert all(row < 40 or row >= 120 for row in planned) and len(planned) == 77 - before[0].source.plan.dropped
    read = collections.Counter()
    for loader in before:
        loader.set_epoch(2)
        for _, batch in zip(range(2), loader):
            read.update(batch["label"].tolist())
    saved = before[0].state_dict()
    assert saved["pinned"] == {"uri": layout_dataset, "version": 7, "tag": None, "filter": predicate}
    after = [
        train_loader(spec(layout_dataset, style=style, sampler=sampler, filter=predicate, batch_size=5), r, 2) for r in range(2)
    ]
    for loader in after:
        loader.load_state_dict(saved)
        read.update(row for batch in epoch_labels(loader, 2) for row in batch)
    assert read == planned


def test_a_tag_pins_the_version_it_names_and_bad_filters_are_clear_errors(tmp_path, capsys):
    import lance

    uri = write_dataset(str(tmp_path / "t.lance"), [20])
    lance.dataset(uri).tags.create("v1-clean", 1)
    write_dataset(uri, [12], mode="append")
    tagged = train_loader(spec(uri, tag="v1-clean"), 0, 1)
    assert (tagged.dataset_version, tagged.source.plan.rows) == (1, 20)
    with pytest.raises(UserError, match="has no tag 'v2' \\(its tags: v1-clean\\)"):
        train_loader(spec(uri, tag="v2"), 0, 1)
    with pytest.raises(
        UserError, match="(?s)No field named quality.*over the dataset's columns, .*its columns:\n    image, label$"
    ):
        train_loader(spec(uri, filter="quality > 0.8"), 0, 1)
    with pytest.raises(UserError, match="selects no rows"):
        train_loader(spec(uri, filter="label > 1000"), 0, 1)
    job = tmp_path / "job.yaml"
    job.write_text(f"name: demo\ndata: {{uri: {uri}, tag: v1-clean, filter: 'label >= 5 AND lang = 1'}}\n")
    assert plan_main([str(job), "--check"]) == 2
    err = capsys.readouterr().err
    assert "data.filter: Lance cannot apply the filter 'label >= 5 AND lang = 1': Schema error: No field named lang" in err
    assert "Traceback" not in err and ".rs:" not in err
    assert plan_main([str(job), "--set", "data.filter=label >= 5"]) == 0
    assert "15 of 20 rows (75.0%) selected by filter 'label >= 5'" in capsys.readouterr().out


@pytest.mark.parametrize("mode", ["sharded", "full_scan"])
def test_eval_loader(tmp_path, mode):
    uri = write_dataset(str(tmp_path / "val.lance"), [9, 9, 5])
    data = spec(str(tmp_path / "train.lance"), val_uri=uri, val_sampler=mode)
    per_rank = [[row for batch in eval_loader(data, rank, 3) for row in batch["label"].tolist()] for rank in range(3)]
    if mode == "sharded":
        assert sorted(row for rows in per_rank for row in rows) == list(range(23))
    else:
        assert all(sorted(rows) == list(range(23)) for rows in per_rank)
    batch = next(iter(eval_loader(data, 0, 3)))
    assert batch["image"].shape[1:] == (3, 16, 16) and batch["image"].dtype == torch.uint8
    assert torch.equal(batch["row_id"], batch["label"])


@pytest.mark.parametrize("style,sampler", STRATEGIES)
@pytest.mark.parametrize("uneven", ["drop", "pad"])
def test_an_epoch_resumed_on_another_world_size_reads_the_rest_once(layout_dataset, style, sampler, uneven):
    """4 ranks read 3 batches of epoch 1 and stop; 3 ranks with another batch size (and DataLoader
    workers) read the rest: equal steps, every planned row of the epoch exactly once over both."""
    before = [train_loader(spec(layout_dataset, style=style, sampler=sampler, uneven=uneven), rank, 4) for rank in range(4)]
    planned = collections.Counter(row for loader in before for batch in epoch_labels(loader, 1) for row in batch)
    read = collections.Counter()
    for loader in before:
        loader.set_epoch(1)
        for _, batch in zip(range(3), loader):
            read.update(batch["label"].tolist())
    saved = before[0].state_dict()
    data = spec(layout_dataset, style=style, sampler=sampler, uneven=uneven, batch_size=5, num_workers=2)
    after = [train_loader(data, rank, 3) for rank in range(3)]
    rest = []
    for loader in after:
        loader.load_state_dict(saved)
        assert loader.epoch_fraction() == pytest.approx(sum(read.values()) / sum(planned.values()))
        rest.append(epoch_labels(loader, 1))
        assert loader.epoch_fraction() == 1.0
    assert len({len(batches) for batches in rest}) == 1 and all(len(batch) <= 5 for batches in rest for batch in batches)
    read.update(row for batches in rest for batch in batches for row in batch)
    assert read == planned
    assert len(epoch_labels(after[0], 2)) == after[0].steps_per_epoch  # the next epoch: this layout's own plan


@pytest.mark.parametrize("style,sampler", STRATEGIES)
def test_read_ahead_takes_the_next_batches_on_background_threads_and_changes_nothing(layout_dataset, style, sampler):
    """With io_depth 2 a loader yields exactly what it yields reading on demand; each batch is taken
    once, and all but the first were taken ahead, on the read-ahead threads."""
    plain = epoch_labels(train_loader(spec(layout_dataset, style=style, sampler=sampler, io_depth=0), 0, 2), 1)
    loader = train_loader(spec(layout_dataset, style=style, sampler=sampler, io_depth=2), 0, 2)
    reader = loader._loader.dataset.reader
    takes = []
    original = type(reader).take

    def recording_take(self, row_ids, stats):
        takes.append((tuple(row_ids.tolist()), threading.current_thread().name))
        return original(self, row_ids, stats)

    type(reader).take = recording_take
    try:
        assert epoch_labels(loader, 1) == plain
    finally:
        type(reader).take = original
    # every batch taken once; with sampler: block, every window once (one take for several batches)
    reads = len(loader.source.planner(1).windows) if sampler == "block" else len(plain)
    assert len(takes) == len({rows for rows, _ in takes}) == reads
    ahead = [name for _, name in takes if name.startswith("lance_hpc-read-ahead")]
    assert len(ahead) == reads - 1
    if sampler == "block":
        assert 1 < reads < len(plain)


def test_clear_errors(tmp_path, layout_dataset):
    tiny = write_dataset(str(tmp_path / "tiny.lance"), [2])
    with pytest.raises(UserError, match="uneven: pad"):
        train_loader(spec(tiny), 0, 4)
    assert train_loader(spec(tiny, uneven="pad"), 3, 4).steps_per_epoch == 1
    with pytest.raises(UserError, match="no Lance dataset there"):
        train_loader(spec(str(tmp_path / "missing.lance")), 0, 1)
    with pytest.raises(UserError, match="val_uri is not set"):
        eval_loader(spec(layout_dataset), 0, 1)


def test_plan_data_and_preflight_on_local_data(tmp_path, layout_dataset, capsys):
    data = spec(layout_dataset, style="iterable", sampler="sharded_fragment", uneven="pad", batch_size=16)
    plan = plan_data(data, 4)
    assert (plan.rows, plan.fragments, plan.steps_per_rank, plan.padded, plan.version) == (157, 7, 3, 35, 7)
    preflight(data)
    with pytest.raises(UserError, match="no Lance dataset there"):
        preflight(spec(str(tmp_path / "missing.lance")))
    with pytest.raises(UserError, match="version 99 does not exist"):
        preflight(spec(layout_dataset, version=99))
    # A dataset that ingest will create is planned from the source's size.
    future = DataSpec(
        uri=str(tmp_path / "new.lance"),
        val_uri=str(tmp_path / "newval.lance"),
        ingest=IngestSpec(source="sklearn-digits", val_fraction=0.2, rows_per_fragment=500),
    )
    preflight(future)
    assert (plan_data(future, 2).rows, plan_data(future, 2).fragments) == (1438, 3)
    job = tmp_path / "job.yaml"
    job.write_text(f"name: demo\nslurm: {{nodes: 2, gpus_per_node: 4}}\ndata: {{uri: {layout_dataset}, batch_size: 8}}\n")
    assert plan_main([str(job), "--check"]) == 0
    out = capsys.readouterr().out
    assert "8 ranks x batch 8" in out and "steps per rank  3, the same on every rank" in out
    assert plan_main([str(job), "--world-size", "2", "--set", "data.uneven=pad"]) == 0
    assert "padded          3 rows" in capsys.readouterr().out
