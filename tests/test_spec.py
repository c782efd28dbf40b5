"""The job spec: every class of user mistake gets its message, overrides, placeholders, round trips."""

from __future__ import annotations

import math
import re
import typing
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from lance_hpc.errors import UserError
from lance_hpc.spec import (
    REDACTED,
    JobSpec,
    SpecError,
    load_spec,
    load_spec_text,
    parse_time_limit,
    redacted,
    validate_spec,
)
from lance_hpc.spec.secrets import is_credential_key
from lance_hpc.spec.yaml_text import MAX_DEPTH, MAX_EXPANDED_VALUES, expanded_sizes

BASE = {"name": "job", "data": {"uri": "/data/train.lance"}}


def with_fields(**sections: dict[str, Any]) -> dict[str, Any]:
    raw: dict[str, Any] = {"name": "job", "data": {"uri": "/data/train.lance"}}
    for section, fields in sections.items():
        raw[section] = {**raw.get(section, {}), **fields}
    return raw


def problems_of(raw: dict[str, Any], overrides: tuple[str, ...] = ()) -> str:
    with pytest.raises(SpecError) as caught:
        validate_spec(raw, overrides=overrides, base_dir="/project")
    return str(caught.value)


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        # unknown keys name the closest valid key and list the valid ones
        (
            with_fields(slurm={"partiton": "gpu"}),
            ["slurm.partiton: unknown key 'partiton'", "did you mean 'partition'?", "valid keys: account,"],
        ),
        ({**BASE, "trian": {}}, ["trian: unknown key 'trian'", "did you mean 'train'?"]),
        (with_fields(data={"batchsize": 8}), ["data.batchsize", "did you mean 'batch_size'?"]),
        # wrong types
        (with_fields(slurm={"nodes": "two"}), ["slurm.nodes: expected int, got str 'two'"]),
        (with_fields(train={"lr": "fast"}), ["train.lr: expected float, got str 'fast'"]),
        (with_fields(slurm={"exclusive": "maybe"}), ["slurm.exclusive: expected bool"]),
        # out of range
        (with_fields(slurm={"nodes": 0}), ["slurm.nodes: must be >= 1, got 0", "set a value >= 1"]),
        (with_fields(data={"batch_size": 0}), ["data.batch_size: must be >= 1, got 0"]),
        (with_fields(train={"lr": 0}), ["train.lr: must be > 0"]),
        (with_fields(slurm={"signal_delay_s": 5}), ["slurm.signal_delay_s: must be >= 10"]),
        # unknown names list the valid ones
        (
            with_fields(data={"sampler": "random"}),
            [
                "data.sampler: 'random' is not a valid choice",
                "use one of: distributed, block, sharded_batch, sharded_fragment, full_scan",
            ],
        ),
        (with_fields(data={"style": "stream"}), ["data.style: 'stream' is not a valid choice", "use one of: map, iterable"]),
        (with_fields(data={"uneven": "cut"}), ["data.uneven: 'cut' is not a valid choice", "use one of: drop, pad"]),
        (with_fields(train={"optimizer": "lion"}), ["train.optimizer: 'lion' is not a valid choice", "use one of: sgd, adamw"]),
        # tasks: unknown names, options checked with their YAML path, import paths that do not import
        (
            with_fields(task={"name": "segmentation"}),
            ["task.name: unknown task 'segmentation'", "image_classification, language_model"],
        ),
        (
            with_fields(task={"options": {"model": "vitt_b_16"}}),
            ["task.options.model: unknown model 'vitt_b_16'", "small_cnn, a torchvision"],
        ),
        (
            with_fields(task={"options": {"augment": "mixup"}}),
            ["task.options.augment: unknown augment 'mixup'", "crop_flip, crop, none"],
        ),
        (
            with_fields(task={"options": {"image_sise": 64}}),
            ["task.options.image_sise: unknown key", "did you mean 'image_size'?"],
        ),
        (with_fields(task={"options": {"num_classes": 1}}), ["task.options.num_classes: must be >= 2"]),
        (with_fields(task={"name": "language_model", "options": {"layers": 0}}), ["task.options.layers: must be >= 1"]),
        (
            with_fields(task={"name": "no_such_pkg.tasks:MyTask"}),
            ["task.name: cannot import 'no_such_pkg.tasks'", "ModuleNotFoundError", "PYTHONPATH"],
        ),
        (
            with_fields(task={"name": "lance_hpc.tasks.base:NoSuchTask"}),
            ["task.name: 'lance_hpc.tasks.base' has no 'NoSuchTask'", "it defines:"],
        ),
        (
            with_fields(task={"name": "lance_hpc.tasks.base:ROW_ID"}),
            ["task.name: 'lance_hpc.tasks.base:ROW_ID' names a str, not something callable"],
        ),
        (
            with_fields(task={"name": "lance_hpc.tasks.base:FieldSpec"}),
            ["task.name: 'lance_hpc.tasks.base:FieldSpec' is not a subclass of lance_hpc.tasks.Task"],
        ),
        ({**BASE, "entry": "no_such_pkg.train:main"}, ["entry: cannot import 'no_such_pkg.train'", "PYTHONPATH"]),
        ({**BASE, "entry": "missing_dir/train.py:main"}, ["entry: ", "missing_dir/train.py: no such file"]),
        # keys that moved into task.options say where they went
        (with_fields(model={"arch": "resnet50"}), ["model.arch: moved to task.options.model", "options: {model: resnet50}"]),
        (
            with_fields(data={"image_size": 64, "label_column": "y"}),
            ["data.image_size: moved to task.options.image_size", "data.label_column: moved to task.options.label_column"],
        ),
        # combinations that cannot work
        (
            with_fields(data={"style": "map", "sampler": "sharded_batch"}),
            ["sampler 'sharded_batch' does not work with style 'map'", "with style 'map' use: distributed"],
        ),
        (
            with_fields(data={"style": "iterable"}),
            ["data.sampler: iterable style needs a sampler", "sharded_batch, sharded_fragment"],
        ),
        (with_fields(data={"style": "iterable", "sampler": "full_scan"}), ["all ranks would train on the same data"]),
        (with_fields(slurm={"gpus_per_node": 4, "tasks_per_node": 2}), ["DDP runs one task per GPU", "set tasks_per_node: 4"]),
        (
            with_fields(slurm={"time": "00:01:00", "signal_delay_s": 120}),
            ["slurm.signal_delay_s: 120s is not shorter than the time limit (60s)"],
        ),
        # malformed time limits
        (with_fields(slurm={"time": "1h"}), ["slurm.time: '1h' is not a SLURM time limit", "HH:MM:SS"]),
        (with_fields(slurm={"time": "0"}), ["slurm.time: time limit must be positive"]),
        # missing files and keys
        (with_fields(slurm={"template": "/no/such/site.j2"}), ["slurm.template: template file /no/such/site.j2 does not exist"]),
        ({"name": "job"}, ["data: required key is missing", "add 'data: ...'"]),
        # shell metacharacters in the job name, credentials in the spec
        ({**BASE, "name": "$(touch x)"}, ["name: '$(touch x)' has characters that are not allowed"]),
        (
            with_fields(data={"storage_options": {"aws_secret_access_key": "s"}}),
            ["credentials must not be written in the spec", "AWS_SECRET_ACCESS_KEY"],
        ),
        # placeholders
        (
            with_fields(checkpoint={"dir": "ck/{job}"}),
            ["checkpoint.dir: unknown placeholder {job}", "valid placeholders: {name}"],
        ),
    ],
)
def test_each_mistake_has_its_message(raw: dict[str, Any], expected: list[str]) -> None:
    message = problems_of(raw)
    for part in expected:
        assert part in message
    assert isinstance(SpecError("x", []), UserError)  # printed by the CLI without a traceback


