"""Files lance_hpc rewrites for the user (the tuned spec above all) are replaced whole: a write that
fails part-way (a full quota) leaves the file byte for byte as it was and no temporary file beside
it, the file keeps its mode, and the tuner refuses values it cannot rewrite in place (an alias, an
anchor) and any edit that does not read back as meant."""

from __future__ import annotations

import errno
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lance_hpc.bench.job import write_choice
from lance_hpc.cli.bench import main
from lance_hpc.errors import UserError
from lance_hpc.spec.yaml_text import set_block_keys
from lance_hpc.storage import files
from lance_hpc.storage.files import write_file
from tests.support.jobs import REPO_ROOT

SPEC = (
    "# my job: comments and layout are the user's\n"
    "name: tune-me\n"
    "slurm: {{cpus_per_task: 2}}\n"
    "data:\n"
    "  uri: {uri}   # the photos\n"
    "  batch_size: 16\n"
    "  num_workers: 1          # to be tuned\n"
    "task: {{name: image_classification, options: {{image_size: 32}}}}\n"
)
CHOICE = {"num_workers": 4, "prefetch_factor": 2, "io_depth": 8}
FLAGS = " ".join(f"--set data.{name}={value}" for name, value in CHOICE.items())


def spec_file(tmp_path: Path, text: str | None = None, mode: int = 0o640) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(text if text is not None else SPEC.format(uri=tmp_path / "data.lance"))
    path.chmod(mode)
    return path


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def left_beside(path: Path) -> list[str]:
    return sorted(entry.name for entry in path.parent.iterdir() if entry.name != path.name)


def test_the_tuned_spec_is_written_with_its_comments_and_its_mode(tmp_path: Path) -> None:
    path = spec_file(tmp_path, mode=0o640)  # a mode no umask gives a new file
    assert write_choice(str(path), CHOICE, FLAGS) == 0
    text = path.read_text()
    assert text.startswith("# my job") and "# the photos" in text and "# to be tuned" in text, text
    assert {key: yaml.safe_load(text)["data"][key] for key in CHOICE} == CHOICE
    assert oct(mode(path)) == oct(0o640)
    assert left_beside(path) == []


def test_a_linked_spec_stays_a_link_and_its_target_is_tuned(tmp_path: Path) -> None:
    (tmp_path / "specs").mkdir()
    target = spec_file(tmp_path / "specs")
    link = tmp_path / "job.yaml"
    link.symlink_to(target)
    assert write_choice(str(link), CHOICE, FLAGS) == 0
    assert link.is_symlink() and yaml.safe_load(target.read_text())["data"]["num_workers"] == 4


