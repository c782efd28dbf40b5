"""Object storage against the loopback S3 server (moto, credentials checked): ingest and read
s3:// datasets with options from the spec and credentials from AWS_* variables, in-process and in
worker processes; preflight errors for bad credentials, missing bucket/dataset and an unreachable
endpoint; credentials never printed."""

import lance
import pytest

from lance_hpc.cli.plan import main as plan_main
from lance_hpc.errors import UserError
from lance_hpc.ingest import ensure_dataset
from lance_hpc.loading import dataset_info, plan_data, preflight
from lance_hpc.spec import DataSpec, IngestSpec
from lance_hpc.storage.options import redact, storage_options
from lance_hpc.tasks.image import ImageClassification, ImageOptions
from tests.support.loaders import eval_loader, train_loader
from tests.support.ports import free_port


def test_storage_options_take_credentials_from_the_environment_and_never_override_the_spec():
    environ = {
        "AWS_ACCESS_KEY_ID": "AKID",
        "AWS_SECRET_ACCESS_KEY": "SECRET",
        "AWS_REGION": "auto",
        "AWS_ENDPOINT_URL_S3": "http://127.0.0.1:9000",
    }
    options = storage_options("s3://b/x.lance", {"region": "eu-1"}, environ)
    assert options == {
        "region": "eu-1",
        "access_key_id": "AKID",
        "secret_access_key": "SECRET",
        "endpoint": "http://127.0.0.1:9000",
        "allow_http": "true",
    }
    assert storage_options("/local/x.lance", {}, environ) == {}
    assert redact("key AKID secret SECRET", options) == "key *** secret ***"


def s3_spec(server, name, **fields):
    defaults = dict(storage_options=server.storage_options, batch_size=32, num_workers=0)
    return DataSpec(uri=server.uri(f"{name}.lance"), val_uri=server.uri(f"{name}_val.lance"), **(defaults | fields))


@pytest.mark.s3
def test_ingest_plan_and_read_on_s3(s3_env):
    data = s3_spec(
        s3_env,
        "digits",
        style="iterable",
        sampler="sharded_fragment",
        ingest=IngestSpec(source="sklearn-digits", val_fraction=0.1, rows_per_fragment=400),
    )
    preflight(data)  # may_create: bucket and credentials are fine, dataset not there yet
    ensure_dataset(data)
    options = storage_options(data.uri, data.storage_options)
    assert lance.dataset(data.uri, storage_options=options).count_rows() == 1617
    plan = plan_data(data, 2)
    assert (plan.rows, plan.fragments, plan.version) == (1617, 5, 1)
    loaders = [train_loader(data, rank, 2) for rank in range(2)]
    steps = [sum(1 for _ in loader) for loader in loaders]
    task = ImageClassification(ImageOptions(image_size=16), dataset_info(data, data.uri), dataset_info(data, data.val_uri))
    assert steps == [plan.steps_per_rank] * 2 and task.num_classes == 10
    assert sum(len(batch["label"]) for batch in eval_loader(data, 0, 1)) == 180
    preflight(data)


@pytest.mark.s3
@pytest.mark.slow
def test_workers_read_s3_with_the_full_options(s3_env):
    data = s3_spec(
        s3_env, "photos", num_workers=1, ingest=IngestSpec(source="skimage-photos:count=64,size=24", rows_per_fragment=20)
    )
    ensure_dataset(data)
    assert data.sampler == "block"  # a job on object storage that names no sampler
    loader = train_loader(data, 0, 1)
    batches = [batch["row_id"].tolist() for batch in loader]
    assert len(batches) == loader.steps_per_epoch == 2
    rows = lance.dataset(data.uri, storage_options=storage_options(data.uri, data.storage_options)).count_rows()
    assert {row for batch in batches for row in batch} == set(range(rows))  # every row read


@pytest.mark.s3
def test_preflight_errors_are_clear_and_never_show_credentials(s3_env, monkeypatch, tmp_path, capsys):
    data = s3_spec(s3_env, "pre", ingest=IngestSpec(source="skimage-photos:count=8,size=16"))
    ensure_dataset(data)
    preflight(data)

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAWRONGWRONGWRONG0")
    with pytest.raises(UserError, match="rejected the credentials .InvalidAccessKeyId.") as wrong_key:
        preflight(data)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_env.access_key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    with pytest.raises(UserError, match="rejected the credentials .SignatureDoesNotMatch.") as wrong_secret:
        preflight(data)
    with pytest.raises(UserError, match="rejected the credentials"):
        train_loader(data, 0, 1)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_env.secret_access_key)

    with pytest.raises(UserError, match="no Lance dataset there") as missing:
        preflight(s3_spec(s3_env, "does_not_exist"))
    no_bucket = DataSpec(uri="s3://no-such-bucket/x.lance", storage_options=s3_env.storage_options)
    with pytest.raises(UserError, match="bucket 'no-such-bucket' does not exist") as bucket:
        preflight(no_bucket)
    dead = DataSpec(
        uri=s3_env.uri("x.lance"), storage_options=dict(s3_env.storage_options, endpoint=f"http://127.0.0.1:{free_port()}")
    )
    with pytest.raises(UserError, match="cannot reach the object store endpoint"):
        preflight(dead)

    job = tmp_path / "job.yaml"
    job.write_text(f"name: s3job\ndata:\n  uri: {data.uri}\n  storage_options: {dict(data.storage_options)}\n")
    assert plan_main([str(job), "--check"]) == 0
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    assert plan_main([str(job), "--check"]) == 2
    printed = capsys.readouterr()
    messages = [str(e.value) for e in (wrong_key, wrong_secret, missing, bucket)] + [printed.out, printed.err]
    for text in messages:
        assert s3_env.secret_access_key not in text and "not-the-secret" not in text
        assert s3_env.access_key_id not in text and "AKIAWRONGWRONGWRONG0" not in text
    assert "rejected the credentials" in printed.err