def test_every_problem_is_reported_at_once() -> None:
    raw = with_fields(slurm={"nodes": 0, "time": "soon", "partiton": "gpu"}, data={"sampler": "random", "batch_size": -1})
    message = problems_of(raw)
    assert message.startswith("<spec>: 5 problems in the job spec")
    for path in ("slurm.nodes", "slurm.time", "slurm.partiton", "data.sampler", "data.batch_size"):
        assert f"  {path}: " in message


def test_a_key_written_twice_is_an_error_with_both_lines() -> None:
    with pytest.raises(SpecError) as caught:
        load_spec_text("name: a\ndata:\n  uri: /x\n  batch_size: 8\n  batch_size: 16\nname: b\n")
    message = str(caught.value)
    assert "name: written twice, on lines 1 and 6" in message
    assert "data.batch_size: written twice, on lines 4 and 5" in message


def test_a_task_file_path_resolves_against_the_spec_directory(tmp_path: Path) -> None:
    (tmp_path / "my_task_module.py").write_text(
        "from lance_hpc.tasks.image import ImageClassification\n\nclass MyTask(ImageClassification):\n    pass\n"
    )
    spec_file = tmp_path / "job.yaml"
    spec_file.write_text("name: a\ndata: {uri: d.lance}\ntask: {name: my_task_module.py:MyTask, options: {model: small_cnn}}\n")
    loaded = load_spec(spec_file, base_dir=tmp_path)
    assert loaded.spec.task.name == f"{tmp_path}/my_task_module.py:MyTask"
    assert loaded.spec.task.options["image_size"] == 224  # the task's defaults are filled in, and shown
    assert any(item.path == "task.name" for item in loaded.resolutions)


def test_missing_file_and_bad_yaml(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="spec file .*nope.yaml does not exist"):
        load_spec(tmp_path / "nope.yaml")
    with pytest.raises(SpecError, match="not valid YAML at line 2, column 7: mapping values are not allowed"):
        load_spec_text("name: x\n  data: 1\n")
    with pytest.raises(SpecError, match="must be a mapping of sections"):
        load_spec_text("- a\n- b\n")


