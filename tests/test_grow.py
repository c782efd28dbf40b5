"""Tables that grow: rows appended to a dataset with columns a job wrote back get nulls there (and
the ingest says which, and what wrote them), a job's record of its commit counts only while the dataset holds
those very columns, and ``infer.refresh: missing`` computes the columns for the new rows only."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import lance
import pyarrow as pa
import pytest
import yaml

from lance_hpc.cli.ingest import main as ingest_main
from lance_hpc.lineage.provenance import PROVENANCE_KEY
from tests.support.shards import digit_rows, write_webdataset
from tests.test_infer import function_spec, run_local

pytestmark = pytest.mark.slow


def ingest(*args: object) -> int:
    return ingest_main([str(arg) for arg in args])


def data_files(uri: str) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in (Path(uri) / "data").glob("*.lance")}


@pytest.fixture
def with_column(tmp_path: Path) -> tuple[str, Path]:
    """40 digits from WebDataset tars in 4 fragments, with the column ``twice`` an infer job's function wrote."""
    rows = digit_rows()
    write_webdataset(tmp_path / "first", rows[:40], per_tar=10)
    write_webdataset(tmp_path / "second", rows[40:], per_tar=10)
    uri = str(tmp_path / "digits.lance")
    assert ingest(f"webdataset:{tmp_path}/first/*.tar", uri, "--rows-per-fragment", "10") == 0
    spec = function_spec(tmp_path / "job", uri, "tests.support.infer:label_twice", outputs={"twice": "int64"})
    done = run_local(spec)
    assert done.returncode == 0, done.stdout + done.stderr
    return uri, spec


def test_an_append_to_a_dataset_with_derived_columns_adds_the_rows_with_nulls_there_and_says_which(
    with_column: tuple[str, Path], tmp_path: Path, capsys
) -> None:
    uri, spec = with_column
    assert PROVENANCE_KEY.encode() in (lance.dataset(uri).schema.field("twice").metadata or {})
    before = lance.dataset(uri)
    code = ingest(f"webdataset:{tmp_path}/second/*.tar", uri, "--append", "--rows-per-fragment", "10")
    printed = capsys.readouterr()
    assert code == 0, printed.err
    assert "the new rows have no values in twice" in printed.out and "infer.refresh: missing" in printed.out, printed.out
    assert "twice (written by an infer job, from a function)" in printed.out, printed.out
    assert "--overwrite" not in printed.out + printed.err
    after = lance.dataset(uri)
    assert after.version == before.version + 1 and after.count_rows() == 60
    table = after.to_table(columns=["label", "twice"]).to_pylist()
    assert all(row["twice"] == 2 * row["label"] for row in table[:40]), table[:40]
    assert all(row["twice"] is None for row in table[40:]), table[40:]
    # the job's commit still holds: its rerun writes nothing, and says how to fill the new rows
    again = run_local(spec)
    assert again.returncode == 0 and "already committed" in again.stdout, again.stdout + again.stderr
    assert "20 rows have no twice" in again.stdout and "infer.refresh: missing" in again.stdout, again.stdout
    assert lance.dataset(uri).version == after.version


@pytest.mark.parametrize(
    ("document", "wrote"),
    [
        ({"job": "map", "checkpoint": None, "function": "m:f"}, "written by a map job, from a function"),
        ({"job": "infer", "checkpoint": {"dir": "ck", "step": 3}, "function": None}, "written by an infer job, from a model"),
        ({"job": "infer", "checkpoint": {"dir": "ck", "step": 3}, "function": "m:f"}, "written by an infer job, from a model"),
        ({"function": "m:f"}, "written back by a job"),  # no kind recorded
        ({"job": "\x1b[2Jtrain"}, "written back by a job"),  # not a kind that writes columns
        ("not JSON", "written back by a job"),
    ],
)
def test_an_append_names_what_wrote_each_column_its_rows_lack(document: object, wrote: str, tmp_path: Path) -> None:
    """What wrote each column comes from the column's provenance; without a readable one, the line
    says only that a job wrote it back."""
    from lance_hpc.ingest.plan import written_by

    text = document if isinstance(document, str) else json.dumps(document)
    schema = pa.schema([pa.field("score", pa.float32(), metadata={PROVENANCE_KEY: text})])
    assert written_by(schema, "score") == wrote


