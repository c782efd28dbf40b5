"""Ingest formats: a format of one's own by import path goes through the same workers, split and
commit as the built-in ones; a bad one is one clear message; no module outside
``lance_hpc/ingest/formats`` branches on a format's name."""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from pathlib import Path

import lance
import pytest

from lance_hpc.cli.ingest import main as ingest_main
from lance_hpc.ingest.formats import FORMATS, format_class, is_shard_source
from lance_hpc.ingest.shards import split_of
from lance_hpc.spec import load_spec_text
from lance_hpc.spec.choices import SHARD_FORMATS, source_format

CSV_FORMAT = '''
import glob

import pyarrow.csv

from lance_hpc import ShardFormat


class CsvRows(ShardFormat):
    """Each CSV file a shard, its rows as they are."""

    def shards(self, source):
        return sorted(glob.glob(source))

    def batches(self, shard):
        yield from pyarrow.csv.read_csv(shard).to_batches(max_chunksize=7)


class Raises(CsvRows):
    def batches(self, shard):
        raise RuntimeError("the reader broke")


class NoShards(ShardFormat):
    def batches(self, shard):
        return iter(())


class NotAFormat:
    pass
'''


@pytest.fixture(autouse=True)
def fresh_modules(monkeypatch) -> Iterator[None]:
    """Each test imports its own my_formats.py: the one an earlier test imported is forgotten."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    yield
    sys.modules.pop("my_formats", None)


def write_csvs(directory: Path, files: int = 5, rows: int = 23) -> set[str]:
    """``files`` CSV files of ``rows`` rows each; returns the ids of every row."""
    (directory / "data").mkdir()
    ids = set()
    for file in range(files):
        lines = ["id,text,label"]
        for row in range(rows):
            ids.add(f"f{file}r{row}")
            lines.append(f"f{file}r{row},row {row} of file {file},{row % 3}")
        (directory / "data" / f"part{file}.csv").write_text("\n".join(lines) + "\n")
    (directory / "my_formats.py").write_text(CSV_FORMAT)
    return ids


def ingest(*args: object) -> int:
    return ingest_main([str(arg) for arg in args])


def test_a_csv_format_of_ones_own_ingests_every_row_once_on_two_workers(tmp_path: Path, monkeypatch, capsys) -> None:
    ids = write_csvs(tmp_path)
    monkeypatch.chdir(tmp_path)
    train, val = tmp_path / "train.lance", tmp_path / "val.lance"
    source = "my_formats.py:CsvRows:data/*.csv"
    code = ingest(source, train, "--val-uri", val, "--val-fraction", "0.3", "--nproc", 2)
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "committed:" in out.out
    train_rows, val_rows = (lance.dataset(str(uri)).to_table().to_pylist() for uri in (train, val))
    written = [row["id"] for row in train_rows + val_rows]
    assert len(written) == len(ids) == 115 and set(written) == ids
    assert val_rows and all(split_of(row["key"], 0.3) == "val" for row in val_rows)
    assert all(split_of(row["key"], 0.3) == "train" for row in train_rows)
    assert {row["label"] for row in train_rows} == {0, 1, 2} and isinstance(train_rows[0]["text"], str)
    schema = lance.dataset(str(train)).schema
    assert schema.metadata[b"source"] == b"my_formats.py:CsvRows"


def test_a_format_by_module_path_and_its_dry_run(tmp_path: Path, monkeypatch, capsys) -> None:
    write_csvs(tmp_path, files=2, rows=4)
    monkeypatch.syspath_prepend(str(tmp_path))
    code = ingest(f"my_formats:CsvRows:{tmp_path}/data/*.csv", tmp_path / "t.lance", "--dry-run")
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "2 shards of my_formats:CsvRows:" in out.out and "id (string)" in out.out
    assert not (tmp_path / "t.lance").exists()


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("missing.py:CsvRows:data/*.csv", "missing.py: no such file"),
        ("my_formats.py:Nothing:data/*.csv", "'my_formats.py' has no 'Nothing'"),
        ("my_formats.py:NotAFormat:data/*.csv", "my_formats.py:NotAFormat is not a lance_hpc.ShardFormat"),
        ("my_formats.py:NoShards:data/*.csv", "my_formats.py:NoShards defines no shards()"),
        ("my_formats.py:CsvRows:nowhere/*.csv", "my_formats.py:CsvRows lists no shard"),
        ("my_formats.py:Raises:data/*.csv", "my_formats.py:Raises raised RuntimeError reading it: the reader broke"),
    ],
)
def test_a_bad_format_is_one_message_naming_the_source_and_the_fix(
    tmp_path: Path, monkeypatch, capsys, source: str, message: str
) -> None:
    write_csvs(tmp_path, files=1, rows=3)
    monkeypatch.chdir(tmp_path)
    code = ingest(source, tmp_path / "t.lance")
    err = capsys.readouterr().err
    assert code != 0 and message in err and "fix:" in err and "Traceback" not in err, err
    assert not (tmp_path / "t.lance").exists()


def test_a_job_spec_takes_a_format_by_import_path_its_file_made_absolute(tmp_path: Path) -> None:
    text = "name: x\njob: ingest\ndata: {uri: /d/t.lance, ingest: {source: 'formats/csv.py:CsvRows:/data/*.csv'}}\n"
    spec = load_spec_text(text, "job.yaml", base_dir=tmp_path).spec
    assert spec.data.ingest is not None
    assert spec.data.ingest.source == f"{tmp_path}/formats/csv.py:CsvRows:/data/*.csv"  # not imported to validate


def test_validate_imports_a_format_of_ones_own_and_refuses_one_that_is_not_a_format(tmp_path: Path, monkeypatch, capsys) -> None:
    from lance_hpc.cli.validate import main as validate_main

    write_csvs(tmp_path, files=1, rows=2)
    monkeypatch.chdir(tmp_path)
    job = tmp_path / "ingest.yaml"
    for name, code, said in (("CsvRows", 0, "valid"), ("NotAFormat", 2, "is not a lance_hpc.ShardFormat")):
        sys.modules.pop("my_formats", None)
        job.write_text(f"name: x\njob: ingest\ndata: {{uri: t.lance, ingest: {{source: 'my_formats.py:{name}:data/*.csv'}}}}\n")
        assert validate_main([str(job)]) == code
        out = capsys.readouterr()
        assert said in out.out + out.err and "Traceback" not in out.err, out


def test_the_spec_names_the_registry_and_sources_of_each_form() -> None:
    assert set(SHARD_FORMATS) == set(FORMATS)
    assert source_format("python-stdlib") == ("python-stdlib", "")
    assert source_format("jsonl:s3://b/*.jsonl") == ("jsonl", "s3://b/*.jsonl")
    assert source_format("pkg.formats:Csv:s3://b/x") == ("pkg.formats:Csv", "s3://b/x")
    assert source_format("../f.py:Csv:") == ("../f.py:Csv", "")
    for other in ("torchvision:Food101:/root", "sklearn-digits", "skimage-photos:count=8", "jsonl", "/data/x.csv"):
        assert source_format(other) is None and not is_shard_source(other), other
    assert format_class("text:/x/*.txt")[0].corpus and not format_class("jsonl:/x/*.jsonl")[0].corpus


FORMAT_NAMES = "|".join(re.escape(name) for name in SHARD_FORMATS)
# A format's name compared, or a source tested for its prefix: the format module's business. (hf: as
# a prefix is also the tokenizer's, a model on the Hugging Face hub, so it is left out of that check.)
BRANCHES = re.compile(
    rf"""(==|!=)\s*["']({FORMAT_NAMES})["']|["']({FORMAT_NAMES})["']\s*(==|!=)|\bformat\s*(==|!=)"""
    rf"""|startswith\(["']({FORMAT_NAMES.replace("hf|", "")}):"""
)


def test_no_module_outside_the_formats_branches_on_a_format_name() -> None:
    package = Path(__file__).resolve().parents[1] / "lance_hpc"
    found = [
        f"{path.relative_to(package)}:{number}: {line.strip()}"
        for path in sorted(package.rglob("*.py"))
        if "ingest/formats" not in path.as_posix()
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if BRANCHES.search(line)
    ]
    assert not found, "\n".join(found)