def test_overrides_apply_yaml_values() -> None:
    spec = validate_spec(
        BASE,
        overrides=("train.lr=0.05", "slurm.nodes=4", "slurm.partition=null", "data.shuffle=false", "slurm.setup=[a, b]"),
        base_dir="/p",
    ).spec
    assert (spec.train.lr, spec.slurm.nodes, spec.slurm.partition, spec.data.shuffle) == (0.05, 4, None, False)
    assert spec.slurm.setup == ["a", "b"]


def test_overrides_are_validated_like_the_file() -> None:
    message = problems_of(BASE, ("slurm.nodes=0", "nonsense", "name.x=1", "train.momentun=0.8"))
    assert "slurm.nodes: must be >= 1" in message
    assert "--set nonsense: override is not KEY=VALUE" in message
    assert "cannot set inside 'name'" in message
    assert "train.momentun: unknown key 'momentun'" in message and "did you mean 'momentum'?" in message


def test_placeholders_and_relative_paths_resolve_once_and_visibly() -> None:
    raw = with_fields(data={"uri": "data/{name}.lance", "val_uri": "s3://bucket/{name}-val.lance"})
    loaded = validate_spec(raw, base_dir="/project")
    spec = loaded.spec
    assert spec.data.uri == "/project/data/job.lance"
    assert spec.data.val_uri == "s3://bucket/job-val.lance"  # URIs are not made into local paths
    assert (spec.checkpoint.dir, spec.logging.tensorboard_dir, spec.slurm.log_dir) == (
        "/project/checkpoints/job", "/project/runs/job", "/project/logs/job",
    )  # fmt: skip
    shown = {item.path: (item.before, item.after) for item in loaded.resolutions}
    assert shown["data.uri"] == ("data/{name}.lance", "/project/data/job.lance")
    assert shown["checkpoint.dir"] == ("checkpoints/{name}", "/project/checkpoints/job")
    again = load_spec_text(spec.to_yaml(), base_dir="/elsewhere")
    assert again.spec == spec and again.resolutions == ()  # resolved specs are stable


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("30", 1800), ("30:15", 1815), ("04:00:00", 14400), ("1-00", 86400), ("1-12:30", 131400), ("2-00:00:10", 172810)],
)
def test_time_limits_in_every_sbatch_form(text: str, seconds: int) -> None:
    assert parse_time_limit(text) == seconds


@pytest.mark.parametrize("text", ["1h", "", "1:2:3:4", "-5", "a-01:00:00"])
def test_malformed_time_limits(text: str) -> None:
    with pytest.raises(ValueError):
        parse_time_limit(text)


# ---- round trip ---------------------------------------------------------------------------------

names = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,20}", fullmatch=True)
times = st.sampled_from(["30", "04:00:00", "1-00:00:00", "90:00", "2-12"])
style_samplers = st.sampled_from([("map", "distributed"), ("iterable", "sharded_batch"), ("iterable", "sharded_fragment")])
plain_text = st.text(st.characters(codec="ascii", categories=("L", "N")), min_size=1, max_size=12)


@st.composite
def raw_specs(draw: st.DrawFn) -> dict[str, Any]:
    gpus = draw(st.integers(0, 8))
    style, sampler = draw(style_samplers)
    return {
        "name": draw(names),
        "slurm": {
            "partition": draw(st.none() | plain_text),
            "nodes": draw(st.integers(1, 64)),
            "gpus_per_node": gpus,
            "tasks_per_node": gpus or draw(st.none() | st.integers(1, 8)),
            "cpus_per_task": draw(st.integers(1, 64)),
            "mem_gb": draw(st.none() | st.integers(1, 2048)),
            "time": draw(times),
            "exclusive": draw(st.booleans()),
            "setup": draw(st.lists(plain_text, max_size=3)),
            "extra_flags": draw(st.dictionaries(st.sampled_from(["reservation", "comment", "nice"]), plain_text, max_size=2)),
            "max_requeues": draw(st.integers(0, 10)),
        },
        "data": {
            "uri": draw(st.sampled_from(["/data/x.lance", "data/{name}.lance", "s3://bucket/x.lance"])),
            "style": style,
            "sampler": sampler,
            "uneven": draw(st.sampled_from(["drop", "pad"])),
            "batch_size": draw(st.integers(1, 1024)),
            "num_workers": draw(st.integers(0, 16)),
            "shuffle": draw(st.booleans()),
            "storage_options": draw(st.dictionaries(st.sampled_from(["endpoint", "region"]), plain_text, max_size=2)),
        },
        "task": draw(
            st.sampled_from(
                [
                    {
                        "name": "image_classification",
                        "options": {
                            "model": draw(st.sampled_from(["small_cnn", "resnet18", "convnext_tiny"])),
                            "image_size": draw(st.integers(8, 512)),
                        },
                    },
                    {"name": "language_model", "options": {"layers": draw(st.integers(1, 8)), "width": 256}},
                ]
            )
        ),
        "train": {
            "epochs": draw(st.integers(1, 100)),
            "lr": draw(st.floats(1e-5, 10, allow_nan=False)),
            "precision": draw(st.sampled_from(["bf16", "fp32"])),
        },
    }


