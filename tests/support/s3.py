"""Fixture for the loopback S3-compatible server: moto's server mode in a subprocess.

moto accepts any credentials by default. To make wrong credentials fail the way a real store does,
the fixture creates an IAM user with an S3 policy and an access key while moto is still open, then
switches authentication on (moto's ``/moto-api/reset-auth`` with a count of 0). From then on only
that key signs valid requests: an unknown key gets ``InvalidAccessKeyId`` and a wrong secret
``SignatureDoesNotMatch``, as on AWS.

moto 5.2 checks signatures against the URL-decoded query string (``prefix=a/`` where the client
signed ``prefix=a%2F``), so every signed ListObjects call would fail; and it names the root element
of its CompleteMultipartUpload answer ``CompleteMultipartUploadResponse`` where S3 says
``CompleteMultipartUploadResult``, which the AWS C++ SDK (pyarrow's S3 client) reads as an error,
so every multipart upload would fail. The server therefore runs from this module
(``python -m tests.support.s3 PORT``), which re-encodes the query before moto checks and renames
that element.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import pytest

from benchmarks.s3_server import stop_process
from tests.support.ports import free_port

S3_POLICY = {
    "Version": "2012-10-17",
    "Statement": [{"Effect": "Allow", "Action": ["s3:*"], "Resource": "*"}],
}


@dataclass
class S3Server:
    """A running loopback S3 server with one bucket and one valid access key."""

    endpoint: str
    bucket: str
    access_key_id: str = field(repr=False)
    secret_access_key: str = field(repr=False)
    region: str = "us-east-1"
    process: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def env(self) -> dict[str, str]:
        """AWS-style environment variables a job would export."""
        return {
            "AWS_ACCESS_KEY_ID": self.access_key_id,
            "AWS_SECRET_ACCESS_KEY": self.secret_access_key,
            "AWS_REGION": self.region,
        }

    @property
    def storage_options(self) -> dict[str, str]:
        """The non-secret options a job spec carries."""
        return {"endpoint": self.endpoint, "region": self.region, "allow_http": "true"}

    def uri(self, name: str) -> str:
        return f"s3://{self.bucket}/{name}"


def _wait_until_up(endpoint: str, process: subprocess.Popen, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"moto server exited with code {process.returncode}")
        try:
            urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=1).read()
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"moto server at {endpoint} did not start within {timeout_s}s")


def start_s3_server(bucket: str = "lance-hpc-test") -> S3Server:
    """Start moto on a free loopback port, create a bucket and a key, then require that key."""
    import boto3

    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    env = {key: value for key, value in os.environ.items() if not key.startswith("AWS_")}
    process = subprocess.Popen(
        [sys.executable, "-m", "tests.support.s3", str(port)],
        cwd=Path(__file__).resolve().parents[2],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        _wait_until_up(endpoint, process)
        setup = {
            "endpoint_url": endpoint,
            "region_name": "us-east-1",
            "aws_access_key_id": "setup",
            "aws_secret_access_key": "setup",
        }
        iam = boto3.client("iam", **setup)
        iam.create_user(UserName="lance-hpc")
        iam.put_user_policy(UserName="lance-hpc", PolicyName="s3", PolicyDocument=json.dumps(S3_POLICY))
        key = iam.create_access_key(UserName="lance-hpc")["AccessKey"]
        boto3.client("s3", **setup).create_bucket(Bucket=bucket)
        request = urllib.request.Request(
            f"{endpoint}/moto-api/reset-auth", data=b"0", method="POST", headers={"Content-Type": "text/plain"}
        )
        urllib.request.urlopen(request, timeout=5).read()
    except BaseException:
        process.kill()
        process.wait()
        raise
    return S3Server(endpoint, bucket, key["AccessKeyId"], key["SecretAccessKey"], process=process)


@pytest.fixture
def s3_env(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> S3Server:
    """The server's valid key in the environment, as a job's: worker processes and ranks inherit it."""
    for key, value in s3_server.env.items():
        monkeypatch.setenv(key, value)
    return s3_server


def stop_s3_server(server: S3Server) -> None:
    if server.process is not None:
        stop_process(server.process)


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """A loopback S3 server for the whole session (``.endpoint``, ``.env``, ``.storage_options``)."""
    server = start_s3_server()
    try:
        yield server
    finally:
        stop_s3_server(server)


def serve(port: int) -> None:
    """Run moto's server on loopback with the signature check fixed for encoded query strings and
    S3's name for the result of a completed multipart upload."""
    from moto.core.serialize import S3Serializer
    from moto.iam.access_control import IAMRequestBase
    from moto.server import main

    create_request = IAMRequestBase._create_aws_request

    def create_encoded_request(self: IAMRequestBase):  # type: ignore[no-untyped-def]
        path, _, query = self._path.partition("?")
        if query:
            pairs = urllib.parse.parse_qsl(query, keep_blank_values=True)
            self._path = path + "?" + urllib.parse.urlencode(pairs, quote_via=urllib.parse.quote, safe="-_.~")
        return create_request(self)

    IAMRequestBase._create_aws_request = create_encoded_request

    serialize = S3Serializer._serialized_result_to_response

    def serialize_with_s3_names(self: S3Serializer, resp, result, shape, serialized_result):  # type: ignore[no-untyped-def]
        resp = serialize(self, resp, result, shape, serialized_result)
        if self.operation_model.name == "CompleteMultipartUpload":
            resp["body"] = resp["body"].replace("CompleteMultipartUploadResponse", "CompleteMultipartUploadResult")
        return resp

    S3Serializer._serialized_result_to_response = serialize_with_s3_names
    main(["-H", "127.0.0.1", "-p", str(port)])


if __name__ == "__main__":
    serve(int(sys.argv[1]))
