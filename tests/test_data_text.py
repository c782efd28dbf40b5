"""Text ingest: documents streamed through shard workers, split by a hash of each document's key,
packed per shard, the schema contract and its figures combined at the commit, tokenizers, the
sample estimate, append, sources and the command line."""

import os
import re
import sysconfig
from pathlib import Path

import lance
import numpy as np
import pyarrow as pa
import pytest

from lance_hpc.cli.ingest import main
from lance_hpc.errors import UserError
from lance_hpc.ingest.dataset import ensure_dataset
from lance_hpc.ingest.formats.stdlib import STDLIB_SKIPPED_DIRS
from lance_hpc.ingest.packing import Packer
from lance_hpc.ingest.shards import list_shards, parse_source, split_of
from lance_hpc.ingest.tokenizer import load_tokenizer
from lance_hpc.loading.plan import plan_data
from lance_hpc.spec import DataSpec, IngestSpec
from lance_hpc.tasks.formats import (
    BYTES_PER_TOKEN_KEY,
    DOCUMENTS_KEY,
    EOD_ID_KEY,
    KIND_KEY,
    SEQUENCE_LENGTH_KEY,
    SOURCE_KEY,
    TOKENIZER_KEY,
    VOCAB_SIZE_KEY,
    TokenInfo,
)

EOD = 256
DOCUMENTS = 12


class CodePointTokenizer:
    """One token per Unicode code point: a vocabulary too large for uint16, and no eod_id."""

    vocab_size = 0x110000

    def encode(self, text):
        return [ord(character) for character in text]


class SmallCodePointTokenizer:
    """Code points folded into 65,536 ids with EOD 0: exactly what uint16 holds."""

    vocab_size = 1 << 16
    eod_id = 0

    def encode(self, text):
        return [ord(character) % 65535 + 1 for character in text]


class FailingTokenizer(CodePointTokenizer):
    """Fails on the third document it encodes."""

    def __init__(self):
        self.calls = 0

    def encode(self, text):
        self.calls += 1
        if self.calls == 3:
            raise RuntimeError("tokenizer crashed")
        return super().encode(text)


def make_tokenizer():
    return CodePointTokenizer()


def make_small_tokenizer():
    return SmallCodePointTokenizer()


def make_failing_tokenizer():
    return FailingTokenizer()


def marked_words(document: int, count: int) -> str:
    """Words that each carry the document's marker, so any row of 17+ tokens names its documents."""
    return " ".join(f"d{document:02d}w{word}" for word in range(count))


@pytest.fixture
def corpus(tmp_path):
    """DOCUMENTS files over nested directories, plus an empty file and a file that is not UTF-8."""
    for index in range(DOCUMENTS - 1):
        path = tmp_path / "corpus" / ("a" if index % 2 else "b/c") / f"doc{index:02d}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"café {marked_words(index, 30 + 3 * index)}\n", encoding="utf-8")
    (tmp_path / "corpus" / "a" / "empty.txt").write_text("")
    (tmp_path / "corpus" / "a" / "latin1.txt").write_bytes(f"Gr\xfc\xdfe {marked_words(99, 40)}\n".encode("latin-1"))
    return f"text:{tmp_path}/corpus/**/*.txt"


def documents_in_order(source: str) -> list[tuple[str, str]]:
    """(key, text) of the non-empty documents of a text: source, decoded as ingest decodes them, in
    ingest order (sorted paths)."""
    parsed = parse_source(source)
    paths = run_files(parsed)
    texts = [(parsed.format.key(path), Path(path).read_bytes().decode("utf-8", errors="replace")) for path in paths]
    return [(key, text) for key, text in texts if text]


def run_files(parsed) -> list[str]:
    """The files of a source's shards (runs of files), in ingest order."""
    return [path for shard in list_shards(parsed) for path in parsed.format.parts[shard.id].files]