@settings(max_examples=100, deadline=None)
@given(raw=raw_specs())
def test_round_trip_through_yaml(raw: dict[str, Any]) -> None:
    spec = validate_spec(raw, base_dir="/project").spec
    text = spec.to_yaml()
    again = load_spec_text(text, base_dir="/somewhere/else")
    assert again.spec == spec
    assert load_spec_text(text, imports=False).spec == spec  # how status/logs/cancel read it: the same spec
    assert again.resolutions == ()
    assert yaml.safe_load(again.spec.to_yaml()) == spec.to_dict()


# ---- YAML within bounds --------------------------------------------------------------------------


def alias_bomb(levels: int, width: int = 6) -> str:
    """A spec whose anchors each alias the previous one ``width`` times: ``width ** levels`` values."""
    lines = [f"    a0: &a0 [{', '.join(['x'] * width)}]"]
    lines += [f"    a{level}: &a{level} [{', '.join([f'*a{level - 1}'] * width)}]" for level in range(1, levels)]
    return "name: bomb\ndata: {uri: /d}\ntask:\n  options:\n" + "\n".join(lines) + "\n"


def test_an_alias_bomb_is_refused_naming_the_anchor_without_expanding_it() -> None:
    text = alias_bomb(9)
    assert len(text) < 450  # 413 bytes in the report that took 19 s to validate
    with pytest.raises(SpecError) as caught:
        load_spec_text(text)
    message = str(caught.value)
    assert f"aliases expand the spec to more than {MAX_EXPANDED_VALUES:,} values" in message
    assert "anchor &a6 (line 11) alone stands for more than" in message
    sizes = expanded_sizes(yaml.compose(text))
    assert len(sizes) < 100  # every distinct node visited once, not 6 ** 9 times
    assert max(values for values, _ in sizes.values()) > MAX_EXPANDED_VALUES


def test_aliases_within_bounds_are_read_and_duplicate_keys_found_once() -> None:
    loaded = load_spec_text("name: ok\ndata: &d {uri: /d, batch_size: 8}\nsweep: {data.batch_size: [8, 16]}\n")
    assert loaded.spec.data.batch_size == 8
    with pytest.raises(SpecError) as caught:
        load_spec_text("name: x\ndata: {uri: /d}\ntask:\n  options: &o {a: 1, a: 2}\nsweep: {task.options.x: [*o, *o]}\n")
    assert caught.value.problems == [caught.value.problems[0]]
    assert "task.options.a: written twice, on lines 4 and 4" in str(caught.value)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("name: x\ndata: {uri: /d}\ntask:\n  options: &o {a: *o}\n", "anchor &o (line 4) contains an alias to itself"),
        ("name: x\ndata: {uri: /d}\nsweep:\n  train.lr: &l [0.1, *l]\n", "anchor &l (line 4) contains an alias to itself"),
        ("name: x\ndata: &d\n  uri: /d\n  more: {deeper: *d}\n", "anchor &d (line 2) contains an alias to itself"),
        ("x: " + "[" * (MAX_DEPTH + 5) + "]" * (MAX_DEPTH + 5) + "\n", f"nested {MAX_DEPTH + 6} levels deep (line 1)"),
        ("x: " + "[" * 5000 + "]" * 5000 + "\n", "nested too deeply to read"),
    ],
    ids=["mapping", "list", "nested", "deep", "deeper than python recurses"],
)
def test_recursive_anchors_and_deep_nesting_are_refused_without_a_traceback(text: str, expected: str) -> None:
    with pytest.raises(SpecError, match=re.escape(expected)):
        load_spec_text(text)


def test_command_line_values_are_bounded_too() -> None:
    with pytest.raises(SpecError, match=re.escape("--set task.options=&a [*a]: anchor &a (line 1) contains an alias to itself")):
        validate_spec(BASE, overrides=["task.options=&a [*a]"])
    with pytest.raises(SpecError, match=re.escape("--sweep train.lr=[&a [*a]]: anchor &a (line 1) contains")):
        validate_spec(BASE, sweeps=["train.lr=[&a [*a]]"])


# ---- every number bounded ----------------------------------------------------------------------


def numeric_fields(model: type[BaseModel] = JobSpec, prefix: str = "") -> Iterator[tuple[str, type]]:
    """(YAML path, int or float) of every numeric field of the spec, sections included."""
    for name, field in model.model_fields.items():
        candidates = typing.get_args(field.annotation) or (field.annotation,)
        section = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
        if section is not None:
            yield from numeric_fields(section, f"{prefix}{name}.")
        elif int in candidates or float in candidates:
            yield f"{prefix}{name}", float if float in candidates else int


