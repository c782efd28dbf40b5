"""``job: map``: a plain function over batches of a dataset's columns, no model and no GPU, its
results written back as typed columns in one commit; a rank killed mid-run and the job rerun
write each fragment once; a refresh maps only the rows appended since; an index on a vector column
it replaces is built again."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import lance
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
import yaml

from tests.support.mapping import APPEND_TO, FAILING_LABEL
from tests.support.shards import digit_rows, write_webdataset
from tests.test_grow import ingest
from tests.test_infer import kill_rank_1_after_its_first_fragment, run_local

pytestmark = pytest.mark.slow


def map_spec(directory: Path, uri: str, function: str, max_restarts: int = 2, **infer: object) -> Path:
    raw = {
        "name": "digits_map",
        "job": "map",
        "slurm": {"tasks_per_node": 2, "log_dir": str(directory / "logs"), "max_restarts": max_restarts},
        "data": {"uri": uri, "batch_size": 4},
        "infer": {
            "function": function,
            "columns": ["image", "label"],
            "outputs": {"image_bytes": "int32", "one_hot": "float32"},
            **infer,
        },
    }
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "map.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


@pytest.fixture
def digits(tmp_path: Path) -> str:
    """40 digits from WebDataset tars in 4 fragments of 10 rows."""
    rows = digit_rows()
    write_webdataset(tmp_path / "first", rows[:40], per_tar=10)
    write_webdataset(tmp_path / "second", rows[40:], per_tar=10)
    uri = str(tmp_path / "digits.lance")
    assert ingest(f"webdataset:{tmp_path}/first/*.tar", uri, "--rows-per-fragment", "10") == 0
    return uri


def expected(uri: str) -> tuple[list[int], np.ndarray]:
    table = lance.dataset(uri).to_table(columns=["image", "label"])
    one_hot = np.eye(10, dtype=np.float32)[table.column("label").to_numpy()]
    return pc.binary_length(table.column("image")).to_pylist(), one_hot


def test_a_function_over_batches_writes_typed_columns_once_without_a_model_or_gpu(digits: str, tmp_path: Path) -> None:
    spec = map_spec(tmp_path / "job", digits, "tests.support.mapping:image_bytes")
    dry = subprocess.run([sys.executable, "-m", "lance_hpc.submit", str(spec), "--dry-run"], capture_output=True, text=True)
    assert dry.returncode == 0, dry.stdout + dry.stderr
    assert "new columns image_bytes (int32), one_hot (float32): function tests.support.mapping:image_bytes" in dry.stdout
    assert "--gpus" not in dry.stdout and "40 rows in 4 fragments" in dry.stdout, dry.stdout
    done = run_local(spec, {"CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("committed:") == 1 and "with image_bytes, one_hot for 40 rows" in done.stdout, done.stdout
    table = lance.dataset(digits).to_table(columns=["image_bytes", "one_hot"])
    assert table.schema.field("image_bytes").type == pa.int32()
    assert table.schema.field("one_hot").type == pa.list_(pa.float32(), 10)
    sizes, one_hot = expected(digits)
    assert table.column("image_bytes").to_pylist() == sizes
    assert np.array_equal(np.stack(table.column("one_hot").to_numpy(zero_copy_only=False)), one_hot)
    again = run_local(spec)
    assert again.returncode == 0 and "already committed" in again.stdout, again.stdout + again.stderr


def test_a_map_killed_mid_run_and_rerun_writes_each_fragment_once(digits: str, tmp_path: Path) -> None:
    # no restart inside the run: the killed run fails, and the user runs the same command again
    spec = map_spec(tmp_path / "job", digits, "tests.support.mapping:slow_image_bytes", max_restarts=0)
    killed = kill_rank_1_after_its_first_fragment(spec)
    output = killed.communicate(timeout=300)[0]
    assert killed.returncode not in (0, None) and "killed by SIGKILL" in output, output
    assert "image_bytes" not in lance.dataset(digits).schema.names  # nothing committed
    written = {path: path.stat().st_mtime_ns for path in (tmp_path / ".digits.lance.infer").glob("*/fragment-*.json")}
    assert written, "the killed run recorded no fragment"
    done = run_local(spec)
    assert done.returncode == 0, done.stdout + done.stderr
    counts = [tuple(map(int, found)) for found in re.findall(r"(\d+) fragment\(s\) written, (\d+) written before", done.stdout)]
    # a rank whose fragments were all written before computes nothing: when it starts after rank 0's
    # commit it finds that and ends without its line, so one line or two
    assert len(counts) in (1, 2) and sum(new for new, _ in counts) + len(written) == 4, done.stdout
    assert sum(before for _, before in counts) <= len(written), done.stdout
    assert all(path.stat().st_mtime_ns == mtime for path, mtime in written.items()), "a recorded fragment was written again"
    for fragment in lance.dataset(digits).get_fragments():  # one data file of the new columns per fragment
        assert len(fragment.metadata.files) == 2, fragment.metadata
    sizes, _ = expected(digits)
    assert lance.dataset(digits).to_table(columns=["image_bytes"]).column("image_bytes").to_pylist() == sizes


def test_a_map_refresh_maps_only_the_appended_rows_and_an_index_it_replaces_is_built_again(
    digits: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = map_spec(tmp_path / "job", digits, "tests.support.mapping:image_bytes")
    assert run_local(spec).returncode == 0
    assert ingest(f"webdataset:{tmp_path}/second/*.tar", digits, "--append", "--rows-per-fragment", "10") == 0
    appended = capsys.readouterr().out
    assert "no values in image_bytes, one_hot (written by a map job, from a function)" in appended, appended
    raw = yaml.safe_load(spec.read_text())
    raw["infer"]["refresh"] = "missing"
    spec.write_text(yaml.safe_dump(raw))
    done = run_local(spec)
    assert done.returncode == 0 and "refresh: 20 rows in 2 of 6 fragments lack image_bytes, one_hot" in done.stdout, (
        done.stdout + done.stderr
    )
    sizes, one_hot = expected(digits)
    table = lance.dataset(digits).to_table(columns=["image_bytes", "one_hot"])
    assert table.column("image_bytes").to_pylist() == sizes and len(sizes) == 60
    lance.dataset(digits).create_index("one_hot", "IVF_FLAT", name="one_hot_idx", num_partitions=2, metric="cosine")
    raw["infer"].update(refresh=None, overwrite=True, function="tests.support.mapping:slow_image_bytes")
    spec.write_text(yaml.safe_dump(raw))
    replaced = run_local(spec)
    assert replaced.returncode == 0, replaced.stdout + replaced.stderr
    assert "index one_hot_idx on one_hot: built again on the new values (IVF_FLAT)" in replaced.stdout, replaced.stdout
    (index,) = lance.dataset(digits).describe_indices()
    assert index.name == "one_hot_idx" and index.num_rows_indexed == 60, index
    found = lance.dataset(digits).to_table(nearest={"column": "one_hot", "q": one_hot[0], "k": 1}, columns=["label"])
    assert found.num_rows == 1


def test_map_specs_that_cannot_run_are_refused_before_any_rank_starts(digits: str, tmp_path: Path) -> None:
    spec = map_spec(tmp_path / "job", digits, "tests.support.mapping:image_bytes", columns=["image", "nope"])
    refused = run_local(spec)
    assert refused.returncode == 2 and "infer.columns: " in refused.stderr and "has no column nope" in refused.stderr
    raw = yaml.safe_load(spec.read_text())
    raw["infer"].update(columns=["image"], checkpoint="checkpoints/x", outputs={"image": "int32"})
    del raw["infer"]["function"]
    spec.write_text(yaml.safe_dump(raw))
    refused = run_local(spec)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr
    for text in (
        "infer.function: job: map has no function",
        "infer.checkpoint: job: map runs no model",
        "infer.outputs: image is",
    ):
        assert text in refused.stderr, refused.stderr
    assert "image_bytes" not in lance.dataset(digits).schema.names


def seven_rows(uri: str) -> list[tuple[int, str]]:
    """The (row, key) of every row whose label is the one fails_on_a_seven raises on."""
    table = lance.dataset(uri).to_table(columns=["label", "key"])
    return [
        (row, key)
        for row, (label, key) in enumerate(zip(table.column("label").to_pylist(), table.column("key").to_pylist()))
        if label == FAILING_LABEL
    ]


def test_a_function_raising_on_a_row_fails_the_job_once_naming_the_row(digits: str, tmp_path: Path) -> None:
    sevens = seven_rows(digits)
    assert sevens, "the digits hold a 7"
    spec = map_spec(tmp_path / "job", digits, "tests.support.mapping:fails_on_a_seven")
    failed = run_local(spec)
    assert failed.returncode == 1, failed.stdout + failed.stderr
    assert "Traceback" not in failed.stderr and "restart" not in failed.stderr, failed.stderr
    rank_lines = [line for line in failed.stderr.splitlines() if line.startswith("lance_hpc.run:")]
    assert rank_lines and all("ValueError: cannot size a 7" in line for line in rank_lines), failed.stderr
    row, key = sevens[0]
    assert any(f"row {row} (key {key!r}) of fragment {row // 10}" in line for line in rank_lines), failed.stderr
    assert "infer.on_error: skip" in failed.stderr, failed.stderr
    assert "image_bytes" not in lance.dataset(digits).schema.names


def test_a_function_raising_on_a_row_with_skip_writes_every_other_row_and_names_it(digits: str, tmp_path: Path) -> None:
    spec = map_spec(tmp_path / "job", digits, "tests.support.mapping:fails_on_a_seven", on_error="skip")
    done = run_local(spec)
    assert done.returncode == 0, done.stdout + done.stderr
    sevens = seven_rows(digits)
    for row, key in sevens:
        assert f"row {row} (key {key!r}) of fragment {row // 10} skipped" in done.stdout, done.stdout
    committed = next(line for line in done.stdout.splitlines() if line.startswith("committed:"))
    assert f"{len(sevens)} row(s) skipped (infer.on_error: skip)" in committed, committed
    table = lance.dataset(digits).to_table(columns=["image_bytes", "one_hot"])
    sizes, one_hot = expected(digits)
    skipped = {row for row, _ in sevens}
    got = table.column("image_bytes").to_pylist()
    for row in range(len(sizes)):
        assert got[row] == (None if row in skipped else sizes[row]), row
    vectors = table.column("one_hot").to_pylist()
    assert all((vectors[row] is None) == (row in skipped) for row in range(len(sizes)))


def test_a_map_whose_commit_lost_to_an_append_continues_on_the_next_run_keeping_its_fragments(
    digits: str, tmp_path: Path
) -> None:
    spec = map_spec(tmp_path / "job", digits, "tests.support.mapping:image_bytes_with_an_append", max_restarts=0)
    refused = run_local(spec, {APPEND_TO: digits})
    output = refused.stdout + refused.stderr
    assert refused.returncode != 0 and "image_bytes" not in lance.dataset(digits).schema.names, output
    assert "rows were appended to" in output and "the next run continues from version 2, keeping the 4 fragment(s)" in output
    assert "Traceback" not in output, output
    done = run_local(spec)
    assert done.returncode == 0, done.stdout + done.stderr
    counts = [tuple(map(int, found)) for found in re.findall(r"(\d+) fragment\(s\) written, (\d+) written before", done.stdout)]
    # only the appended fragment computed: rank 0's; rank 1, with nothing of its own, says so unless
    # it starts after rank 0's commit, which it then finds and ends on without a word
    assert (1, 2) in counts and set(counts) <= {(0, 2), (1, 2)} and sum(written for written, _ in counts) == 1, done.stdout
    assert "with image_bytes, one_hot for 50 rows" in done.stdout, done.stdout
    sizes, _ = expected(digits)
    table = lance.dataset(digits).to_table(columns=["image_bytes"])
    assert len(sizes) == 50 and table.column("image_bytes").to_pylist() == sizes


SCALED = """
import numpy as np