def ingest(source, train, val=None, *args: str) -> int:
    """``lance-hpc ingest`` of a text source; its exit code."""
    return main([source, str(train), *(["--val-uri", str(val)] if val else []), *args])


def stream_of(documents: list[str]) -> np.ndarray:
    return np.concatenate([np.append(np.frombuffer(doc.encode(), np.uint8).astype(np.int64), EOD) for doc in documents])


def rows_of(uri) -> np.ndarray:
    column = lance.dataset(str(uri)).to_table().column("tokens").combine_chunks()
    return column.values.to_numpy().reshape(len(column), -1).astype(np.int64)


def markers(rows: np.ndarray) -> set[str]:
    """The documents whose marked words appear in the byte-token ``rows``."""
    found: set[str] = set()
    for row in rows:
        found |= set(re.findall(r"d(\d\d)w", bytes(int(token) for token in row if token != EOD).decode(errors="replace")))
    return found


def test_split_by_document_key_and_packing_within_each_shard(tmp_path, corpus, capsys):
    train, val = tmp_path / "train.lance", tmp_path / "val.lance"
    code = ingest(
        corpus, train, val, "--sequence-length", "32", "--val-fraction", "0.25", "--rows-per-fragment", "8",
        "--files-per-shard", "100",
    )  # fmt: skip
    assert code == 0, capsys.readouterr().err
    documents = documents_in_order(corpus)
    assert len(documents) == DOCUMENTS  # the empty file is skipped
    val_docs = [text for key, text in documents if split_of(key, 0.25) == "val"]
    train_docs = [text for key, text in documents if split_of(key, 0.25) == "train"]
    assert val_docs and train_docs
    for uri, docs in ((val, val_docs), (train, train_docs)):
        rows = rows_of(uri)
        # One shard: consecutive rows overlap by one token; undone, they are the documents + EOD in order.
        assert (rows[1:, 0] == rows[:-1, -1]).all()
        stream = np.concatenate([rows[0], rows[1:, 1:].reshape(-1)])
        expected = stream_of(docs)
        assert len(expected) - 33 < len(stream) <= len(expected) and (stream == expected[: len(stream)]).all()
    assert {fragment.count_rows() for fragment in lance.dataset(str(train)).get_fragments()[:-1]} == {8}
    # No document is in both splits, and every document is in one; invalid UTF-8 became U+FFFD.
    assert not markers(rows_of(val)) & markers(rows_of(train))
    everything = {f"{index:02d}" for index in range(DOCUMENTS - 1)} | {"99"}
    # the tail of each split's stream (under one row) is not written: its documents may be missing
    assert everything - markers(rows_of(val)) - markers(rows_of(train)) <= set(
        re.findall(r"d(\d\d)w", val_docs[-1] + train_docs[-1])
    )
    assert "Gr\ufffd\ufffde" in "".join(text for _, text in documents)
    assert sorted(name for name in os.listdir(tmp_path) if not name.startswith(".")) == ["corpus", "train.lance", "val.lance"]


def test_the_split_is_the_same_for_any_worker_count_and_shard_size(tmp_path, corpus, capsys):
    def split_markers(name, *args):
        train, val = tmp_path / f"{name}-t.lance", tmp_path / f"{name}-v.lance"
        assert ingest(corpus, train, val, "--sequence-length", "8", "--val-fraction", "0.3", *args) == 0
        return rows_of(train), rows_of(val)

    one = split_markers("one", "--files-per-shard", "3")
    two = split_markers("two", "--files-per-shard", "3", "--nproc", "2")
    assert all((a == b).all() for a, b in zip(one, two))  # the same rows, in the same order
    big = split_markers("big", "--files-per-shard", "100")
    assert markers(one[1]) <= markers(big[1]) and markers(one[0]) <= markers(big[0])
    assert not markers(big[1]) & markers(one[0])


