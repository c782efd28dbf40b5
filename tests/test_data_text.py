"""Text ingest: split by document, packing, the schema contract, tokenizers, atomicity, sources, CLI."""

import os
import re
import sysconfig

import lance
import numpy as np
import pyarrow as pa
import pytest

from lance_hpc.data import text as text_module
from lance_hpc.data.corpus import STDLIB_SKIPPED_DIRS, document_paths, is_text_source, stdlib_paths
from lance_hpc.data.ingest import ensure_dataset, main
from lance_hpc.data.plan import plan_data
from lance_hpc.data.target import Ingested
from lance_hpc.data.text import (
    BYTES_PER_TOKEN_KEY,
    DOCUMENTS_KEY,
    EOD_ID_KEY,
    KIND_KEY,
    SEQUENCE_LENGTH_KEY,
    SOURCE_KEY,
    TOKENIZER_KEY,
    VOCAB_SIZE_KEY,
    TokenInfo,
    ingest_text,
    sequences_before_ingest,
)
from lance_hpc.errors import UserError
from lance_hpc.spec import DataSpec, IngestSpec

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


def documents_in_order(source: str) -> list[str]:
    """The non-empty documents of a text: source, decoded as ingest decodes them, in ingest order."""
    paths = document_paths(source)
    return [text for text in (path.read_bytes().decode("utf-8", errors="replace") for path in paths) if text]


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