NUMERIC_FIELDS = sorted(numeric_fields())
# Sections that must be complete before their numbers are checked.
REQUIRED = {"data": {"uri": "/d", "cache": {"dir": "/local/cache", "max_gb": 1}, "ingest": {"source": "sklearn-digits"}}}


def with_value(path: str, value: Any) -> dict[str, Any]:
    raw: dict[str, Any] = {"name": "bounds", **yaml.safe_load(yaml.safe_dump(REQUIRED))}
    *sections, field = path.split(".")
    node = raw
    for part in sections:
        node = node.setdefault(part, {})
    node[field] = value
    return raw


def test_the_table_below_sees_every_numeric_field() -> None:
    assert len(NUMERIC_FIELDS) >= 30
    assert ("train.seed", int) in NUMERIC_FIELDS and ("data.cache.max_gb", float) in NUMERIC_FIELDS


@pytest.mark.parametrize(("path", "kind"), NUMERIC_FIELDS, ids=[path for path, _ in NUMERIC_FIELDS])
def test_every_numeric_field_refuses_nan_infinity_negatives_and_huge_values(path: str, kind: type) -> None:
    for value in (math.nan, math.inf, -math.inf):
        assert f"{path}: must be a finite number, got {value!r}" in problems_of(with_value(path, value))
    assert f"{path}: must be >" in problems_of(with_value(path, -1))  # every count, size and rate is >= 0
    if kind is int:
        assert f"{path}: must be <=" in problems_of(with_value(path, 2**64))


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("train: {seed: -1}", "train.seed: must be >= 0, got -1"),
        ("train: {seed: 4294967296}", "train.seed: must be <= 4294967295"),
        ("data: {uri: /d, cache: {dir: /local, max_gb: .inf}}", "data.cache.max_gb: must be a finite number, got inf"),
        ("train: {lr: .nan}", "train.lr: must be a finite number, got nan"),
    ],
)
def test_values_that_would_fail_on_every_rank_fail_at_validation(text: str, expected: str) -> None:
    spec = "name: x\n" + ("" if text.startswith("data") else "data: {uri: /d}\n") + text + "\n"
    with pytest.raises(SpecError, match=re.escape(expected)):
        load_spec_text(spec)


def test_seed_bounds_are_inclusive() -> None:
    assert validate_spec(with_fields(train={"seed": 2**32 - 1}, data={"seed": 0})).spec.train.seed == 2**32 - 1


# ---- credentials never in the spec -------------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "fix"),
    [
        ("aws_secret_access_key", "AWS_SECRET_ACCESS_KEY"),
        ("secret_access_key", "AWS_SECRET_ACCESS_KEY"),
        ("aws_session_token", "AWS_SESSION_TOKEN"),
        ("azure_storage_account_key", "AZURE_STORAGE_ACCOUNT_KEY"),
        ("account_key", "AZURE_STORAGE_ACCOUNT_KEY"),
        ("azure_storage_sas_token", "AZURE_STORAGE_SAS_TOKEN"),
        ("sas_key", "AZURE_STORAGE_SAS_KEY"),
        ("azure_client_secret", "AZURE_CLIENT_SECRET"),
        ("bearer_token", "AZURE_STORAGE_BEARER_TOKEN"),
        ("google_service_account_key", "GOOGLE_APPLICATION_CREDENTIALS"),
        ("service_account_key", "GOOGLE_APPLICATION_CREDENTIALS"),
        ("aws_sse_customer_key_base64", "AWS_SSE_CUSTOMER_KEY_BASE64"),
        ("proxy_password", "PROXY_PASSWORD"),
    ],
)
def test_credential_storage_options_are_refused_naming_where_they_go(key: str, fix: str) -> None:
    message = problems_of(with_fields(data={"storage_options": {key: "s3cr3t"}}))
    assert f"data.storage_options.{key}: credentials must not be written in the spec" in message
    assert fix in message.split("fix:")[1]


@pytest.mark.parametrize(
    "key",
    [
        "region",
        "endpoint",
        "allow_http",
        "azure_storage_account_name",
        "google_application_credentials",
        "google_service_account",
        "aws_sse_kms_key_id",
        "azure_federated_token_file",
        "aws_skip_signature",
    ],
)
def test_storage_options_that_are_not_credentials_pass(key: str) -> None:
    assert validate_spec(with_fields(data={"storage_options": {key: "value"}})).spec.data.storage_options == {key: "value"}