def test_schema_metadata_and_bytes_per_token_combined_over_shards(tmp_path, corpus, capsys):
    uri = tmp_path / "t.lance"
    assert ingest(corpus, uri, None, "--sequence-length", "16", "--files-per-shard", "4") == 0
    schema = lance.dataset(str(uri)).schema
    assert schema.field("tokens").type == pa.list_(pa.uint16(), 17)
    metadata = schema.metadata
    documents = [text for _, text in documents_in_order(corpus)]
    utf8_bytes = sum(len(doc.encode()) for doc in documents)
    assert metadata[KIND_KEY] == b"token_sequences" and metadata[SOURCE_KEY] == corpus.encode()
    assert (metadata[VOCAB_SIZE_KEY], metadata[EOD_ID_KEY], metadata[SEQUENCE_LENGTH_KEY]) == (b"257", b"256", b"16")
    assert metadata[TOKENIZER_KEY] == b"bytes" and int(metadata[DOCUMENTS_KEY]) == len(documents)
    assert float(metadata[BYTES_PER_TOKEN_KEY]) == pytest.approx(utf8_bytes / (utf8_bytes + len(documents)))
    info = TokenInfo.from_metadata(metadata, str(uri))
    assert (info.vocab_size, info.eod_id, info.sequence_length, info.documents) == (257, 256, 16, len(documents))
    with pytest.raises(UserError, match="holds no token sequences"):
        TokenInfo.from_metadata({b"class_names": b"[]"}, "images.lance")


def test_custom_tokenizers_choose_int32_or_uint16(tmp_path, corpus, capsys):
    wide, narrow = tmp_path / "wide.lance", tmp_path / "narrow.lance"
    assert ingest(corpus, wide, None, "--sequence-length", "16", "--tokenizer", "tests.test_data_text:make_tokenizer") == 0
    schema = lance.dataset(str(wide)).schema
    assert schema.field("tokens").type == pa.list_(pa.int32(), 17)
    # No eod_id: EOD is vocab_size and the vocabulary grows by one.
    assert (schema.metadata[VOCAB_SIZE_KEY], schema.metadata[EOD_ID_KEY]) == (b"1114113", b"1114112")
    documents = [text for _, text in documents_in_order(corpus)]
    utf8_bytes, characters = sum(len(doc.encode()) for doc in documents), sum(len(doc) for doc in documents)
    assert float(schema.metadata[BYTES_PER_TOKEN_KEY]) == pytest.approx(utf8_bytes / (characters + len(documents)))
    assert 0x110000 in rows_of(wide)

    tokenizer = "tests.test_data_text:make_small_tokenizer"
    assert ingest(corpus, narrow, None, "--sequence-length", "16", "--tokenizer", tokenizer) == 0
    schema = lance.dataset(str(narrow)).schema
    assert schema.field("tokens").type == pa.list_(pa.uint16(), 17)
    assert (schema.metadata[VOCAB_SIZE_KEY], schema.metadata[EOD_ID_KEY]) == (b"65536", b"0")


def test_a_failing_tokenizer_is_one_clear_error_and_commits_nothing(tmp_path, corpus, capsys):
    train, val = tmp_path / "t.lance", tmp_path / "v.lance"
    assert (
        ingest(corpus, train, val, "--sequence-length", "16", "--tokenizer", "tests.test_data_text:make_failing_tokenizer") == 2
    )
    error = capsys.readouterr().err
    assert "failed on document" in error and "RuntimeError: tokenizer crashed" in error and "Traceback" not in error
    assert not lance_dataset_at(train) and not lance_dataset_at(val)


def lance_dataset_at(uri) -> bool:
    try:
        lance.dataset(str(uri))
    except (ValueError, OSError):
        return False
    return True


