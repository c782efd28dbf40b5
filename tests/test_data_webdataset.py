"""Sources read within bounds: a WebDataset member or a file over the record limit, a sample with
too many fields, and every malformed tar header are one clear error or a counted skip, never a
traceback; a dry run's memory does not grow with the size of the members it does not need."""

from __future__ import annotations

import gzip
import io
import json
import subprocess
import sys
import tarfile
from pathlib import Path

import lance
import pytest

from lance_hpc.cli.ingest import main as ingest_main
from lance_hpc.limits import MAX_SAMPLE_FIELDS
from tests.support.shards import digit_rows

REPO = Path(__file__).resolve().parent.parent


def ingest(*args: object) -> int:
    return ingest_main([str(arg) for arg in args])


def add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def write_samples(path: Path, samples: list[dict[str, bytes]]) -> None:
    """A tar of samples ``s0000``, ``s0001``, ..., each member ``<key>.<extension>``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w") as tar:
        for index, members in enumerate(samples):
            for extension, data in members.items():
                add(tar, f"s{index:04d}.{extension}", data)


def digit_samples(count: int) -> list[dict[str, bytes]]:
    return [{"jpg": row["jpg"], "cls": str(row["cls"]).encode()} for row in digit_rows(count)]


def test_a_member_over_the_record_limit_is_skipped_and_counted_or_fails_the_ingest(tmp_path: Path, capsys) -> None:
    samples = digit_samples(3)
    samples[1]["npy"] = bytes((1 << 20) + 1)  # one byte over a 1 MiB limit
    write_samples(tmp_path / "wds" / "a.tar", samples)
    source = f"webdataset:{tmp_path}/wds/*.tar"
    assert ingest(source, tmp_path / "t.lance", "--max-record-mb", 1) == 0, capsys.readouterr().err
    assert "skipped 1 too big" in capsys.readouterr().out
    assert [row["key"] for row in lance.dataset(str(tmp_path / "t.lance")).to_table().to_pylist()] == ["s0000", "s0002"]

    assert ingest(source, tmp_path / "strict.lance", "--max-record-mb", 1, "--on-corrupt", "fail") == 2
    err = capsys.readouterr().err
    assert "a.tar: s0001.npy has 1,048,577 bytes, over max_record_mb (1 MiB)" in err and "fix: raise" in err, err
    assert ingest(source, tmp_path / "roomy.lance", "--max-record-mb", 2) == 0
    assert lance.dataset(str(tmp_path / "roomy.lance")).count_rows() == 3


def test_a_file_over_the_record_limit_is_skipped_not_read_whole(tmp_path: Path, capsys) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("a small document")
    (tmp_path / "docs" / "b.txt").write_text("x" * ((1 << 20) + 1))
    code = ingest(f"text:{tmp_path}/docs/*.txt", tmp_path / "t.lance", "--no-tokenize", "--max-record-mb", 1)
    printed = capsys.readouterr()
    assert code == 0, printed.err
    assert "skipped 1 too big" in printed.out
    assert [row["key"] for row in lance.dataset(str(tmp_path / "t.lance")).to_table().to_pylist()] == ["a.txt"]


@pytest.mark.parametrize("how", ["extensions", "json"])
def test_a_sample_with_more_fields_than_the_limit_is_skipped_not_made_columns(tmp_path: Path, capsys, how: str) -> None:
    samples = digit_samples(3)
    wide = range(MAX_SAMPLE_FIELDS + 1)
    if how == "extensions":
        samples[1].update({f"e{index}": b"x" for index in wide})
    else:
        samples[1]["json"] = json.dumps({f"f{index}": index for index in wide}).encode()
    write_samples(tmp_path / "wds" / "a.tar", samples)
    source = f"webdataset:{tmp_path}/wds/*.tar"
    assert ingest(source, tmp_path / "t.lance") == 0, capsys.readouterr().err
    assert "skipped 1 too many fields" in capsys.readouterr().out
    dataset = lance.dataset(str(tmp_path / "t.lance"))
    assert dataset.count_rows() == 2 and len(dataset.schema.names) < 10, dataset.schema.names

    assert ingest(source, tmp_path / "strict.lance", "--on-corrupt", "fail") == 2
    assert f"a.tar: sample 's0001' has more than {MAX_SAMPLE_FIELDS} fields" in capsys.readouterr().err


def test_class_names_in_cls_files_are_refused_with_the_fixes_the_ingest_has_and_those_fixes_work(tmp_path: Path, capsys) -> None:
    samples = digit_samples(4)
    for index, sample in enumerate(samples):
        sample["cls"] = [b"cat", b"dog"][index % 2]
        sample["json"] = json.dumps({"class_id": index % 2}).encode()
    write_samples(tmp_path / "wds" / "a.tar", samples)
    source = f"webdataset:{tmp_path}/wds/*.tar"
    assert ingest(source, tmp_path / "t.lance") == 2
    err = capsys.readouterr().err
    assert f"{tmp_path}/wds/a.tar: field 'cls' holds 'cat', a class name" in err and "Traceback" not in err, err
    assert "fix: map the label to a field of class numbers: --column label=FIELD" in err and "--column label=''" in err, err

    assert ingest(source, tmp_path / "by_field.lance", "--column", "label=class_id") == 0, capsys.readouterr().err
    rows = lance.dataset(str(tmp_path / "by_field.lance")).to_table(columns=["label", "cls"]).to_pylist()
    assert rows == [{"label": index % 2, "cls": ["cat", "dog"][index % 2]} for index in range(4)]
    assert ingest(source, tmp_path / "unlabelled.lance", "--column", "label=") == 0, capsys.readouterr().err
    unlabelled = lance.dataset(str(tmp_path / "unlabelled.lance"))
    assert "label" not in unlabelled.schema.names and unlabelled.to_table().column("cls").to_pylist() == ["cat", "dog"] * 2


def tar_header(name: str, size_field: bytes, checksum_delta: int = 0) -> bytes:
    """A ustar header written by hand, with any 12-byte size field and its checksum."""
    header = bytearray(512)
    header[: len(name)] = name.encode()
    header[100:108], header[108:116], header[116:124] = b"0000644\0", b"0000000\0", b"0000000\0"
    header[124:136] = size_field
    header[136:148] = b"00000000000\0"
    header[156:157] = b"0"
    header[257:265] = b"ustar\x0000"
    header[148:156] = b" " * 8
    header[148:156] = b"%06o\0 " % (sum(header) + checksum_delta)
    return bytes(header)


def base256(value: int) -> bytes:
    return b"\x80" + value.to_bytes(11, "big")


def good_tar() -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        add(tar, "s0000.cls", b"1")
        add(tar, "s0001.cls", b"2")
    return buffer.getvalue()


MALFORMED = {
    "a 1 TiB member": (tar_header("s0000.jpg", base256(1 << 40)) + bytes(1536), "ends inside 's0000.jpg'"),
    "a base-256 size of 2**80": (tar_header("s0000.jpg", base256(1 << 80)) + bytes(1536), "1,208,925,819,614,629,174,706,176"),
    "a negative base-256 size": (tar_header("s0000.jpg", b"\xff" * 12) + bytes(1536), "a negative size"),
    "a size that is not octal": (tar_header("s0000.jpg", b"00000000009\0") + bytes(1536), "not an octal number"),
    "a size with a sign": (tar_header("s0000.jpg", b"-0000000001\0") + bytes(1536), "not an octal number"),
    "a wrong checksum": (tar_header("s0000.cls", b"00000000001\0", checksum_delta=1) + bytes(1536), "checksum"),
    "a header cut short": (good_tar()[: 1024 + 100], "ends inside a header"),
    "a member cut short": (tar_header("s0000.jpg", b"00000010000\0") + bytes(100), "ends inside 's0000.jpg'"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
@pytest.mark.parametrize("on_corrupt", ["skip", "fail"])
def test_every_malformed_tar_header_is_one_clear_error_naming_the_file(
    tmp_path: Path, capsys, case: str, on_corrupt: str
) -> None:
    data, expected = MALFORMED[case]
    (tmp_path / "wds").mkdir()
    (tmp_path / "wds" / "bad.tar").write_bytes(data)
    assert len(data) < 4096  # a few KB declaring what they like
    assert ingest(f"webdataset:{tmp_path}/wds/*.tar", tmp_path / "t.lance", "--on-corrupt", on_corrupt) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path}/wds/bad.tar is not a tar file, or is damaged" in err and expected in err, err
    assert "fix: mend or remove the file" in err and "Traceback" not in err


# mtime=0: the same bytes in every test process (pytest-xdist compares what each collected)
@pytest.mark.parametrize(
    ("case", "data"),
    [("not gzip", b"not gzip at all" * 50), ("cut short", gzip.compress(good_tar(), mtime=0)[:60])],
    ids=["not gzip", "cut short"],
)
def test_a_damaged_gzip_is_one_clear_error_naming_the_file(tmp_path: Path, capsys, case: str, data: bytes) -> None:
    (tmp_path / "wds").mkdir()
    (tmp_path / "wds" / "bad.tar.gz").write_bytes(data)
    assert ingest(f"webdataset:{tmp_path}/wds/*.tar.gz", tmp_path / "t.lance") == 2
    err = capsys.readouterr().err
    assert f"{tmp_path}/wds/bad.tar.gz: cannot read it as webdataset" in err and "fix: mend or remove" in err, err


def write_zeros_sample(path: Path, member_bytes: int) -> None:
    """A .tar.gz of one sample: a member of ``member_bytes`` zeros (a few hundred KB compressed)."""

    class Zeros(io.RawIOBase):
        def __init__(self) -> None:
            self.left = member_bytes

        def read(self, size: int = -1) -> bytes:
            size = self.left if size < 0 else min(size, self.left)
            self.left -= size
            return bytes(size)

    with gzip.open(path, "wb", compresslevel=1) as compressed, tarfile.open(fileobj=compressed, mode="w") as tar:
        info = tarfile.TarInfo("s0000.npy")
        info.size = member_bytes
        tar.addfile(info, Zeros())
        add(tar, "s0000.cls", b"3")


# The child's own peak: VmHWM starts afresh at exec, where getrusage's ru_maxrss keeps the parent's
# (the test process's) peak from before the fork.
PEAK = (
    "import re, sys\n"
    "from lance_hpc.cli.ingest import main\n"
    "code = main(sys.argv[1:])\n"
    "status = open('/proc/self/status').read()\n"
    "print('peak-kib', re.search(r'VmHWM:\\s*(\\d+) kB', status).group(1))\n"
    "sys.exit(code)\n"
)


def dry_run_peak_kib(source: Path, target: Path) -> int:
    """The peak resident memory of a dry run in a fresh process (KiB)."""
    args = [f"webdataset:{source}", str(target), "--dry-run", "--max-record-mb", "512"]
    result = subprocess.run([sys.executable, "-c", PEAK, *args], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "schema: label (int64), key (string), npy (binary)" in result.stdout, result.stdout
    return int(result.stdout.rsplit("peak-kib", 1)[1].split()[0])


def test_a_dry_run_does_not_hold_members_it_does_not_need(tmp_path: Path) -> None:
    """The plan reads the first shard for its columns and its size: a 128 MiB member (within the
    record limit) costs the dry run no more memory than a 1 KiB one."""
    write_zeros_sample(tmp_path / "small.tar.gz", 1 << 10)
    write_zeros_sample(tmp_path / "big.tar.gz", 128 << 20)
    small = dry_run_peak_kib(tmp_path / "small.tar.gz", tmp_path / "small.lance")
    big = dry_run_peak_kib(tmp_path / "big.tar.gz", tmp_path / "big.lance")
    assert big - small < 48 << 10, f"peak of the dry run: {big:,} KiB with a 128 MiB member, {small:,} KiB with 1 KiB"


def test_a_json_member_nested_past_the_recursion_limit_is_one_clear_error(tmp_path: Path, capsys) -> None:
    samples = digit_samples(2)
    samples[1]["json"] = b"[" * 100_000 + b"]" * 100_000
    write_samples(tmp_path / "wds" / "a.tar", samples)
    assert ingest(f"webdataset:{tmp_path}/wds/*.tar", tmp_path / "t.lance") == 2
    err = capsys.readouterr().err
    assert "a.tar: s0001.json is not JSON (RecursionError" in err and "Traceback" not in err, err
