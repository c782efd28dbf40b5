"""The benchmark's S3 server: real Lance reads and writes through it, byte ranges, listings as an
independent client (boto3) sees them, the first-byte latency, many requests in flight at once,
and the counters the benchmark bills by."""

from __future__ import annotations

import http.client
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import numpy as np
import pyarrow as pa
import pytest

from benchmarks.s3_server import CounterWindow, S3Error, parse_range, start_server

ROWS = 3000


def _table(rows: int, seed: int = 0) -> pa.Table:
    rng = np.random.default_rng(seed)
    return pa.table(
        {
            "id": np.arange(rows),
            "label": rng.integers(0, 10, rows),
            "blob": [rng.bytes(int(size)) for size in rng.integers(200, 3000, rows)],
        }
    )


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    import lance

    root = tmp_path_factory.mktemp("bucket")
    lance.write_dataset(_table(ROWS), str(root / "sets" / "train.lance"), max_rows_per_file=700)
    (root / "flat").mkdir()
    (root / "flat" / "bytes.bin").write_bytes(bytes(range(256)) * 40)
    for name in ("a/1", "a/2", "a/b/3", "a/b/4", "a/c/5", "a0", "z"):
        (root / "keys" / name).parent.mkdir(parents=True, exist_ok=True)
        (root / "keys" / name).write_text(name)
    with start_server(root) as server:
        yield server, root


def _request(server, method: str, path: str, headers: dict | None = None) -> tuple[int, dict, bytes]:
    endpoint = urlsplit(server.endpoint)
    connection = http.client.HTTPConnection(endpoint.hostname, endpoint.port, timeout=60)
    try:
        connection.request(method, path, headers=headers or {})
        answer = connection.getresponse()
        return answer.status, {k.lower(): v for k, v in answer.getheaders()}, answer.read()
    finally:
        connection.close()


def test_lance_reads_through_the_server_match_the_local_dataset(served):
    import lance

    server, root = served
    local = lance.dataset(str(root / "sets" / "train.lance"))
    server.reset_counters()
    remote = lance.dataset(server.uri("sets/train.lance"), storage_options=server.storage_options())
    assert remote.count_rows() == ROWS
    assert len(remote.get_fragments()) == len(local.get_fragments()) == 5
    rows = [0, 1, 699, 700, 1234, 2999, 17]
    assert remote.take(rows, columns=["id", "blob"]) == local.take(rows, columns=["id", "blob"])
    assert remote.to_table() == local.to_table()
    filtered = dict(columns=["id", "blob"], filter="label = 3")
    assert remote.scanner(**filtered).to_table() == local.scanner(**filtered).to_table()
    counts = server.counters()
    assert counts["gets"] > 0 and counts["lists"] >= 1 and counts["errors"] == 0
    data_bytes = sum(path.stat().st_size for path in (root / "sets" / "train.lance" / "data").iterdir())
    assert counts["get_bytes"] >= data_bytes  # the whole table was read at least once
    assert counts["requests"] == counts["gets"] + counts["heads"] + counts["lists"]
    server.reset_counters()
    assert {k: v for k, v in server.counters().items() if k != "cpu_s"} == {
        "requests": 0,
        "gets": 0,
        "get_bytes": 0,
        "heads": 0,
        "lists": 0,
        "puts": 0,
        "put_bytes": 0,
        "deletes": 0,
        "errors": 0,
        "max_in_flight": 0,
    }


def test_lance_writes_and_appends_through_the_server(served):
    import lance

    server, root = served
    table = _table(1200, seed=1)
    options = server.storage_options()
    uri = server.uri("written/new.lance")
    lance.write_dataset(table.slice(0, 800), uri, storage_options=options, max_rows_per_file=300)
    lance.write_dataset(table.slice(800), uri, storage_options=options, mode="append")
    assert lance.dataset(str(root / "written" / "new.lance")).to_table() == table
    assert lance.dataset(uri, storage_options=options).take([5, 900], columns=["id"]).column("id").to_pylist() == [5, 900]
    assert server.counters()["puts"] > 0
    assert not list(root.rglob(".s3-bench-*"))  # no staging file left behind


