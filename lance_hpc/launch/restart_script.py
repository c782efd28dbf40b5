"""What a batch script needs to restart its job inside the allocation (slurm.max_restarts): the
command srun runs through (:func:`restart_supervisor`, and for submitit's script a shell function
``srun``), and the supervisor itself (:func:`supervisor_program`), written beside the script.

The supervisor (:mod:`lance_hpc.launch.restarts`) runs with the node's own ``python3 -I``, outside
any container, where lance_hpc may not be installed. So it is one file, ``<log_dir>/<name>.restarts.pyz``:
a zip application that holds its own modules, its command line (:mod:`lance_hpc.cli.restarts`) and
:mod:`lance_hpc.runtime.ports` (whose port holder it runs before each restart),
:mod:`lance_hpc.runtime.restart_variables` (what it tells the ranks) and
:mod:`lance_hpc.storage.shared_files` (how it opens the files in the log directory) under empty
``__init__`` files of the packages above them, and a ``__main__`` that runs the command line. Python puts the file
first on sys.path even with ``-I``; the modules in it import nothing else but the standard library.

The log directory may be a group's, where another user could put a program of theirs in its place
after submission. So the script does not hand the path to Python: a few lines in the script itself
(:data:`RUN_OWN_PROGRAM`, which SLURM keeps as it was submitted) open the file without following a
link or waiting on a FIFO, refuse it unless it is a regular file of the job's user that nobody else
may write, and run what they opened, through its descriptor, not what the path names a moment later.
"""

from __future__ import annotations

import io
import shlex
import zipfile
from pathlib import Path

from lance_hpc.launch.paths import JobPaths, job_reference
from lance_hpc.runtime.watchdog import watch_dir
from lance_hpc.spec import JobSpec

PACKAGE = Path(__file__).resolve().parents[1]  # lance_hpc/
# What the program holds of lance_hpc (relative to the package): the supervisor's modules, its
# command line, the port holder's module, the variables it sets for the ranks and the checks of
# files in a shared directory.
PACKED = ("launch/restarts", "cli/restarts.py", "runtime/ports.py", "runtime/restart_variables.py", "storage/shared_files.py")
MAIN = "import sys\n\nfrom lance_hpc.cli.restarts import main\n\nsys.exit(main())\n"
# The same bytes for the same sources: a re-rendered job writes the same file.
ZIP_TIME = (1980, 1, 1, 0, 0, 0)
# python3 -I -c RUN_OWN_PROGRAM <program> ARGS: the checks of lance_hpc.storage.shared_files.open_own
# (private), written out, since nothing of lance_hpc can be imported before the program is checked.
RUN_OWN_PROGRAM = """import os, runpy, stat, sys
program = sys.argv.pop(1)
try:
    descriptor = os.open(program, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    info = os.fstat(descriptor)
    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o022:
        raise OSError(f"not a regular file of yours that only you may write (uid {info.st_uid}, mode {info.st_mode:o})")
except OSError as error:
    print(f"lance_hpc: {program} is not run: {error}\\n  fix: submit the job again from a log directory"
          " (slurm.log_dir) where nobody else can replace its files", file=sys.stderr)
    sys.exit(2)
runpy.run_path(f"/proc/self/fd/{descriptor}", run_name="__main__")  # the file checked, whatever the path names now
"""


def packed_sources() -> dict[str, str]:
    """Path in the program -> source: the modules :data:`PACKED` names, the empty ``__init__`` files
    of the packages above them, and ``__main__.py``."""
    sources = {"__main__.py": MAIN}
    for name in PACKED:
        path = PACKAGE / name
        for module in sorted(path.glob("*.py")) if path.is_dir() else [path]:
            inside = Path("lance_hpc") / module.relative_to(PACKAGE)
            sources[inside.as_posix()] = module.read_text()
            for parent in inside.parents:
                if parent != Path("."):
                    sources.setdefault(f"{parent.as_posix()}/__init__.py", "")
    return dict(sorted(sources.items()))


def supervisor_program() -> bytes:
    """The supervisor as the one file ``python3 -I`` runs (a zip application)."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for name, source in packed_sources().items():
            entry = zipfile.ZipInfo(name, ZIP_TIME)
            entry.compress_type = zipfile.ZIP_DEFLATED
            entry.external_attr = 0o644 << 16
            archive.writestr(entry, source)
    return buffer.getvalue()


def restart_supervisor(spec: JobSpec) -> str:
    """What runs srun when the job restarts inside its allocation (``python3 -I -c RUN_OWN_PROGRAM
    <log_dir>/<name>.restarts.pyz ... --``), with the node's own Python, outside any container; empty for slurm.max_restarts: 0."""
    slurm = spec.slurm
    if not slurm.max_restarts:
        return ""
    paths, job = JobPaths.of(spec), job_reference(spec)
    options = [
        f"--max-restarts={slurm.max_restarts}",
        f"--nodes={slurm.nodes}",
        f"--min-nodes={slurm.fewest_nodes}",
        f"--tasks-per-node={slurm.ntasks_per_node}",
        *([] if slurm.restart_standby else ["--no-standby"]),
    ]
    words = ["python3", "-I", "-c", RUN_OWN_PROGRAM, str(paths.restarts_program), *options]
    record = f'--record={shlex.quote(str(paths.attempts) + "/")}"{job}"'
    # a sweep's runs have names of their own, which the script cannot know: their steps go unpublished here
    progress = (
        "" if spec.sweep else f' --progress={shlex.quote(str(watch_dir(slurm.log_dir, spec.name, None).parent) + "/")}"{job}"'
    )
    return f"{shlex.join(words)} {record}{progress} --"


def srun_through_restarts(spec: JobSpec) -> list[str]:
    """For submitit's script, whose srun line lance_hpc does not write: a shell function ``srun``
    that runs the real one through the restart supervisor."""
    supervisor = restart_supervisor(spec)
    if not supervisor:
        return []
    return [
        "# restarts inside this allocation (slurm.max_restarts): the srun line below runs through the supervisor",
        f'srun() {{ {supervisor} srun "$@"; }}',
    ]
