"""Rendering: golden scripts, every shipped job, site templates, and hostile strings in every field.

Golden files live in tests/golden/. After an intended change, re-record them with
    LANCE_HPC_RECORD_GOLDEN=1 python -m pytest tests/test_render.py
and review the diff in git.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from lance_hpc.errors import UserError
from lance_hpc.launch import render, restart_script
from lance_hpc.launch.paths import JobPaths
from lance_hpc.spec import REDACTED, JobSpec, load_spec, validate_spec
from tests.support.render import check_golden, write_restarts_program

ROOT = Path(__file__).resolve().parents[1]
JOBS = sorted((ROOT / "jobs").glob("*.yaml"))
EXAMPLES = sorted((ROOT / "examples").glob("*/job.yaml"))
BASE_DIR = "/project"  # relative paths resolve here, so golden files do not depend on the checkout

FULL_SPEC: dict[str, Any] = {
    "name": "full-options",
    "slurm": {
        "partition": "gpu",
        "nodes": 4,
        "gpus_per_node": 8,
        "cpus_per_task": 12,
        "mem_gb": 480,
        "time": "1-12:00:00",
        "account": "proj-123",
        "qos": "high",
        "constraint": "a100&ib",
        "exclusive": True,
        "setup": ["module load cuda/12.4", "source /opt/venvs/train/bin/activate", "export NCCL_DEBUG=WARN"],
        "extra_flags": {"mail_type": "END,FAIL", "reservation": "big-run", "contiguous": True, "nice": 10, "exclude": None},
        "signal_delay_s": 300,
    },
    "data": {"uri": "s3://bucket/train.lance", "storage_options": {"endpoint": "http://127.0.0.1:9000"}},
}


def spec_from(raw: dict[str, Any]) -> JobSpec:
    return validate_spec(raw, base_dir=BASE_DIR).spec


def spec_file_of(spec: JobSpec) -> str:
    """The spec file the job's tasks read (a sweep's, with {index} for the array task id)."""
    return JobPaths.of(spec).run_specs if spec.sweep else f"{spec.slurm.log_dir}/{spec.name}.spec.yaml"


@pytest.mark.parametrize("job", JOBS, ids=lambda path: path.name)
def test_shipped_jobs_validate_and_match_golden(job: Path) -> None:
    spec = load_spec(job, base_dir=BASE_DIR).spec
    check_golden(job.with_suffix(".sbatch").name, render.render_sbatch(spec, spec_file_of(spec)))


@pytest.mark.parametrize("job", EXAMPLES, ids=lambda path: path.parent.name)
def test_example_jobs_validate_and_match_golden(job: Path) -> None:
    """Examples name files of their own (entry: examples/...py:main), which must exist to validate:
    they resolve against the checkout, shown as BASE_DIR in the golden file."""
    spec = load_spec(job, base_dir=ROOT).spec
    script = render.render_sbatch(spec, spec_file_of(spec)).replace(str(ROOT), BASE_DIR)
    check_golden(f"example-{job.parent.name}.sbatch", script)


def test_every_option_matches_golden() -> None:
    spec = spec_from(FULL_SPEC)
    check_golden("full-options.sbatch", render.render_sbatch(spec, spec_file_of(spec)))


def test_shipped_jobs_exist() -> None:
    assert {path.name for path in JOBS} >= {
        "quickstart.yaml",
        "lm_quickstart.yaml",
        "map_gpu.yaml",
        "iterable_gpu.yaml",
        "s3.yaml",
        "sweep_example.yaml",
    }
    assert {path.parent.name for path in EXAMPLES} >= {"script_mode"}


def test_script_requests_what_the_spec_says() -> None:
    spec = spec_from(FULL_SPEC)
    script = render.render_sbatch(spec, "/project/x.spec.yaml")
    flags = dict(render.sbatch_directives(script))
    assert flags == {
        "account": "proj-123", "constraint": "a100&ib", "cpus-per-task": "12",
        "error": "/project/logs/full-options/full-options-%j.err", "exclusive": True,
        "contiguous": True, "gpus-per-node": "8", "job-name": "full-options", "mail-type": "END,FAIL",
        "mem": "480GB", "nice": "10", "no-kill": True, "nodes": "4", "ntasks-per-node": "8", "open-mode": "append",
        "output": "/project/logs/full-options/full-options-%j.out", "partition": "gpu", "qos": "high",
        "requeue": True, "reservation": "big-run", "signal": "USR2@300", "time": "2160",
    }  # fmt: skip
    directive_lines = [line for line in script.splitlines() if line.startswith("#SBATCH")]
    assert directive_lines == sorted(directive_lines)
    # the supervisor, then srun (restarts inside the allocation), on two lines
    launch = shlex.split(script[script.rindex("\npython3 -I ") :].replace("\\\n", " "))
    program = "/project/logs/full-options/full-options.restarts.pyz"
    assert launch[:5] == [
        "python3",
        "-I",
        "-c",
        restart_script.RUN_OWN_PROGRAM,
        program,
    ]  # run once checked: see test_restart_files
    assert "--max-restarts=2" in launch and "--nodes=4" in launch and "--min-nodes=4" in launch
    assert launch[launch.index("--") + 1 :] == [
        "srun", "--label", "--kill-on-bad-exit=1", "--cpus-per-task=12",
        "python3", "-P", "-m", "lance_hpc.run", "/project/x.spec.yaml",
    ]  # fmt: skip
    body = script[script.index("set -eo pipefail") :]
    assert body.index("module load cuda/12.4") < body.index("export OMP_NUM_THREADS=12") < body.index("srun ")


@pytest.mark.parametrize(
    ("extra_flags", "message"),
    [
        ({"time": "10"}, "--time is set from slurm.time"),
        ({"job_name": "x"}, "--job-name is set from name"),
        ({"bad flag": "x"}, "is not an sbatch flag name"),
        ({"comment": "two\nlines"}, "control character"),
    ],
)
def test_extra_flags_are_checked(extra_flags: dict[str, str], message: str) -> None:
    spec = spec_from({"name": "x", "data": {"uri": "/d"}, "slurm": {"extra_flags": extra_flags}})
    with pytest.raises(UserError, match=message):
        render.render_sbatch(spec, "/x.yaml")


def test_secrets_in_the_environment_never_reach_the_script(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "very-secret-value")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDSECRETID")
    spec = load_spec(ROOT / "jobs" / "s3.yaml", base_dir=BASE_DIR).spec
    script = render.render_sbatch(spec, spec_file_of(spec))
    assert "very-secret-value" not in script and "AKIDSECRETID" not in script and "AWS_" not in script


def test_site_template_gets_the_same_variables(tmp_path: Path) -> None:
    template = tmp_path / "site.sbatch.j2"
    template.write_text(
        textwrap.dedent("""\
        #!/bin/bash
        {% for line in sbatch_lines %}
        {{ line }}
        {% endfor %}
        #SBATCH --licenses=scratch
        module purge
        {% for line in setup + exports %}
        {{ line }}
        {% endfor %}
        echo {{ spec.slurm.partition }} {{ spec.name | quote }}
        {{ restarts }} {{ srun }} apptainer exec /images/train.sif {{ command }}
        """)
    )
    spec = spec_from({"name": "site", "data": {"uri": "/d"}, "slurm": {"template": str(template), "partition": "a b"}})
    script = render.render_sbatch(spec, "/x.yaml")
    assert "#SBATCH --licenses=scratch" in script
    assert "echo 'a b' site" in script  # values are quoted on output, also in site templates
    assert script.rstrip().endswith("apptainer exec /images/train.sif python3 -P -m lance_hpc.run /x.yaml")
    assert f"{restart_script.restart_supervisor(spec)} srun " in script


def test_a_site_template_without_the_restart_supervisor_is_refused_unless_restarts_are_off(tmp_path: Path) -> None:
    template = tmp_path / "site.sbatch.j2"
    template.write_text("#!/bin/bash\n{% for line in sbatch_lines %}\n{{ line }}\n{% endfor %}\n{{ srun }} {{ command }}\n")
    raw = {"name": "site", "data": {"uri": "/d"}, "slurm": {"template": str(template)}}
    with pytest.raises(UserError, match=r"without the restart supervisor that slurm.max_restarts \(2\) needs"):
        render.render_sbatch(spec_from(raw), "/x.yaml")
    raw["slurm"]["max_restarts"] = 0
    script = render.render_sbatch(spec_from(raw), "/x.yaml")
    assert "--no-kill" not in script and script.rstrip().endswith("lance_hpc.run /x.yaml")


def test_a_site_template_sees_the_spec_with_credentials_redacted(tmp_path: Path) -> None:
    """Validation refuses credentials in a spec; a spec built without it still renders none."""
    template = tmp_path / "site.sbatch.j2"
    template.write_text(
        "#!/bin/bash\n# {{ spec.data.storage_options.azure_storage_sas_token }} {{ spec.data.storage_options.region }}"
        " {{ spec.slurm.setup[0] }}\n{{ launch }}\n"
    )
    spec = JobSpec.model_validate(
        {
            "name": "site",
            "data": {"uri": "/d", "storage_options": {"azure_storage_sas_token": "sv=1&sig=SECRET1", "region": "eu"}},
            "slurm": {"template": str(template), "setup": ["export HF_TOKEN=SECRET2"]},
        }
    )
    script = render.render_sbatch(spec, "/x.yaml")
    assert "SECRET" not in script
    assert f"# '{REDACTED}' eu 'export HF_TOKEN={REDACTED}'\n" in script


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("{{ no_such_variable }}", "no_such_variable"),  # StrictUndefined
        ("{% for x in %}", "line 1"),
    ],
)
def test_broken_site_template_is_a_user_error(tmp_path: Path, source: str, message: str) -> None:
    template = tmp_path / "broken.j2"
    template.write_text(source)
    spec = spec_from({"name": "x", "data": {"uri": "/d"}, "slurm": {"template": str(template)}})
    with pytest.raises(UserError, match=message):
        render.render_sbatch(spec, "/x.yaml")


# ---- hostile strings --------------------------------------------------------------------------

STRING_FIELDS = ("partition", "account", "qos", "constraint")
SHELL_ATTACKS = [
    "$(touch {marker})",
    "`touch {marker}`",
    "x; touch {marker}",
    "x' ; touch {marker} ; '",
    'x" ; touch {marker} ; "',
    "x\ntouch {marker}",
    "x\n#SBATCH --partition=evil\ntouch {marker}",
    "x\rtouch {marker}",
    "${{IFS}}touch${{IFS}}{marker}",
    "x #SBATCH --wrap=touch",
]


def hostile_spec(value: str, tmp_path: Path) -> dict[str, Any]:
    slurm: dict[str, Any] = {field: value for field in STRING_FIELDS}
    slurm["extra_flags"] = {"comment": value}
    # braces would be read as placeholders, which the spec rejects before rendering
    slurm["log_dir"] = str(tmp_path / value.replace("/", "_").replace("{", "(").replace("}", ")"))
    return {"name": "hostile", "slurm": slurm, "data": {"uri": "/d"}}


def expected_directives(spec: JobSpec) -> dict[str, str | bool]:
    stdout, stderr = (JobPaths.of(spec).stdout, JobPaths.of(spec).stderr)
    flags = {name: str(value) if value is not True else True for name, value in render.resource_flags(spec).items()}
    return {**flags, "output": stdout, "error": stderr}


def run_with_shims(script: str, tmp_path: Path, spec: JobSpec) -> subprocess.CompletedProcess[str]:
    """Run a rendered script with bash; srun is a shim that records its arguments."""
    write_restarts_program(spec)
    shims = tmp_path / "shims"
    shims.mkdir(exist_ok=True)
    srun = shims / "srun"
    srun.write_text('#!/bin/bash\nprintf "%s\\n" "$@" > "$SRUN_ARGS_FILE"\n')
    srun.chmod(0o755)
    script_path = tmp_path / "job.sbatch"
    script_path.write_text(script)
    environ = {"PATH": f"{shims}:{os.environ['PATH']}", "SRUN_ARGS_FILE": str(tmp_path / "srun.args"), "HOME": str(tmp_path)}
    return subprocess.run(["bash", str(script_path)], env=environ, capture_output=True, text=True, cwd=tmp_path, timeout=30)


@pytest.mark.parametrize("attack", SHELL_ATTACKS)
def test_hostile_values_never_execute(attack: str, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    value = attack.format(marker=marker)
    spec = spec_from(hostile_spec(value, tmp_path))
    spec_file = str(tmp_path / f"spec {value}.yaml")
    try:
        script = render.render_sbatch(spec, spec_file)
    except UserError as error:  # refusing is fine, but only for characters that would end a line
        assert any(char in value for char in "\n\r"), error
        return
    assert dict(render.sbatch_directives(script)) == expected_directives(spec)
    result = run_with_shims(script, tmp_path, spec)
    assert result.returncode == 0, result.stderr
    assert not marker.exists()
    srun_args = (tmp_path / "srun.args").read_text().splitlines()
    assert srun_args[-5:] == ["python3", "-P", "-m", "lance_hpc.run", spec_file]


def test_setup_lines_run_but_cannot_add_directives(tmp_path: Path) -> None:
    ran = tmp_path / "setup-ran"
    setup = ["#SBATCH --partition=evil", f"touch {shlex.quote(str(ran))}", "#SBATCH --nodes=100"]
    spec = spec_from({"name": "setup", "data": {"uri": "/d"}, "slurm": {"setup": setup, "log_dir": str(tmp_path)}})
    script = render.render_sbatch(spec, "/x.yaml")
    assert dict(render.sbatch_directives(script)) == expected_directives(spec)
    assert run_with_shims(script, tmp_path, spec).returncode == 0
    assert ran.exists()  # setup lines are the user's shell, by design


def test_failing_setup_line_stops_the_job(tmp_path: Path) -> None:
    spec = spec_from({"name": "setup", "data": {"uri": "/d"}, "slurm": {"setup": ["false"], "log_dir": str(tmp_path)}})
    result = run_with_shims(render.render_sbatch(spec, "/x.yaml"), tmp_path, spec)
    assert result.returncode != 0 and not (tmp_path / "srun.args").exists()


printable_or_not = st.text(st.characters(codec="utf-8", exclude_characters="\x00"), min_size=1, max_size=40)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(value=printable_or_not, field=st.sampled_from((*STRING_FIELDS, "comment", "log_dir", "spec_file")))
def test_any_string_in_any_field_stays_one_quoted_value(value: str, field: str, tmp_path: Path) -> None:
    slurm: dict[str, Any] = {}
    if field == "comment":
        slurm["extra_flags"] = {"comment": value}
    elif field == "log_dir":
        slurm["log_dir"] = "/logs/" + value
    elif field != "spec_file":
        slurm[field] = value
    assume("{" not in value and "}" not in value)  # placeholders are the spec's business (test_spec)
    spec = spec_from({"name": "prop", "slurm": slurm, "data": {"uri": "/d"}})
    spec_file = "/specs/" + value if field == "spec_file" else "/specs/x.yaml"
    try:
        script = render.render_sbatch(spec, spec_file)
    except UserError:
        assert render.UNSAFE_IN_FLAG.search(value) or render.CONTROL.search(value)
        return
    assert dict(render.sbatch_directives(script)) == expected_directives(spec)
    assert shlex.split(script.rstrip("\n").split("\n")[-1])[-1] == spec_file
    syntax = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True)
    assert syntax.returncode == 0, syntax.stderr


@pytest.mark.slow
def test_default_template_ships_in_the_wheel(tmp_path: Path) -> None:
    """Built and installed as a wheel (no checkout around it), the package still finds its template."""
    source = tmp_path / "src"
    anywhere = shutil.ignore_patterns(".git", "build", "*.egg-info", "__pycache__", ".hypothesis")

    def ignored(
        directory: str, names: list[str]
    ) -> set[str]:  # a run's outputs, at the top only (a deeper folder of such a name is code)
        outputs = {"data", "logs", "runs", "checkpoints"} if Path(directory) == ROOT else set()
        return set(anywhere(directory, names)) | (outputs & set(names))

    shutil.copytree(ROOT, source, symlinks=True, ignore=ignored)
    build = [
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "--no-deps",
        "--no-build-isolation",
        "-q",
        str(source),
        "-w",
        str(tmp_path / "wheel"),
    ]
    subprocess.run(build, check=True, capture_output=True, timeout=300)
    (wheel,) = (tmp_path / "wheel").glob("*.whl")
    assert f"lance_hpc/templates/{render.DEFAULT_TEMPLATE}" in zipfile.ZipFile(wheel).namelist()
    install = [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(tmp_path / "site"), str(wheel)]
    subprocess.run(install, check=True, capture_output=True, timeout=300)
    probe = (
        "import lance_hpc.launch.render as r; from lance_hpc.spec import validate_spec; "
        "print(r.__file__); print(r.render_sbatch(validate_spec({'name': 'w', 'data': {'uri': '/d'}}).spec, '/s.yaml'))"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], env={**os.environ, "PYTHONPATH": str(tmp_path / "site")},
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(str(tmp_path / "site"))
    assert "#SBATCH --job-name=w" in result.stdout