batches = [0]


def scaled(batch):
    batches[0] += 1
    if FAIL and batches[0] > 3:  # each rank's second fragment (3 batches of 4, 4 and 2 rows each)
        raise RuntimeError("scaled: failing on a later fragment, as the test asked")
    return {{"scaled": np.asarray(batch.column("label")) * {factor}}}
"""


def test_a_rerun_after_the_function_changed_starts_over_and_no_column_mixes_two_versions(digits: str, tmp_path: Path) -> None:
    source = tmp_path / "scale_labels.py"
    source.write_text("FAIL = True\n" + SCALED.format(factor=5))
    spec = map_spec(tmp_path / "job", digits, f"{source}:scaled", max_restarts=0, columns=["label"], outputs={"scaled": "int64"})
    failed = run_local(spec)
    assert failed.returncode != 0 and "failing on a later fragment" in failed.stdout + failed.stderr
    assert len(list((tmp_path / ".digits.lance.infer").glob("*/fragment-*.json"))) == 2  # one per rank, of 5 x label
    source.write_text("FAIL = False\n" + SCALED.format(factor=3))  # the user fixes the function
    done = run_local(spec)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("starting over: infer.function's source changed since an earlier run") == 1, done.stdout
    assert "wrote 2 fragment(s) of version 1; they are discarded" in done.stdout, done.stdout
    table = lance.dataset(digits).to_table(columns=["label", "scaled"])
    assert table.column("scaled").to_pylist() == [3 * label for label in table.column("label").to_pylist()]
    left = list((tmp_path / ".digits.lance.infer").glob("*/fragment-*.json"))
    assert len(left) == 4 and len({path.parent for path in left}) == 1, left  # the failed run's fragments are gone