@pytest.mark.parametrize(
    "header, status, expected",
    [
        ("bytes=0-9", 206, slice(0, 10)),
        ("bytes=250-260", 206, slice(250, 261)),
        ("bytes=10000-", 206, slice(10000, 10240)),
        ("bytes=-5", 206, slice(10235, 10240)),
        ("bytes=10230-99999", 206, slice(10230, 10240)),
        (None, 200, slice(0, 10240)),
    ],
)
def test_get_answers_one_byte_range_with_its_content_range(served, header, status, expected):
    server, root = served
    content = (root / "flat" / "bytes.bin").read_bytes()
    code, headers, body = _request(server, "GET", "/bench/flat/bytes.bin", {"Range": header} if header else {})
    assert code == status and body == content[expected]
    assert int(headers["content-length"]) == len(body)
    if header:
        assert headers["content-range"] == f"bytes {expected.start}-{expected.stop - 1}/{len(content)}"


def test_errors_are_s3_errors(served):
    server, _ = served
    code, _, body = _request(server, "GET", "/bench/flat/bytes.bin", {"Range": "bytes=10240-"})
    assert code == 416 and b"<Code>InvalidRange</Code>" in body
    code, _, body = _request(server, "GET", "/bench/flat/missing.bin")
    assert code == 404 and b"<Code>NoSuchKey</Code>" in body
    code, _, body = _request(server, "GET", "/other/flat/bytes.bin")
    assert code == 404 and b"<Code>NoSuchBucket</Code>" in body
    code, _, body = _request(server, "GET", "/bench/..%2F..%2Fetc%2Fpasswd")
    assert code == 400
    code, headers, body = _request(server, "HEAD", "/bench/flat/bytes.bin")
    assert code == 200 and headers["content-length"] == "10240" and body == b""
    with pytest.raises(S3Error):
        parse_range("bytes=0-1,5-6", 100)


def test_list_objects_v2_with_prefix_delimiter_and_continuation_as_boto3_reads_it(served):
    import boto3

    server, _ = served
    client = boto3.client(
        "s3", endpoint_url=server.endpoint, region_name="us-east-1", aws_access_key_id="any", aws_secret_access_key="any"
    )
    pages = client.get_paginator("list_objects_v2").paginate(
        Bucket=server.bucket, Prefix="keys/", PaginationConfig={"PageSize": 2}
    )
    keys = [item["Key"] for page in pages for item in page.get("Contents", [])]
    assert keys == ["keys/a/1", "keys/a/2", "keys/a/b/3", "keys/a/b/4", "keys/a/c/5", "keys/a0", "keys/z"]
    pages = list(
        client.get_paginator("list_objects_v2").paginate(
            Bucket=server.bucket, Prefix="keys/a", Delimiter="/", PaginationConfig={"PageSize": 1}
        )
    )
    assert len(pages) == 2 and pages[0]["IsTruncated"]
    assert [p["Prefix"] for page in pages for p in page.get("CommonPrefixes", [])] == ["keys/a/"]
    assert [item["Key"] for page in pages for item in page.get("Contents", [])] == ["keys/a0"]
    listing = client.list_objects_v2(Bucket=server.bucket, Prefix="keys/a/", Delimiter="/")
    assert [item["Key"] for item in listing["Contents"]] == ["keys/a/1", "keys/a/2"]
    assert [item["Size"] for item in listing["Contents"]] == [3, 3]
    assert [p["Prefix"] for p in listing["CommonPrefixes"]] == ["keys/a/b/", "keys/a/c/"]
    assert client.get_object(Bucket=server.bucket, Key="keys/a/b/3", Range="bytes=4-")["Body"].read() == b"3"


