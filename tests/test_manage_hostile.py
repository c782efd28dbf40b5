"""``lance-hpc lineage``, ``status`` and a refresh read provenance and manifests that anyone with
write access to a shared dataset or checkpoint directory may have crafted: a FIFO, a device or a
huge file where a manifest belongs is refused at once with one message, a document of the wrong
shape is one message (or a column shown as invalid), never a traceback, and no control character
read from them reaches the terminal (``status``'s logs: tests/test_manage_readonly.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import lance
import pyarrow as pa
import pytest

from lance_hpc.checkpoint.manifests import MANIFEST_BYTES, checkpoint_name, manifest_name
from lance_hpc.cli import lineage
from lance_hpc.errors import UserError
from lance_hpc.lineage.provenance import PROVENANCE_KEY, Producer, column_document
from lance_hpc.output import printable

REPO_ROOT = Path(__file__).resolve().parents[1]
HOSTILE = "\x1b]0;pwned\x07\x1b[2J\nforged line\r"
# A hostile manifest read whole would take all the memory there is: the command runs with this much.
MEMORY_LIMIT = 4 << 30


# ``lance-hpc lineage TARGET`` with the child's memory bounded first.
BOUNDED_LINEAGE = (
    "import resource, runpy, sys\n"
    f"resource.setrlimit(resource.RLIMIT_AS, ({MEMORY_LIMIT}, {MEMORY_LIMIT}))\n"
    "sys.argv = ['lance_hpc', 'lineage', sys.argv[1]]\n"
    "runpy.run_module('lance_hpc', run_name='__main__')\n"
)


def run_lineage(target: Path) -> subprocess.CompletedProcess:
    """``lance-hpc lineage TARGET`` in a child with bounded memory; it must end within a minute."""
    environment = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    return subprocess.run(
        [sys.executable, "-c", BOUNDED_LINEAGE, str(target)],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        env=environment,
        timeout=60,
    )


def checkpoint_dir(tmp_path: Path) -> Path:
    """A checkpoint directory with one checkpoint (its bytes are never read) and no manifest yet."""
    directory = tmp_path / "checkpoints"
    directory.mkdir()
    (directory / checkpoint_name(5)).write_bytes(b"not read")
    return directory


@pytest.mark.parametrize("kind", ["fifo", "device", "oversize", "link"])
def test_a_manifest_that_is_no_small_regular_file_is_refused_at_once(tmp_path: Path, kind: str) -> None:
    directory = checkpoint_dir(tmp_path)
    manifest = directory / manifest_name(5)
    if kind == "fifo":
        os.mkfifo(manifest)
    elif kind == "device":
        manifest.symlink_to("/dev/zero")
    elif kind == "oversize":
        manifest.write_text(json.dumps({"step": 5, "saved_at": "x" * MANIFEST_BYTES}))
    else:
        (tmp_path / "elsewhere.json").write_text(json.dumps({"step": 5}))
        manifest.symlink_to(tmp_path / "elsewhere.json")
    shown = run_lineage(directory)
    assert shown.returncode == 2 and "Traceback" not in shown.stderr, shown.stdout + shown.stderr
    assert shown.stderr.startswith("error: ") and str(manifest) in shown.stderr, shown.stderr
    assert shown.stderr.count("error:") == 1 and "  fix: " in shown.stderr, shown.stderr


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"step": 5, "lineage": {"trained_on": ["x"]}}, "lineage.trained_on[0] is a string, not an object"),
        ({"step": 5, "lineage": {"trained_on": [{"uri": "a", "weight": "w"}]}}, "lineage.trained_on[0].weight"),
        ({"step": 5, "lineage": "x"}, "lineage is a string, not an object"),
        ({"step": 5, "epoch": True}, "epoch is true or false, not an integer"),
        ([1, 2], "a list, not an object"),
    ],
)
def test_a_manifest_of_the_wrong_shape_is_one_message_naming_the_file_and_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], fields: object, named: str
) -> None:
    directory = checkpoint_dir(tmp_path)
    (directory / manifest_name(5)).write_text(json.dumps(fields))
    assert lineage.main([str(directory)]) == 2
    printed = capsys.readouterr()
    assert str(directory / manifest_name(5)) in printed.err and named in printed.err, printed.err


def test_lineage_escapes_the_control_characters_of_a_manifest(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    directory = checkpoint_dir(tmp_path)
    source = {"uri": f"/data/{HOSTILE}", "version": 1, "filter": HOSTILE}
    manifest = {"step": 5, "saved_at": HOSTILE, "lineage": {"trained_on": [source], "job": HOSTILE, "spec": "s"}}
    (directory / manifest_name(5)).write_text(json.dumps(manifest))
    assert lineage.main([str(directory)]) == 0
    shown = capsys.readouterr().out
    assert "\x1b" not in shown and "\x07" not in shown and "\r" not in shown, repr(shown)
    assert not any(line.startswith("forged line") for line in shown.splitlines()), shown
    assert f"saved at {printable(HOSTILE)}" in shown and "\\x1b]0;pwned\\x07" in shown, shown


def dataset_with(tmp_path: Path, metadata: str, name: str = "score") -> str:
    """A Lance dataset whose column ``name`` carries ``metadata`` as its provenance."""
    uri = str(tmp_path / "crafted.lance")
    field = pa.field(name, pa.float32(), metadata={PROVENANCE_KEY: metadata})
    schema = pa.schema([pa.field("x", pa.int64()), field])
    lance.write_dataset(pa.table({"x": [1, 2], name: pa.array([0.5, 0.25], pa.float32())}).cast(schema), uri)
    return uri


def valid_document(uri: str, **changed: object) -> dict:
    made_by = Producer("infer", "/ckpt/a", 10, None, "blake2b:1")
    document = column_document(made_by, spec="s", uri=uri, version=1, filter=None, run="r", rows=2, fragments=1)
    return {**document, **changed}


CRAFTED = [
    ({"checkpoint": "x"}, "checkpoint is a string, not an object"),
    ({"checkpoint": {"dir": "/c", "step": "ten"}}, "checkpoint.step is a string, not an integer"),
    ({"refreshes": "abc"}, "refreshes is a string, not a list"),
    ({"refreshes": [{"rows": "many"}]}, "refreshes[0].rows is a string, not an integer"),
    ({"rows": [1]}, "rows is a list, not an integer"),
    ({"dataset": [1]}, "dataset is a list, not an object"),
    ({"checkpoint": {"dir": "/c", "lineage": {"trained_on": [7]}}}, "checkpoint.lineage.trained_on[0] is an integer"),
]


@pytest.mark.parametrize(("changed", "named"), CRAFTED)
def test_lineage_shows_a_column_whose_provenance_has_the_wrong_shape_as_invalid(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], changed: dict, named: str
) -> None:
    uri = dataset_with(tmp_path, json.dumps(valid_document(str(tmp_path / "crafted.lance"), **changed)))
    assert lineage.main([uri]) == 0
    printed = capsys.readouterr()
    assert "score (float): provenance invalid" in printed.out and named in printed.out, printed.out + printed.err


@pytest.mark.parametrize("text", ["{", "[1, 2]", "[" * 100_000 + "]" * 100_000, json.dumps({"x": "y" * (5 << 20)})])
def test_lineage_shows_provenance_that_is_no_json_object_or_too_large_as_invalid(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str
) -> None:
    uri = dataset_with(tmp_path, text)
    assert lineage.main([uri]) == 0
    printed = capsys.readouterr()
    assert "score (float): provenance invalid" in printed.out, printed.out + printed.err


def test_lineage_of_a_dataset_escapes_the_control_characters_of_its_provenance_and_column_names(tmp_path: Path) -> None:
    uri = str(tmp_path / "crafted.lance")
    document = valid_document(uri, function=HOSTILE, spec=HOSTILE, filter=HOSTILE, written_at=HOSTILE)
    document["checkpoint"]["dir"] = HOSTILE
    dataset_with(tmp_path, json.dumps(document), name=f"score{HOSTILE}")
    shown = run_lineage(Path(uri))
    assert shown.returncode == 0 and "Traceback" not in shown.stderr, shown.stdout + shown.stderr
    assert "\x1b" not in shown.stdout + shown.stderr and "\x07" not in shown.stdout, repr(shown.stdout)
    assert not any(line.startswith("forged line") for line in shown.stdout.splitlines()), shown.stdout
    assert "function \\x1b]0;pwned\\x07\\x1b[2J\\nforged line\\r" in shown.stdout, shown.stdout


@pytest.mark.parametrize(("changed", "named"), CRAFTED[:4])
def test_a_refresh_refuses_a_column_whose_provenance_has_the_wrong_shape(tmp_path: Path, changed: dict, named: str) -> None:
    from lance_hpc.backfill.missing import fills

    uri = dataset_with(tmp_path, json.dumps(valid_document(str(tmp_path / "crafted.lance"), **changed)))
    dataset, made_by = lance.dataset(uri), Producer("infer", "/ckpt/a", 10, None, "blake2b:1")
    with pytest.raises(UserError, match="score: its provenance is not one lance_hpc wrote") as refused:
        fills(dataset, uri, {"score": "float32"}, made_by, False)
    assert named in str(refused.value) and "infer.overwrite: true" in str(refused.value), str(refused.value)
    assert not fills(dataset, uri, {"score": "float32"}, made_by, True)  # overwrite: written whole again


def test_a_refresh_refusing_crafted_provenance_escapes_what_it_records(tmp_path: Path) -> None:
    from lance_hpc.backfill.missing import fills

    uri = dataset_with(tmp_path, json.dumps(valid_document(str(tmp_path / "crafted.lance"), function=HOSTILE)))
    with pytest.raises(UserError, match="score: it was computed by") as refused:
        fills(lance.dataset(uri), uri, {"score": "float32"}, Producer("infer", "/ckpt/a", 10, None, "blake2b:1"), False)
    assert "\x1b" not in str(refused.value) and "function \\x1b]0;pwned\\x07" in str(refused.value), str(refused.value)


def test_printable_escapes_control_characters_and_keeps_the_rest() -> None:
    assert printable("plain text, ünïcode → ok") == "plain text, ünïcode → ok"
    assert printable(HOSTILE) == "\\x1b]0;pwned\\x07\\x1b[2J\\nforged line\\r"
    assert printable("a\u202eb\tc\x00\x9b") == "a\\u202eb\\tc\\x00\\x9b"


def in_child(code: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter that must end within a minute (a FIFO opened to read blocks)."""
    environment = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT, env=environment, timeout=60
    )