@pytest.mark.parametrize(
    ("slurm", "expected"),
    [
        (
            {"setup": ["export AWS_SECRET_ACCESS_KEY=abc123"]},
            "slurm.setup[0]: assigns AWS_SECRET_ACCESS_KEY a literal credential",
        ),
        (
            {"setup": ["module load x", "HF_TOKEN='hf_abc' python prep.py"]},
            "slurm.setup[1]: assigns HF_TOKEN a literal credential",
        ),
        ({"setup": ["huggingface-cli login --token hf_abc"]}, "slurm.setup[0]: passes --token a literal credential"),
        ({"setup": ['export AZURE_STORAGE_SAS_TOKEN="sv=1&sig=x"']}, "AZURE_STORAGE_SAS_TOKEN a literal credential"),
        ({"setup": ["export KEY_ID=AKIAABCDEFGHIJKLMNOP"]}, "slurm.setup[0]: holds what looks like an AWS access key id"),
        ({"extra_flags": {"export": "ALL,AWS_SESSION_TOKEN=xyz"}}, "slurm.extra_flags.export: assigns AWS_SESSION_TOKEN"),
        ({"extra_flags": {"password": "x"}}, "slurm.extra_flags.password: an sbatch flag must not carry a credential"),
    ],
)
def test_credentials_in_setup_lines_and_flags_are_refused(slurm: dict[str, Any], expected: str) -> None:
    message = problems_of(with_fields(slurm=slurm))
    assert expected in message
    assert "fix: export" in message or "fix: keep it in the environment" in message


@pytest.mark.parametrize(
    "line",
    [
        'export AWS_SECRET_ACCESS_KEY="$(cat ~/.secrets/aws)"',
        "export HF_TOKEN=$HF_TOKEN",
        "export TOKENIZERS_PARALLELISM=false",
        "export AWS_PROFILE=research",
        'huggingface-cli login --token "$HF_TOKEN" --add-to-git-credential',
        "module load cuda",
    ],
)
def test_setup_lines_that_read_credentials_at_run_time_pass(line: str) -> None:
    assert validate_spec(with_fields(slurm={"setup": [line]})).spec.slurm.setup == [line]


@pytest.mark.parametrize(
    ("section", "fields", "expected"),
    [
        ("data", {"uri": "az://c/train.lance?sv=2022-11-02&sig=abc"}, "data.uri: holds what looks like an Azure SAS token"),
        (
            "data",
            {"storage_options": {"endpoint": "https://me:pw@minio:9000"}},
            "data.storage_options.endpoint: holds what looks like a password in a URL",
        ),
    ],
)
def test_credential_looking_values_are_refused_wherever_they_are(section: str, fields: dict[str, Any], expected: str) -> None:
    assert expected in problems_of(with_fields(**{section: fields}))


def test_no_field_of_the_spec_looks_like_a_credential() -> None:
    """Redaction replaces the values of credential-looking keys: no field of the spec may be one."""

    def names(model: type[BaseModel]) -> Iterator[str]:
        for name, field in model.model_fields.items():
            yield name
            for candidate in typing.get_args(field.annotation) or (field.annotation,):
                if isinstance(candidate, type) and issubclass(candidate, BaseModel):
                    yield from names(candidate)

    assert [name for name in names(JobSpec) if is_credential_key(name)] == []


def test_redaction_replaces_credential_values_anywhere() -> None:
    tree = {
        "a": {"azure_storage_sas_token": "sv=1", "region": "eu"},
        "b": [{"apiKey": "k"}, "export TOKEN=abc && run"],
        "c": "https://me:pw@host/x",
        "d": {"tokenizer": "bytes", "password": None},
    }
    assert redacted(tree) == {
        "a": {"azure_storage_sas_token": REDACTED, "region": "eu"},
        "b": [{"apiKey": REDACTED}, f"export TOKEN={REDACTED} && run"],
        "c": f"{REDACTED}host/x",
        "d": {"tokenizer": "bytes", "password": None},
    }
    spec = JobSpec.model_validate({"name": "x", "data": {"uri": "/d", "storage_options": {"aws_secret_access_key": "s3cr3t"}}})
    assert spec.redacted_dict()["data"]["storage_options"] == {"aws_secret_access_key": REDACTED}
    assert spec.to_dict()["data"]["storage_options"] == {"aws_secret_access_key": "s3cr3t"}  # the job's own copy keeps it


def test_redaction_hides_text_under_credential_keys_but_keeps_numbers() -> None:
    """A tokenizer's ids are numbers under "token" keys; a credential is text, also inside a list
    or a section a credential key holds."""
    tree = {
        "task": {
            "options": {
                "pad_token_id": 0,
                "eos_token_id": 2,
                "special_token_ids": [1, 3],
                "use_token": True,
                "api_token": "abc",
                "tokens": {"auth_token": ["x", 7]},
                "credentials": {"user": "me", "n": 1},
            }
        }
    }
    assert redacted(tree) == {
        "task": {
            "options": {
                "pad_token_id": 0,
                "eos_token_id": 2,
                "special_token_ids": [1, 3],
                "use_token": True,
                "api_token": REDACTED,
                "tokens": {"auth_token": [REDACTED, 7]},
                "credentials": {"user": REDACTED, "n": 1},
            }
        }
    }


# Float fields with an upper bound; lr, weight_decay and grad_clip (a gradient norm) have none that holds for every model.
BOUNDED_FLOATS = [
    "data.cache.max_gb",
    "data.io_timeout_s",
    "data.ingest.val_fraction",
    "train.momentum",
    "train.warmup_epochs",
    "train.watchdog.factor",
    "train.watchdog.floor_s",
    "train.watchdog.straggler_factor",
]