def test_an_append_says_which_set_grew(tmp_path: Path, capsys) -> None:
    """Rows appended to a training and a validation set are counted as appended to each, and rows
    appended to one dataset are not called training rows."""
    rows = digit_rows()
    write_webdataset(tmp_path / "first", rows[:40], per_tar=10)
    write_webdataset(tmp_path / "second", rows[40:], per_tar=10)
    train, val = tmp_path / "train.lance", tmp_path / "val.lance"
    split = ("--val-uri", val, "--val-fraction", "0.25")
    assert ingest(f"webdataset:{tmp_path}/first/*.tar", train, *split) == 0
    assert "rows train " in capsys.readouterr().out  # a new dataset: its rows per split
    before = [lance.dataset(str(uri)).count_rows() for uri in (train, val)]
    assert ingest(f"webdataset:{tmp_path}/second/*.tar", train, *split, "--append") == 0
    both = capsys.readouterr().out
    grew = [lance.dataset(str(uri)).count_rows() - rows for uri, rows in zip((train, val), before)]
    assert all(grew) and sum(grew) == 20, grew
    expected = f"{grew[0]} rows appended to the training set, {grew[1]} to the validation set"
    assert expected in both and "rows train" not in both, both
    assert ingest(f"webdataset:{tmp_path}/second/*.tar", val, "--append") == 0
    alone = capsys.readouterr().out
    assert f"committed: {val} version 3; 20 rows appended; skipped none" in alone and "train" not in alone, alone


def test_another_schema_is_refused_without_suggesting_an_overwrite(with_column: tuple[str, Path], tmp_path: Path, capsys) -> None:
    uri, _ = with_column
    code = ingest(f"webdataset:{tmp_path}/second/*.tar", uri, "--append", "--column", "label=")
    printed = capsys.readouterr()
    assert code == 2 and "these rows do not have the dataset's columns (cls, label differ)" in printed.err, printed.err
    assert "fix: map the source's fields to the dataset's columns" in printed.err and "--overwrite" not in printed.err


def test_a_commit_record_does_not_count_once_its_column_was_replaced_by_hand(with_column: tuple[str, Path]) -> None:
    uri, spec = with_column
    dataset = lance.dataset(uri)
    dataset.drop_columns(["twice"])
    lance.dataset(uri).add_columns({"twice": "label * 0 - 1"})  # the user's own column, under the same name
    again = run_local(spec)
    output = again.stdout + again.stderr
    assert "already committed" not in output, output
    assert again.returncode == 2 and "already has the column(s) twice" in again.stderr, output
    assert set(lance.dataset(uri).to_table(columns=["twice"]).column("twice").to_pylist()) == {-1}


def refresh_spec(spec: Path, **infer: object) -> Path:
    """The job ``spec`` with ``infer.refresh: missing`` (and ``infer`` settings), beside it."""
    raw = yaml.safe_load(spec.read_text())
    raw["infer"].update(refresh="missing", **infer)
    path = spec.with_name("refresh.yaml")
    path.write_text(yaml.safe_dump(raw))
    return path