def test_the_packer_holds_at_most_a_fragment_and_a_document_whatever_the_corpus():
    packer = Packer(load_tokenizer("bytes"), 16)
    rows_per_fragment, longest, written = 4, 0, 0
    for index in range(2_000):
        text = "x" * (index % 97)
        longest = max(longest, len(text) + 1)
        packer.add(text)
        while packer.ready() >= rows_per_fragment:
            written += len(packer.take(rows_per_fragment))
        assert packer.pending_tokens <= rows_per_fragment * 16 + longest
    assert written + packer.ready() == (packer.tokens - 1) // 16


def test_python_stdlib_files_are_sorted_capped_and_skip_tests():
    source = parse_source("python-stdlib:max_mb=0.5")
    paths = run_files(source)
    assert paths and paths == sorted(paths) and all(path.endswith(".py") for path in paths)
    assert sum(os.path.getsize(path) for path in paths) <= 500_000
    root = sysconfig.get_paths()["stdlib"]
    everything = run_files(parse_source("python-stdlib"))
    assert not any(set(Path(path).relative_to(root).parts) & STDLIB_SKIPPED_DIRS for path in everything)
    assert source.format.key(paths[0]) == str(Path(paths[0]).relative_to(root))


def test_command_line_python_stdlib_and_its_estimate(tmp_path, capsys):
    train, val = tmp_path / "t.lance", tmp_path / "v.lance"
    source = "python-stdlib:max_mb=1"
    assert ingest(source, train, val, "--sequence-length", "64", "--dry-run") == 0
    out = capsys.readouterr().out
    estimated = int(re.search(r"train about ([\d,]+)", out)[1].replace(",", ""))
    assert "schema: tokens (fixed_size_list<item: uint16>[65])" in out and not train.exists()
    assert ingest(source, train, val, "--sequence-length", "64") == 0
    rows = lance.dataset(str(train)).count_rows()
    assert f"rows train {rows:,}" in capsys.readouterr().out and lance.dataset(str(val)).count_rows() > 0
    assert 0.5 * rows < estimated < 2 * rows  # from one shard's sample, never a pass over the corpus
    metadata = lance.dataset(str(train)).schema.metadata
    assert metadata[SEQUENCE_LENGTH_KEY] == b"64" and metadata[SOURCE_KEY] == source.encode()
    assert main(["python-stdlib:max_mb=many", str(tmp_path / "x.lance")]) == 2
    assert "max_mb=N" in capsys.readouterr().err


def test_ensure_dataset_and_plan_route_text_sources(tmp_path, corpus):
    data = DataSpec(
        uri=str(tmp_path / "t.lance"), val_uri=str(tmp_path / "v.lance"), ingest=IngestSpec(source=corpus, sequence_length=16)
    )
    planned = plan_data(data, world_size=1)
    ensure_dataset(data)
    assert lance.dataset(data.uri).schema.metadata[SEQUENCE_LENGTH_KEY] == b"16"
    rows = lance.dataset(data.uri).count_rows()
    assert planned.rows > 0 and 0.5 * rows < planned.rows < 2 * rows
    assert plan_data(data, world_size=1).rows == rows  # once written, planned from the dataset itself


def test_jsonl_text_tokenised_on_request_and_a_corpus_kept_as_documents_on_request(tmp_path, corpus, capsys):
    import json

    lines = [{"id": f"doc{index}", "body": f"{marked_words(index, 20)}"} for index in range(6)]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    (tmp_path / "empty.jsonl").write_text("")  # no record: nothing to write, not an error
    tokens = tmp_path / "tokens.lance"
    args = ("--tokenize", "--column", "text=body", "--column", "key=id", "--sequence-length", "8")
    assert ingest(f"jsonl:{tmp_path}/*.jsonl", tokens, None, *args) == 0, capsys.readouterr().err
    assert lance.dataset(str(tokens)).schema.names == ["tokens"] and markers(rows_of(tokens)) >= {"00", "01", "02"}
    documents = tmp_path / "documents.lance"
    assert ingest(corpus, documents, None, "--no-tokenize") == 0
    table = lance.dataset(str(documents)).to_table()
    assert set(table.column_names) == {"text", "key"} and table.num_rows == DOCUMENTS + 1  # the empty file too
    assert ingest(f"jsonl:{tmp_path}/docs.jsonl", tmp_path / "x.lance", None, "--tokenize") == 2
    assert "no text field to tokenise" in capsys.readouterr().err


