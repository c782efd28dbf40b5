"""The job spec: every class of user mistake gets its message, overrides, placeholders, round trips."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from lance_hpc.errors import UserError
from lance_hpc.spec import SpecError, load_spec, load_spec_text, parse_time_limit, validate_spec

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
        (with_fields(slurm={"partiton": "gpu"}), ["slurm.partiton: unknown key 'partiton'", "did you mean 'partition'?", "valid keys: account,"]),
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
        (with_fields(data={"sampler": "random"}), ["data.sampler: 'random' is not a valid choice", "use one of: distributed, sharded_batch, sharded_fragment, full_scan"]),
        (with_fields(data={"style": "stream"}), ["data.style: 'stream' is not a valid choice", "use one of: map, iterable"]),
        (with_fields(data={"uneven": "cut"}), ["data.uneven: 'cut' is not a valid choice", "use one of: drop, pad"]),
        (with_fields(train={"optimizer": "lion"}), ["train.optimizer: 'lion' is not a valid choice", "use one of: sgd, adamw"]),
        # tasks: unknown names, options checked with their YAML path, import paths that do not import
        (with_fields(task={"name": "segmentation"}), ["task.name: unknown task 'segmentation'", "image_classification, language_model"]),
        (with_fields(task={"options": {"model": "vitt_b_16"}}), ["task.options.model: unknown model 'vitt_b_16'", "small_cnn, a torchvision"]),
        (with_fields(task={"options": {"augment": "mixup"}}), ["task.options.augment: unknown augment 'mixup'", "crop_flip, crop, none"]),
        (with_fields(task={"options": {"image_sise": 64}}), ["task.options.image_sise: unknown key", "did you mean 'image_size'?"]),
        (with_fields(task={"options": {"num_classes": 1}}), ["task.options.num_classes: must be >= 2"]),
        (with_fields(task={"name": "language_model", "options": {"layers": 0}}), ["task.options.layers: must be >= 1"]),
        (with_fields(task={"name": "no_such_pkg.tasks:MyTask"}), ["task.name: cannot import 'no_such_pkg.tasks'", "ModuleNotFoundError", "PYTHONPATH"]),
        (with_fields(task={"name": "lance_hpc.tasks.base:NoSuchTask"}), ["task.name: 'lance_hpc.tasks.base' has no 'NoSuchTask'", "it defines:"]),
        (with_fields(task={"name": "lance_hpc.tasks.base:ROW_ID"}), ["task.name: 'lance_hpc.tasks.base:ROW_ID' names a str, not something callable"]),
        (with_fields(task={"name": "lance_hpc.tasks.base:FieldSpec"}), ["task.name: 'lance_hpc.tasks.base:FieldSpec' is not a subclass of lance_hpc.tasks.Task"]),
        ({**BASE, "entry": "no_such_pkg.train:main"}, ["entry: cannot import 'no_such_pkg.train'", "PYTHONPATH"]),
        ({**BASE, "entry": "missing_dir/train.py:main"}, ["entry: ", "missing_dir/train.py: no such file"]),
        # keys that moved into task.options say where they went
        (with_fields(model={"arch": "resnet50"}), ["model.arch: moved to task.options.model", "options: {model: resnet50}"]),
        (with_fields(data={"image_size": 64, "label_column": "y"}), ["data.image_size: moved to task.options.image_size", "data.label_column: moved to task.options.label_column"]),
        # combinations that cannot work
        (with_fields(data={"style": "map", "sampler": "sharded_batch"}), ["sampler 'sharded_batch' does not work with style 'map'", "with style 'map' use: distributed"]),
        (with_fields(data={"style": "iterable"}), ["data.sampler: iterable style needs a sampler", "sharded_batch, sharded_fragment"]),
        (with_fields(data={"style": "iterable", "sampler": "full_scan"}), ["all ranks would train on the same data"]),
        (with_fields(slurm={"gpus_per_node": 4, "tasks_per_node": 2}), ["DDP runs one task per GPU", "set tasks_per_node: 4"]),
        (with_fields(slurm={"time": "00:01:00", "signal_delay_s": 120}), ["slurm.signal_delay_s: 120s is not shorter than the time limit (60s)"]),
        # malformed time limits
        (with_fields(slurm={"time": "1h"}), ["slurm.time: '1h' is not a SLURM time limit", "HH:MM:SS"]),
        (with_fields(slurm={"time": "0"}), ["slurm.time: time limit must be positive"]),
        # missing files and keys
        (with_fields(slurm={"template": "/no/such/site.j2"}), ["slurm.template: template file /no/such/site.j2 does not exist"]),
        ({"name": "job"}, ["data: required key is missing", "add 'data: ...'"]),
        # shell metacharacters in the job name, credentials in the spec
        ({**BASE, "name": "$(touch x)"}, ["name: '$(touch x)' has characters that are not allowed"]),
        (with_fields(data={"storage_options": {"aws_secret_access_key": "s"}}), ["credentials must not be written in the spec", "AWS_SECRET_ACCESS_KEY"]),
        # placeholders
        (with_fields(checkpoint={"dir": "ck/{job}"}), ["checkpoint.dir: unknown placeholder {job}", "valid placeholders: {name}"]),
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
        "from lance_hpc.tasks.image import ImageClassification\n\nclass MyTask(ImageClassification):\n    pass\n")
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
        "task": draw(st.sampled_from([
            {"name": "image_classification", "options": {"model": draw(st.sampled_from(["small_cnn", "resnet18", "convnext_tiny"])),
                                                         "image_size": draw(st.integers(8, 512))}},
            {"name": "language_model", "options": {"layers": draw(st.integers(1, 8)), "width": 256}},
        ])),
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
    assert again.resolutions == ()
    assert yaml.safe_load(again.spec.to_yaml()) == spec.to_dict()