def test_split_by_document_and_packing(tmp_path, corpus):
    train, val = tmp_path / "train.lance", tmp_path / "val.lance"
    written = ingest_text(corpus, str(train), str(val), sequence_length=32, val_fraction=0.25, rows_per_fragment=8, seed=1)
    documents = documents_in_order(corpus)
    assert len(documents) == DOCUMENTS  # the empty file is skipped
    val_rows, train_rows = rows_of(val), rows_of(train)
    assert (written.train, written.val, written.kept) == (len(train_rows), len(val_rows), ())
    assert {fragment.count_rows() for fragment in lance.dataset(str(train)).get_fragments()[:-1]} == {8}
    # Consecutive validation rows overlap by one token; undone, they are the documents + EOD in order.
    assert (val_rows[1:, 0] == val_rows[:-1, -1]).all()
    val_stream = np.concatenate([val_rows[0], val_rows[1:, 1:].reshape(-1)])
    val_documents = [doc for doc in documents if re.search(r"d(\d\d)w", doc)[1] in markers(val_rows)]
    expected = stream_of(val_documents)
    assert len(val_documents) == 3 and len(expected) - 32 < len(val_stream) <= len(expected)
    assert (val_stream == expected[: len(val_stream)]).all()
    # Training rows are the packing of the other documents, in a shuffled order.
    expected_train = stream_of([doc for doc in documents if doc not in val_documents])
    packed = np.lib.stride_tricks.sliding_window_view(expected_train, 33)[::32][: (len(expected_train) - 1) // 32]
    assert sorted(map(tuple, train_rows)) == sorted(map(tuple, packed)) and (train_rows != packed).any()
    # No document is in both splits, and every document is in one; invalid UTF-8 became U+FFFD.
    assert not markers(val_rows) & markers(train_rows)
    assert markers(val_rows) | markers(train_rows) == {f"{index:02d}" for index in range(DOCUMENTS - 1)} | {"99"}
    assert "Gr\ufffd\ufffde" in "".join(documents)
    assert not any(name.startswith(".") for name in os.listdir(tmp_path))


def test_schema_metadata_and_bytes_per_token(tmp_path, corpus):
    uri = tmp_path / "t.lance"
    ingest_text(corpus, str(uri), None, sequence_length=16)
    schema = lance.dataset(str(uri)).schema
    assert schema.field("tokens").type == pa.list_(pa.uint16(), 17)
    metadata = schema.metadata
    documents = documents_in_order(corpus)
    utf8_bytes = sum(len(doc.encode()) for doc in documents)
    assert metadata[KIND_KEY] == b"token_sequences" and metadata[SOURCE_KEY] == corpus.encode()
    assert (metadata[VOCAB_SIZE_KEY], metadata[EOD_ID_KEY], metadata[SEQUENCE_LENGTH_KEY]) == (b"257", b"256", b"16")
    assert metadata[TOKENIZER_KEY] == b"bytes" and int(metadata[DOCUMENTS_KEY]) == len(documents)
    assert float(metadata[BYTES_PER_TOKEN_KEY]) == pytest.approx(utf8_bytes / (utf8_bytes + len(documents)))
    info = TokenInfo.from_metadata(metadata, str(uri))
    assert (info.vocab_size, info.eod_id, info.sequence_length, info.documents) == (257, 256, 16, len(documents))
    with pytest.raises(UserError, match="holds no token sequences"):
        TokenInfo.from_metadata({b"class_names": b"[]"}, "images.lance")


def test_custom_tokenizers_choose_int32_or_uint16(tmp_path, corpus):
    wide, narrow = tmp_path / "wide.lance", tmp_path / "narrow.lance"
    ingest_text(corpus, str(wide), None, sequence_length=16, tokenizer="tests.test_data_text:make_tokenizer")
    schema = lance.dataset(str(wide)).schema
    assert schema.field("tokens").type == pa.list_(pa.int32(), 17)
    # No eod_id: EOD is vocab_size and the vocabulary grows by one.
    assert (schema.metadata[VOCAB_SIZE_KEY], schema.metadata[EOD_ID_KEY]) == (b"1114113", b"1114112")
    documents = documents_in_order(corpus)
    utf8_bytes, characters = sum(len(doc.encode()) for doc in documents), sum(len(doc) for doc in documents)
    assert float(schema.metadata[BYTES_PER_TOKEN_KEY]) == pytest.approx(utf8_bytes / (characters + len(documents)))
    assert 0x110000 in rows_of(wide)

    ingest_text(corpus, str(narrow), None, sequence_length=16, tokenizer="tests.test_data_text:make_small_tokenizer")
    schema = lance.dataset(str(narrow)).schema
    assert schema.field("tokens").type == pa.list_(pa.uint16(), 17)
    assert (schema.metadata[VOCAB_SIZE_KEY], schema.metadata[EOD_ID_KEY]) == (b"65536", b"0")


def test_same_seed_same_dataset_other_seed_other_order(tmp_path, corpus):
    def tables(seed, name):
        ingest_text(corpus, str(tmp_path / f"{name}-t"), str(tmp_path / f"{name}-v"), sequence_length=16, seed=seed)
        return rows_of(tmp_path / f"{name}-t"), rows_of(tmp_path / f"{name}-v")

    first, again, other = tables(5, "first"), tables(5, "again"), tables(6, "other")
    assert all((a == b).all() for a, b in zip(first, again))
    assert first[0].shape != other[0].shape or (first[0] != other[0]).any()


def test_failing_tokenizer_leaves_no_dataset(tmp_path, corpus):
    train, val = tmp_path / "t.lance", tmp_path / "v.lance"
    with pytest.raises(RuntimeError, match="tokenizer crashed"):
        ingest_text(corpus, str(train), str(val), sequence_length=16, tokenizer="tests.test_data_text:make_failing_tokenizer")
    assert os.listdir(tmp_path) == ["corpus"]


def test_interrupted_write_leaves_no_partial_directory(tmp_path, corpus, monkeypatch):
    uri = tmp_path / "t.lance"
    real_batches = text_module._row_batches

    def failing_batches(rows, order, schema):
        for number, batch in enumerate(real_batches(rows, order, schema)):
            if number == 2:
                raise RuntimeError("node lost")
            yield batch

    monkeypatch.setattr(text_module, "_row_batches", failing_batches)
    monkeypatch.setattr(text_module, "WRITE_CHUNK_ROWS", 4)
    with pytest.raises(OSError, match="node lost"):  # Lance wraps what the batch reader raised
        ingest_text(corpus, str(uri), None, sequence_length=16, rows_per_fragment=4)
    assert os.listdir(tmp_path) == ["corpus"]


def test_python_stdlib_paths_are_sorted_capped_and_skip_tests():
    paths = stdlib_paths(max_mb=0.5)
    assert paths and paths == sorted(paths) and all(path.suffix == ".py" for path in paths)
    assert sum(path.stat().st_size for path in paths) <= 500_000
    root = sysconfig.get_paths()["stdlib"]
    assert not any(set(path.relative_to(root).parts) & STDLIB_SKIPPED_DIRS for path in stdlib_paths())
    assert stdlib_paths(max_mb=0.5) == paths
    assert is_text_source("python-stdlib") and is_text_source("python-stdlib:max_mb=2") and is_text_source("text:*.md")
    assert not is_text_source("sklearn-digits") and not is_text_source("imagefolder:text")


def test_command_line_python_stdlib(tmp_path, capsys):
    train, val = tmp_path / "t.lance", tmp_path / "v.lance"
    expected = sequences_before_ingest("python-stdlib:max_mb=1", 64, "bytes", 0.2, 0, has_val=True)
    assert main(["python-stdlib:max_mb=1", str(train), "--val-uri", str(val), "--sequence-length", "64"]) == 0
    assert f"wrote {expected:,} training rows" in capsys.readouterr().out
    assert lance.dataset(str(train)).count_rows() == expected and lance.dataset(str(val)).count_rows() > 0
    metadata = lance.dataset(str(train)).schema.metadata
    assert metadata[SEQUENCE_LENGTH_KEY] == b"64" and metadata[SOURCE_KEY] == b"python-stdlib:max_mb=1"
    assert main(["python-stdlib:max_mb=many", str(tmp_path / "x.lance")]) == 2
    assert "max_mb=N" in capsys.readouterr().err


def test_ensure_dataset_and_plan_route_text_sources(tmp_path, corpus):
    data = DataSpec(uri=str(tmp_path / "t.lance"), val_uri=str(tmp_path / "v.lance"), ingest=IngestSpec(source=corpus))
    planned = plan_data(data, world_size=1)
    ensure_dataset(data)
    assert lance.dataset(data.uri).schema.metadata[SEQUENCE_LENGTH_KEY] == b"256"
    assert lance.dataset(data.uri).count_rows() == planned.rows > 0
    assert plan_data(data, world_size=1).rows == planned.rows


def test_clear_errors(tmp_path, corpus):
    uri = str(tmp_path / "t.lance")
    with pytest.raises(UserError, match=r"no files match the glob '.*nothing/\*\*/\*\.txt'"):
        ingest_text(f"text:{tmp_path}/nothing/**/*.txt", uri, None, sequence_length=8)
    with pytest.raises(UserError, match=r"(?s)cannot import 'no_such_package.tok'.*ModuleNotFoundError.*PYTHONPATH"):
        ingest_text(corpus, uri, None, sequence_length=8, tokenizer="no_such_package.tok:make")
    with pytest.raises(UserError, match="unknown tokenizer 'gpt9': use bytes, hf:<tokenizer.json> or an import path"):
        ingest_text(corpus, uri, None, sequence_length=8, tokenizer="gpt9")
    with pytest.raises(UserError, match=r"training split has [\d,]+ tokens from \d+ documents, but sequence_length 100000 needs"):
        ingest_text(corpus, uri, None, sequence_length=100_000)
    with pytest.raises(UserError, match="validation split has .* raise val_fraction"):
        ingest_text(corpus, uri, str(tmp_path / "v.lance"), sequence_length=2_000, val_fraction=0.05)
    single = tmp_path / "single.txt"
    single.write_text("one document")
    with pytest.raises(UserError, match="at least 2"):
        ingest_text(f"text:{single}", uri, str(tmp_path / "v.lance"), sequence_length=4)
    assert sorted(os.listdir(tmp_path)) == ["corpus", "single.txt"]


def test_text_ingest_refuses_what_it_did_not_write_and_writes_over_a_dataset_only_when_asked(tmp_path, corpus):
    train, val = tmp_path / "t.lance", tmp_path / "v.lance"
    val.mkdir()
    (val / "keep.txt").write_text("mine")
    with pytest.raises(UserError, match=r"--val-uri \S+v.lance exists and is not a Lance dataset \(it holds keep.txt\)"):
        ingest_text(corpus, str(train), str(val), sequence_length=16, overwrite=True)
    assert (val / "keep.txt").read_text() == "mine" and not train.exists()
    assert ingest_text(corpus, str(train), None, sequence_length=16).train > 0
    assert ingest_text(corpus, str(train), None, sequence_length=16) == Ingested(kept=(str(train),))
    assert lance.dataset(str(train)).version == 1
    ingest_text(corpus, str(train), None, sequence_length=32, overwrite=True)
    assert lance.dataset(str(train)).version == 2 and lance.dataset(str(train)).schema.metadata[SEQUENCE_LENGTH_KEY] == b"32"
    assert lance.dataset(str(train), version=1).schema.metadata[SEQUENCE_LENGTH_KEY] == b"16"