def test_a_quota_that_fills_mid_write_leaves_the_spec_byte_for_byte_and_no_temporary_file(tmp_path: Path) -> None:
    path = spec_file(tmp_path)
    before = path.read_bytes()
    # A real write that stops part-way: a file size limit (as a full quota does) in a child process,
    # below the spec's size; the write past it fails with EFBIG instead of the signal ending the child.
    script = (
        "import resource, signal, sys\n"
        "from lance_hpc.bench.job import write_choice\n"
        "from lance_hpc.errors import UserError\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        f"resource.setrlimit(resource.RLIMIT_FSIZE, ({len(before) // 2}, resource.RLIM_INFINITY))\n"
        "try:\n"
        f"    write_choice({str(path)!r}, {CHOICE!r}, {FLAGS!r})\n"
        "except UserError as error:\n"
        "    print(error)\n"
        "    sys.exit(2)\n"
    )
    environ = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "PYTHONDONTWRITEBYTECODE": "1"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=environ, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "could not write" in done.stdout and "left as it is" in done.stdout and FLAGS in done.stdout, done.stdout
    assert path.read_bytes() == before, f"the spec changed:\n{path.read_text()}"
    assert left_beside(path) == []


@pytest.mark.parametrize("failing", ["write", "fsync"])
def test_no_space_while_writing_or_syncing_leaves_the_file_as_it_was(tmp_path: Path, monkeypatch, failing: str) -> None:
    path = spec_file(tmp_path)
    before = path.read_bytes()

    def no_space(*args: object) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    if failing == "fsync":
        monkeypatch.setattr(files.os, "fsync", no_space)
    else:
        real_open = open

        class HalfWritten:
            """The temporary file: half of what is written lands, then the disk is full."""

            def __init__(self, *args: object, **kwargs: object) -> None:
                self.file = real_open(*args, **kwargs)  # type: ignore[call-overload]

            def __enter__(self) -> HalfWritten:
                return self

            def __exit__(self, *exc_info: object) -> None:
                self.file.close()

            def write(self, data: bytes) -> int:
                self.file.write(data[: len(data) // 2])
                self.file.flush()
                no_space()
                return 0

        monkeypatch.setattr(files, "open", HalfWritten, raising=False)
    with pytest.raises(UserError, match="No space left on device"):
        write_choice(str(path), CHOICE, FLAGS)
    assert path.read_bytes() == before, f"the spec changed:\n{path.read_text()}"
    assert left_beside(path) == []


@pytest.mark.parametrize(
    "text, named",
    [
        (
            "slurm:\n  cpus_per_task: &cpus 8\ndata:\n  uri: x\n  num_workers: *cpus   # as many as cpus\n",
            "alias of anchor &cpus",
        ),
        ("data:\n  uri: x\n  num_workers: &cpus 8\nslurm:\n  cpus_per_task: *cpus\n", "holds anchor &cpus"),
    ],
)
def test_an_aliased_or_anchored_value_is_refused_and_the_spec_left_as_it_was(tmp_path: Path, text: str, named: str) -> None:
    path = spec_file(tmp_path, text)
    with pytest.raises(UserError) as refused:
        write_choice(str(path), CHOICE, FLAGS)
    message = str(refused.value)
    assert message.startswith("data.num_workers in ") and named in message, message
    assert "fix: " in message and FLAGS in message, message
    assert path.read_text() == text


def test_the_tuner_refuses_an_alias_before_it_measures(tmp_path: Path, capsys) -> None:
    text = (
        SPEC.format(uri=tmp_path / "missing.lance")
        .replace("num_workers: 1", "num_workers: *cpus")
        .replace("slurm: {cpus_per_task: 2}", "slurm: {cpus_per_task: &cpus 2}")
    )
    path = spec_file(tmp_path, text)
    code = main([str(path), "--tune", "--write", "--out", str(tmp_path / "out")])
    printed = capsys.readouterr()
    assert code == 2 and "data.num_workers in" in printed.err and "alias of anchor &cpus" in printed.err, printed
    assert "images/s" not in printed.out, printed.out  # nothing measured
    assert path.read_text() == text


def test_an_edit_that_does_not_read_back_as_meant_is_refused() -> None:
    text = "data:\n  uri: /mine.lance\n  num_workers: 1\n"
    with pytest.raises(UserError, match="did not read back as meant") as refused:
        set_block_keys(text, "data", {"num_workers": "4\n  uri: /elsewhere.lance"}, "job.yaml")
    assert "job.yaml was left as it is" in str(refused.value)


def test_write_file_keeps_an_existing_mode_and_gives_a_new_file_the_umask_default(tmp_path: Path) -> None:
    private = tmp_path / "private.json"
    private.write_text("{}")
    private.chmod(0o600)
    write_file(private, '{"rows": 1}')
    assert (private.read_text(), oct(mode(private))) == ('{"rows": 1}', oct(0o600))
    umask = os.umask(0o022)
    try:
        write_file(tmp_path / "new.json", "{}")
    finally:
        os.umask(umask)
    assert oct(mode(tmp_path / "new.json")) == oct(0o644)
    assert sorted(entry.name for entry in tmp_path.iterdir()) == ["new.json", "private.json"]