def test_a_fifo_planted_as_the_job_records_of_a_log_directory_is_refused_at_once(tmp_path: Path) -> None:
    log_dir = tmp_path / "logs"
    log_dir.mkdir()
    os.mkfifo(log_dir / "jobs.jsonl")
    spec = {"name": "job", "data": {"uri": str(tmp_path / "d.lance")}, "slurm": {"log_dir": str(log_dir)}}
    result = in_child(
        "from lance_hpc.errors import UserError\n"
        "from lance_hpc.slurm import records\n"
        "from lance_hpc.spec import validate_spec\n"
        f"spec = validate_spec({spec!r}).spec\n"
        "try:\n    records.read_records(spec)\nexcept UserError as error:\n    print(error)\n"
    )
    assert result.returncode == 0, result.stderr
    assert "jobs.jsonl is not a regular file" in result.stdout, result.stdout


def test_a_fifo_or_a_link_among_the_ranks_statuses_is_skipped_by_status(tmp_path: Path) -> None:
    (tmp_path / "rank-0.json").write_text(json.dumps({"rank": 0, "host": "n1", "time": 0.0, "phase": "train", "step": 3}))
    os.mkfifo(tmp_path / "rank-1.json")
    (tmp_path / "rank-2.json").symlink_to("/dev/zero")
    result = in_child(
        f"from pathlib import Path\nfrom lance_hpc.runtime.watchdog import activity_line\nprint(activity_line(Path({str(tmp_path)!r})))\n"
    )
    assert result.returncode == 0, result.stderr
    assert "step 3" in result.stdout, result.stdout