@pytest.mark.parametrize("path", BOUNDED_FLOATS)
def test_float_fields_with_an_obvious_limit_refuse_huge_values(path: str) -> None:
    assert f"{path}: must be <" in problems_of(with_value(path, 1e300))
    assert {path for path, kind in NUMERIC_FIELDS if kind is float} - set(BOUNDED_FLOATS) == {
        "train.lr",
        "train.weight_decay",
        "train.grad_clip",
    }


def test_the_sampler_defaults_to_block_on_object_storage_and_a_chosen_one_is_kept() -> None:
    from lance_hpc.spec import DataSpec

    assert DataSpec(uri="s3://bucket/train.lance").sampler == "block"
    assert DataSpec(uri="gs://bucket/train.lance", style="iterable").sampler == "block"
    assert DataSpec(uri="/data/train.lance").sampler == "distributed"
    assert DataSpec(uri="s3://bucket/train.lance", sampler="distributed").sampler == "distributed"
    assert DataSpec(mix=[{"uri": "s3://bucket/a.lance", "weight": 1}]).sampler == "block"  # the first source's store


# ---- hostile values: storage options of a mix, filters Lance would cut, weights ------------------


def with_mix(second: dict[str, Any], first_weight: float = 1.0) -> dict[str, Any]:
    """A spec whose data is a mix of two sources, the second with ``second``'s fields."""
    return {"name": "job", "data": {"mix": [{"uri": "/d/a.lance", "weight": first_weight}, {"uri": "/d/b.lance", **second}]}}


def test_credentials_in_a_mix_sources_storage_options_are_refused() -> None:
    raw = with_mix({"weight": 1, "storage_options": {"region": "eu-west-1", "aws_secret_access_key": "s3cr3t"}})
    message = problems_of(raw)
    assert "data.mix[1].storage_options.aws_secret_access_key: credentials must not be written in the spec" in message
    assert "AWS_SECRET_ACCESS_KEY" in message.split("fix:")[1]
    assert "region" not in message


def with_filter(where: str, predicate: str) -> dict[str, Any]:
    if where == "data.mix[1].filter":
        return with_mix({"weight": 1, "filter": predicate})
    if where == "infer.filter":
        return with_fields(infer={"filter": predicate})
    return with_fields(data={"filter": predicate})


@pytest.mark.parametrize("where", ["data.filter", "data.mix[1].filter", "infer.filter"])
@pytest.mark.parametrize(
    ("predicate", "expected"),
    [
        ("label > 3; label < 2", "has ';' at character 10: Lance would read only what comes before it, silently"),
        ("label > 3) OR (label < 1", "the ')' at character 10 closes no '(': Lance would read only"),
        ("(label > 3", "has 1 '(' never closed"),
        ("name = 'a", "the string literal opened by ' at character 8 is never closed"),
        ("label > 3 /* a", "the comment opened at character 11 is never closed"),
    ],
)
def test_a_filter_lance_would_cut_short_is_refused_wherever_it_is(where: str, predicate: str, expected: str) -> None:
    message = problems_of(with_filter(where, predicate))
    path = where.replace("[1]", ".1")  # pydantic's path of a list item
    assert f"{path}: {expected}" in message
    assert "fix: " in message.split(f"{path}: ")[1]


ACCEPTED_FILTERS = [
    "label > 3",
    "name = 'a;b' OR name = 'c)'",
    "name = 'it''s (x'",
    "`label` > 3 AND \"name\" <> ';'",
    "label > 3 -- a comment ) ;",
    "label > 3 /* ; ) */",
    "((label > 1) AND (label < 5)) OR label = 9",
]


def test_semicolons_and_parentheses_in_quotes_and_comments_pass_and_lance_reads_them_whole(tmp_path: Path) -> None:
    import lance
    import pyarrow as pa

    names = ["a;b", "c)", "it's (x", ";", "e", "f", "g", "h", "i", "j"]
    dataset = lance.write_dataset(pa.table({"label": list(range(10)), "name": names}), str(tmp_path / "d.lance"))
    for predicate in ACCEPTED_FILTERS:
        for where in ("data.filter", "data.mix[1].filter", "infer.filter"):
            raw = with_filter(where, predicate)
            if where == "infer.filter":
                raw["job"] = "infer"
                raw["infer"] |= {"checkpoint": "/runs/train/checkpoints", "outputs": {"score": "float32"}}
            validate_spec(raw)
        # Lance read all of it: the same rows as with a condition after it, which a cut would drop
        wrapped = f"({predicate}\n) AND label >= 0"
        assert dataset.count_rows(filter=predicate) == dataset.count_rows(filter=wrapped) > 0, predicate