def test_clear_errors(tmp_path, corpus, capsys):
    uri = tmp_path / "t.lance"
    assert ingest(f"text:{tmp_path}/nothing/**/*.txt", uri, None) == 2
    assert "matches no file" in capsys.readouterr().err
    assert ingest(corpus, uri, None, "--tokenizer", "no_such_package.tok:make") == 2
    assert re.search(r"(?s)cannot import 'no_such_package.tok'.*ModuleNotFoundError.*PYTHONPATH", capsys.readouterr().err)
    assert ingest(corpus, uri, None, "--tokenizer", "gpt9") == 2
    assert "unknown tokenizer 'gpt9': use bytes, hf:<tokenizer.json> or an import path" in capsys.readouterr().err
    assert ingest(corpus, uri, None, "--sequence-length", "100000") == 2
    assert re.search(r"training split has [\d,]+ tokens from \d+ documents, which fill no sequence", capsys.readouterr().err)
    assert ingest(corpus, uri, tmp_path / "v.lance", "--sequence-length", "2000", "--val-fraction", "0.05") == 2
    assert re.search(r"(?s)validation split has .* raise val_fraction", capsys.readouterr().err)
    assert sorted(name for name in os.listdir(tmp_path) if not name.startswith(".")) == ["corpus"] or not lance_dataset_at(uri)
    assert not lance_dataset_at(uri)


def test_text_ingest_refuses_what_it_did_not_write_appends_and_overwrites_only_when_asked(tmp_path, corpus, capsys):
    train, val = tmp_path / "t.lance", tmp_path / "v.lance"
    val.mkdir()
    (val / "keep.txt").write_text("mine")
    assert ingest(corpus, train, val, "--sequence-length", "16", "--overwrite") == 2
    assert re.search(r"--val-uri \S+v.lance exists and is not a Lance dataset \(it holds keep.txt\)", capsys.readouterr().err)
    assert (val / "keep.txt").read_text() == "mine" and not lance_dataset_at(train)
    assert ingest(corpus, train, None, "--sequence-length", "16") == 0
    assert ingest(corpus, train, None, "--sequence-length", "16") == 0  # the same ingest again: already committed
    assert "already committed" in capsys.readouterr().out and lance.dataset(str(train)).version == 1
    assert ingest(corpus, train, None, "--sequence-length", "32") == 2
    assert "already holds a Lance dataset" in capsys.readouterr().err
    assert ingest(corpus, train, None, "--sequence-length", "32", "--append") == 2
    assert "sequence_length" in capsys.readouterr().err
    before = lance.dataset(str(train))
    other = tmp_path / "more"
    other.mkdir()
    (other / "extra.txt").write_text(marked_words(77, 60))
    assert ingest(f"text:{other}/*.txt", train, None, "--sequence-length", "16", "--append") == 0
    after = lance.dataset(str(train))
    assert after.count_rows() > before.count_rows() and "77" in markers(rows_of(train))
    assert int(after.schema.metadata[DOCUMENTS_KEY]) == int(before.schema.metadata[DOCUMENTS_KEY]) + 1
    assert lance.dataset(str(train), version=before.version).count_rows() == before.count_rows()
    assert ingest(corpus, train, None, "--sequence-length", "32", "--overwrite") == 0
    latest = lance.dataset(str(train))
    assert latest.schema.metadata[SEQUENCE_LENGTH_KEY] == b"32" and latest.version > after.version
    assert lance.dataset(str(train), version=1).schema.metadata[SEQUENCE_LENGTH_KEY] == b"16"