def test_put_copy_multipart_upload_and_delete_change_the_files_under_the_root(served):
    import boto3

    server, root = served
    client = boto3.client(
        "s3", endpoint_url=server.endpoint, region_name="us-east-1", aws_access_key_id="any", aws_secret_access_key="any"
    )
    client.put_object(Bucket=server.bucket, Key="uploads/one.bin", Body=b"first")
    assert (root / "uploads" / "one.bin").read_bytes() == b"first"
    client.copy_object(
        Bucket=server.bucket, Key="uploads/two.bin", CopySource={"Bucket": server.bucket, "Key": "uploads/one.bin"}
    )
    assert (root / "uploads" / "two.bin").read_bytes() == b"first"
    parts = [bytes([index]) * (5 * 2**20 if index < 3 else 1000) for index in (1, 2, 3)]
    upload = client.create_multipart_upload(Bucket=server.bucket, Key="uploads/big.bin")["UploadId"]
    etags = [
        client.upload_part(Bucket=server.bucket, Key="uploads/big.bin", UploadId=upload, PartNumber=number, Body=part)["ETag"]
        for number, part in enumerate(parts, start=1)
    ]
    client.complete_multipart_upload(
        Bucket=server.bucket,
        Key="uploads/big.bin",
        UploadId=upload,
        MultipartUpload={"Parts": [{"PartNumber": number, "ETag": etag} for number, etag in enumerate(etags, start=1)]},
    )
    assert (root / "uploads" / "big.bin").read_bytes() == b"".join(parts)
    # The server keeps the files it read open; one replaced since is read anew.
    assert client.get_object(Bucket=server.bucket, Key="uploads/one.bin")["Body"].read() == b"first"
    client.put_object(Bucket=server.bucket, Key="uploads/one.bin", Body=b"second")
    assert client.get_object(Bucket=server.bucket, Key="uploads/one.bin")["Body"].read() == b"second"
    client.delete_object(Bucket=server.bucket, Key="uploads/two.bin")
    assert not (root / "uploads" / "two.bin").exists()
    listing = client.list_objects_v2(Bucket=server.bucket, Prefix="uploads/")
    assert [item["Key"] for item in listing["Contents"]] == ["uploads/big.bin", "uploads/one.bin"]


def test_latency_holds_every_answer_back_without_holding_other_requests(tmp_path):
    (tmp_path / "object").write_bytes(b"x" * 100)
    concurrent = 256
    with start_server(tmp_path, latency_ms=2500) as server:
        started = time.monotonic()
        code, _, _ = _request(server, "HEAD", "/bench/object")
        assert code == 200 and time.monotonic() - started >= 2.5
        server.reset_counters()
        barrier = threading.Barrier(concurrent)
        answers: list[bytes] = []

        def fetch() -> None:
            barrier.wait()
            answers.append(_request(server, "GET", "/bench/object", {"Range": "bytes=0-9"})[2])

        threads = [threading.Thread(target=fetch) for _ in range(concurrent)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        counts = server.counters()
        assert answers == [b"x" * 10] * concurrent
        # Every request waited its 2.5 s at the same time as the others, not one after another.
        assert counts["max_in_flight"] == concurrent
        assert counts["gets"] == concurrent and counts["get_bytes"] == 10 * concurrent
        assert server.cpu_seconds() > 0 and counts["cpu_s"] > 0


def test_a_counter_window_counts_only_what_happened_inside_it(served):
    server, _ = served
    _request(server, "GET", "/bench/flat/bytes.bin")  # before the window
    window = CounterWindow(server.endpoint)
    window.start()
    for start in (0, 100, 200):
        _request(server, "GET", "/bench/flat/bytes.bin", {"Range": f"bytes={start}-{start + 49}"})
    _request(server, "HEAD", "/bench/flat/bytes.bin")
    counts = window.end()
    assert (counts["requests"], counts["gets"], counts["get_bytes"], counts["heads"]) == (4, 3, 150, 1)
    assert 0 <= counts["cpu_s"] < server.counters()["cpu_s"]


def test_the_server_exits_cleanly_when_stopped_or_when_its_parent_lets_go(tmp_path):
    server = start_server(Path(tmp_path))
    server.stop()
    assert server.process.returncode == 0  # SIGTERM ends it through its cleanup, not by the default action
    server = start_server(Path(tmp_path))
    server.process.stdin.close()  # what the parent's exit does
    assert server.process.wait(timeout=30) == 0
    server.stop()