@pytest.mark.parametrize(
    ("first", "second", "expected"),
    [
        (1e308, 1e-10, "data.mix: the weights 1e-10 and 1e+308 are more than 2**62 apart"),
        (1.0, 2.0**-63, "more than 2**62 apart: the lighter source would never be drawn"),
        (1.0, math.inf, "data.mix.1.weight: must be a finite number"),
        (1.0, math.nan, "data.mix.1.weight: must be a finite number"),
        (1.0, 0.0, "data.mix.1.weight: must be > 0"),
    ],
)
def test_mix_weights_that_cannot_be_drawn_in_proportion_are_refused(first: float, second: float, expected: str) -> None:
    assert expected in problems_of(with_mix({"weight": second}, first_weight=first))


@pytest.mark.parametrize(("first", "second"), [(1e308, 1e308), (1e308, 1e308 * 2.0**-62), (5e-324, 5e-324)])
def test_mix_weights_at_the_float_limits_within_2_62_of_each_other_pass(first: float, second: float) -> None:
    mix = validate_spec(with_mix({"weight": second}, first_weight=first)).spec.data.mix
    assert mix is not None and [source.weight for source in mix] == [first, second]


def infer_raw(outputs: dict[str, str], filter: str | None = None) -> dict[str, Any]:
    infer: dict[str, Any] = {"function": "my_pkg.infer:predict", "outputs": outputs}
    return {**with_fields(infer=infer if filter is None else {**infer, "filter": filter}), "job": "infer"}


@pytest.mark.parametrize(
    ("outputs", "filter", "expected"),
    [
        ({"_rowid": "int64"}, None, "infer.outputs._rowid: Lance computes a column of this name"),
        ({"_ROWADDR": "int64"}, None, "infer.outputs._ROWADDR: Lance computes a column of this name"),
        ({"_distance": "float32"}, None, "infer.outputs._distance: Lance computes a column of this name"),
        ({"_mine": "int64"}, None, "infer.outputs._mine: names beginning with _ are Lance's own"),
        ({"twice": "int64"}, "twice > 4 AND label = 3", "infer.filter: names twice, which this job writes"),
        ({"twice": "int64"}, 'label = 3 OR "Twice" IS NULL', "infer.filter: names twice, which this job writes"),
        ({"twice": "int64"}, "label = 3 OR `twice` < 0", "infer.filter: names twice, which this job writes"),
    ],
)
def test_outputs_lance_reserves_and_a_filter_over_an_output_are_refused(
    outputs: dict[str, str], filter: str | None, expected: str
) -> None:
    assert expected in problems_of(infer_raw(outputs, filter))


@pytest.mark.parametrize("filter", ["label = 3", "label = 'twice'", "caption LIKE '%twice%' AND label > 1", "twice_old > 1"])
def test_a_filter_that_names_no_output_passes(filter: str) -> None:
    validate_spec(infer_raw({"twice": "int64"}, filter), base_dir="/project")


def task_infer_raw(outputs: dict[str, str], **infer: Any) -> dict[str, Any]:
    """job: infer with the task's own outputs (a checkpoint, no infer.function)."""
    return {**with_fields(infer={"checkpoint": "/ckpt/run", "outputs": outputs, **infer}), "job": "infer"}


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (
            task_infer_raw({"predictd": "int64"}),
            [
                "infer.outputs.predictd: task image_classification gives no output 'predictd' (it gives embedding, logits,",
                "did you mean predicted?",
            ],
        ),
        (
            task_infer_raw({"label": "int64"}, overwrite=True),
            ["infer.outputs: label is a column task image_classification reads (task.options.label_column)"],
        ),
        (infer_raw({"label": "int64"}), ["infer.outputs: label is a column task image_classification reads"]),
        (
            {**task_infer_raw({"caption": "int64"}), "task": {"options": {"label_column": "caption"}}},
            ["infer.outputs: caption is a column task image_classification reads (task.options.label_column)"],
        ),
        (task_infer_raw({"predicted": "int64"}, on_error="ignore"), ["infer.on_error: 'ignore' is not a valid choice"]),
        (  # a list where a column's name belongs: the options' own problem, not a traceback
            {**task_infer_raw({"predicted": "int64"}), "task": {"options": {"label_column": ["a", "b"]}}},
            ["task.options.label_column"],
        ),
    ],
)
def test_outputs_the_task_does_not_give_or_reads_are_refused_before_any_rank_starts(
    raw: dict[str, Any], expected: list[str]
) -> None:
    problems = problems_of(raw)
    assert all(text in problems for text in expected), problems


def test_outputs_the_task_gives_pass_and_on_error_defaults_to_fail() -> None:
    spec = validate_spec(task_infer_raw({"embedding": "float16", "predicted": "int64"}), base_dir="/project").spec
    assert spec.infer is not None and spec.infer.on_error == "fail"
    assert validate_spec(infer_raw({"anything": "int64"}), base_dir="/project").spec.infer is not None


def test_each_registered_task_declares_the_outputs_the_spec_checks() -> None:
    from lance_hpc.tasks.registry import OUTPUTS, TASKS, task_class

    assert set(OUTPUTS) == set(TASKS)
    assert all(OUTPUTS[name] == task_class(name).outputs for name in TASKS)