def dry_run(spec: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lance_hpc.submit", str(spec), "--dry-run"], capture_output=True, text=True)


def test_a_refresh_computes_only_the_appended_rows_and_keeps_every_old_value_and_file(
    with_column: tuple[str, Path], tmp_path: Path
) -> None:
    uri, spec = with_column
    lance.dataset(uri).create_scalar_index("twice", "BTREE", name="twice_idx")  # over the 4 fragments there
    assert ingest(f"webdataset:{tmp_path}/second/*.tar", uri, "--append", "--rows-per-fragment", "10") == 0
    appended = lance.dataset(uri).version
    before = data_files(uri)
    refresh = refresh_spec(spec)
    planned = dry_run(refresh)
    assert planned.returncode == 0 and "refresh: 20 rows in 2 of 6 fragments lack twice" in planned.stdout, planned.stdout
    shown = subprocess.run([sys.executable, "-m", "lance_hpc", "plan", str(refresh)], capture_output=True, text=True)
    assert shown.returncode == 0 and "infer plan of digits_infer:" in shown.stdout, shown.stdout + shown.stderr
    assert "refresh: 20 rows in 2 of 6 fragments lack twice: only they are computed" in shown.stdout, shown.stdout
    done = run_local(refresh)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "refresh: 20 rows in 2 of 6 fragments lack twice: computing them only" in done.stdout, done.stdout
    assert done.stdout.count("committed:") == 1 and "for 20 rows of 2 fragment(s)" in done.stdout, done.stdout
    assert "index twice_idx on twice: updated with the new rows (optimize_indices)" in done.stdout, done.stdout
    (index,) = lance.dataset(uri).describe_indices()
    assert index.name == "twice_idx" and index.num_rows_indexed == 60, index
    after = data_files(uri)
    assert {name: after[name] for name in before} == before, "a data file that was there changed"
    assert len(after) == len(before) + 2, sorted(set(after) - set(before))  # one new file per appended fragment
    latest = lance.dataset(uri)
    rows = latest.to_table(columns=["label", "twice"]).to_pylist()
    assert all(row["twice"] == 2 * row["label"] for row in rows), rows
    # a reader of the version before sees none of the new values, one of the refresh's version all of them
    committed = int(re.search(r"committed: \S+ version (\d+)", done.stdout).group(1))
    assert committed == appended + 1, done.stdout
    for version, nulls in ((appended, 20), (committed, 0)):
        assert lance.dataset(uri, version=version).to_table(columns=["twice"]).column("twice").null_count == nulls
    document = json.loads(latest.schema.field("twice").metadata[PROVENANCE_KEY.encode()])
    assert [(entry["rows"], entry["fragments"]) for entry in document["refreshes"]] == [(20, 2)], document
    assert (document["rows"], document["fragments"], document["dataset"]["version"]) == (40, 4, 1), document
    again = run_local(refresh)
    assert again.returncode == 0 and "already committed" in again.stdout and lance.dataset(uri).version == latest.version
    chain = subprocess.run([sys.executable, "-m", "lance_hpc", "lineage", uri], capture_output=True, text=True)
    assert "twice (int64): job: infer, function tests.support.infer:label_twice" in chain.stdout, chain.stdout + chain.stderr
    assert "-> twice: read version 1, 40 rows in 4 fragment(s)" in chain.stdout, chain.stdout
    assert f"refreshed: read version {appended}, 20 rows in 2 fragment(s)" in chain.stdout, chain.stdout


def test_rows_appended_with_explicit_nulls_are_filled_and_their_null_file_left_out(
    with_column: tuple[str, Path], tmp_path: Path
) -> None:
    uri, spec = with_column
    dataset = lance.dataset(uri)
    more = dataset.to_table(limit=5).set_column(dataset.schema.get_field_index("twice"), "twice", pa.nulls(5, pa.int64()))
    lance.write_dataset(more, uri, mode="append")  # as LanceDB's add of rows without the column does
    nulls = lance.dataset(uri).get_fragments()[-1].metadata.files[0].path
    lance.dataset(uri).create_scalar_index("twice", "BTREE", name="twice_idx")  # it holds the new rows' nulls
    done = run_local(refresh_spec(spec))
    assert done.returncode == 0 and "for 5 rows of 1 fragment(s)" in done.stdout, done.stdout + done.stderr
    assert "index twice_idx on twice: built again (it held the nulls of rows the refresh filled)" in done.stdout
    assert lance.dataset(uri).count_rows("twice IS NOT NULL") == 45  # through the index
    table = lance.dataset(uri).to_table(columns=["label", "twice"]).to_pylist()
    assert len(table) == 45 and all(row["twice"] == 2 * row["label"] for row in table), table[40:]
    last = lance.dataset(uri).get_fragments()[-1].metadata.files
    assert [item.path for item in last][0] == nulls and -2 in last[0].fields, last  # the rows' file kept, its nulls dropped


def test_finding_the_rows_a_column_lacks_reads_no_value_of_the_rows_it_was_written_for(tmp_path: Path) -> None:
    """A write-back keeps a column in a data file of its own: which fragments lack it is read from the
    manifest, and only the rows appended with the column in their own file are read. The column's
    own files are deleted here, so reading any of them fails the test."""
    from lance_hpc.backfill.missing import field_ids, gaps

    uri = str(tmp_path / "d.lance")
    lance.write_dataset(pa.table({"x": pa.array(range(30), pa.int64())}), uri, max_rows_per_file=10)
    lance.dataset(uri).add_columns({"twice": "x * 2"})  # a file of the column alone in each fragment
    twice = field_ids(lance.dataset(uri).lance_schema)["twice"]
    written = [
        item.path for fragment in lance.dataset(uri).get_fragments() for item in fragment.metadata.files if item.fields == [twice]
    ]
    assert len(written) == 3, written
    for rows in ({"x": [30, 31], "twice": [None, None]}, {"x": [32], "twice": [64]}):  # appended with the column
        lance.write_dataset(pa.table(rows, pa.schema([("x", pa.int64()), ("twice", pa.int64())])), uri, mode="append")
    for name in written:
        (Path(uri) / "data" / name).unlink()
    assert gaps(lance.dataset(uri), ["twice"]) == [3]  # the nulls; the other appended fragment has a value


def test_a_refresh_by_another_function_is_refused_with_the_reason_and_overwrite_recomputes_every_row(
    with_column: tuple[str, Path], tmp_path: Path
) -> None:
    uri, spec = with_column
    assert ingest(f"webdataset:{tmp_path}/second/*.tar", uri, "--append", "--rows-per-fragment", "10") == 0
    version = lance.dataset(uri).version
    other = refresh_spec(spec, function="tests.support.infer:label_twice_failing")
    refused = run_local(other)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stdout + refused.stderr
    assert "it was computed by job: infer, function tests.support.infer:label_twice" in refused.stderr, refused.stderr
    assert "infer.overwrite: true" in refused.stderr and lance.dataset(uri).version == version
    raw = yaml.safe_load(other.read_text())
    raw["infer"]["overwrite"] = True
    other.write_text(yaml.safe_dump(raw))
    lance.dataset(uri).create_scalar_index("twice", "BITMAP", name="twice_bitmap")
    done = run_local(other)
    assert done.returncode == 0 and "for 60 rows" in done.stdout, done.stdout + done.stderr
    assert "index twice_bitmap on twice: built again on the new values (BITMAP)" in done.stdout, done.stdout
    (index,) = lance.dataset(uri).describe_indices()  # Lance dropped it with the replaced column; the job built it again
    assert index.name == "twice_bitmap" and "Bitmap" in index.type_url and index.num_rows_indexed == 60, index
    document = json.loads(lance.dataset(uri).schema.field("twice").metadata[PROVENANCE_KEY.encode()])
    assert document["function"] == "tests.support.infer:label_twice_failing" and document["refreshes"] == []


def test_columns_of_another_checkpoint_or_step_are_refused(tmp_path: Path) -> None:
    """The rule itself, on a dataset whose column names checkpoint A at step 10."""
    from lance_hpc.backfill.missing import fills
    from lance_hpc.errors import UserError
    from lance_hpc.lineage.provenance import Producer, column_document, encode

    uri = str(tmp_path / "d.lance")
    made_by = Producer("infer", "/ckpt/a", 10, None, "blake2b:1")
    document = column_document(made_by, spec="s", uri=uri, version=1, filter=None, run="r", rows=4, fragments=1)
    field = pa.field("score", pa.float32(), metadata={PROVENANCE_KEY: encode(document)})
    lance.write_dataset(
        pa.table({"x": [1, 2, 3, 4], "score": pa.array([0.5] * 4, pa.float32())}).cast(
            pa.schema([pa.field("x", pa.int64()), field])
        ),
        uri,
    )
    dataset = lance.dataset(uri)
    outputs = {"score": "float32"}
    assert fills(dataset, uri, outputs, made_by, False)
    for producer, reason in [
        (Producer("infer", "/ckpt/b", 10), "checkpoint /ckpt/a, not /ckpt/b"),
        (Producer("infer", "/ckpt/a", 20), "step 10 of /ckpt/a, not step 20"),
        (Producer("infer", "/ckpt/a", 10, None, "blake2b:2"), "weights blake2b:1, not blake2b:2"),
        (Producer("infer", "/ckpt/a", 10, "my.fn:f"), "function the task's own outputs, not my.fn:f"),
    ]:
        with pytest.raises(UserError, match="score: it was computed by") as refused:
            fills(dataset, uri, outputs, producer, False)
        assert reason in str(refused.value), str(refused.value)
        assert not fills(dataset, uri, outputs, producer, True)  # overwrite: written whole again
    with pytest.raises(UserError, match="infer.outputs.score: float16, but the column score"):
        fills(dataset, uri, {"score": "float16"}, made_by, False)
