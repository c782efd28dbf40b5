"""Real tokenizers: a byte-level BPE trained offline on the standard library's sources, loaded with
hf:<tokenizer.json>, used by text ingest; and a tokenizers file without an end-of-text token."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import lance
import numpy as np
import pytest
import yaml

from lance_hpc.cli.ingest import main as ingest_main
from lance_hpc.cli.tokenizer import main as tokenizer_main
from lance_hpc.errors import UserError
from lance_hpc.ingest.shards import split_of
from lance_hpc.ingest.tokenizer import documents, load_tokenizer
from lance_hpc.tasks.formats import BYTES_PER_TOKEN_KEY, DOCUMENTS_KEY, EOD_ID_KEY, VOCAB_SIZE_KEY
from tests.support.jobs import REPO_ROOT

SOURCE = "python-stdlib:max_mb=0.5"


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tokenizer") / "bpe.json"
    assert tokenizer_main(["train", SOURCE, str(out), "--vocab-size", "1000"]) == 0
    return out


def test_a_trained_bpe_encodes_with_its_end_of_text_token_and_round_trips(trained: Path, capsys) -> None:
    from tokenizers import Tokenizer as HfTokenizer

    tokenizer = load_tokenizer(f"hf:{trained}")
    assert tokenizer.vocab_size == 1000 and tokenizer.eod_id == HfTokenizer.from_file(str(trained)).token_to_id("<|endoftext|>")
    text = "def main(argv):\n    return sorted(argv)  # ünïcode\n"
    ids = tokenizer.encode(text)
    assert ids.dtype == np.int64 and 0 < len(ids) < len(text.encode()) and ids.max() < 1000
    assert HfTokenizer.from_file(str(trained)).decode(ids.tolist()) == text
    assert tokenizer_main(["train", SOURCE, str(trained)]) == 2  # never written over
    assert "exists: a tokenizer is never written over" in capsys.readouterr().err


def test_text_ingest_with_the_trained_tokenizer_packs_fewer_tokens_than_bytes(trained: Path, tmp_path: Path) -> None:
    args = ["--val-uri", str(tmp_path / "val.lance"), "--sequence-length", "64", "--tokenizer", f"hf:{trained}"]
    assert ingest_main([SOURCE, str(tmp_path / "train.lance"), *args]) == 0
    dataset = lance.dataset(str(tmp_path / "train.lance"))
    metadata = dataset.schema.metadata
    assert int(metadata[VOCAB_SIZE_KEY]) == 1000 and int(metadata[EOD_ID_KEY]) < 1000
    assert float(metadata[BYTES_PER_TOKEN_KEY]) > 2.0  # a BPE fitted to Python code: several bytes a token
    tokens = dataset.to_table().column("tokens").to_pylist()
    assert len(tokens[0]) == 65 and max(max(row) for row in tokens) < 1000


def test_a_tokenizers_file_without_an_end_of_text_token_gets_one_more_id(tmp_path: Path) -> None:
    from tokenizers import Tokenizer as HfTokenizer
    from tokenizers import models, pre_tokenizers

    vocab = {chr(code): code - 97 for code in range(97, 123)}
    plain = HfTokenizer(models.WordLevel(vocab=vocab, unk_token="a"))
    plain.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    plain.save(str(tmp_path / "letters.json"))
    tokenizer = load_tokenizer(f"hf:{tmp_path / 'letters.json'}")
    assert (tokenizer.vocab_size, tokenizer.eod_id) == (27, 26)
    assert tokenizer.encode("abc").tolist() == [0, 1, 2]

    (tmp_path / "broken.json").write_text(json.dumps({"not": "a tokenizer"}))
    with pytest.raises(UserError, match="is not a tokenizers file"):
        load_tokenizer(f"hf:{tmp_path / 'broken.json'}")
    with pytest.raises(UserError, match="no such file"):
        load_tokenizer(f"hf:{tmp_path / 'missing.json'}")


def test_training_leaves_out_the_documents_an_ingest_holds_out(tmp_path: Path, capsys) -> None:
    out = tmp_path / "bpe.json"
    assert tokenizer_main(["train", SOURCE, str(out), "--vocab-size", "400", "--val-fraction", "0.2"]) == 0
    assert "trained a 400-token BPE on" in capsys.readouterr().out
    everything = list(documents(SOURCE))
    kept = list(documents(SOURCE, 0.2))
    assert 0 < len(kept) < len(everything)
    assert ingest_main([SOURCE, str(tmp_path / "t.lance"), "--val-uri", str(tmp_path / "v.lance"), "--val-fraction", "0.2"]) == 0
    assert int(lance.dataset(str(tmp_path / "t.lance")).schema.metadata[DOCUMENTS_KEY]) == len(kept)
    assert split_of("json/decoder.py", 0.2) in ("train", "val")
    assert tokenizer_main(["train", "sklearn-digits", str(tmp_path / "x.json")]) == 2
    assert "give text:<glob>" in capsys.readouterr().err


@pytest.mark.slow
def test_a_job_whose_ingest_names_a_tokenizer_not_there_yet_trains_it_then_ingests_and_trains(tmp_path: Path) -> None:
    """As the language model demo starts from a fresh checkout: no tokenizer file, no dataset."""
    tokenizer = tmp_path / "data" / "bpe.json"
    raw = {
        "name": "lm",
        "slurm": {"tasks_per_node": 2, "cpus_per_task": 1, "log_dir": str(tmp_path / "logs")},
        "data": {
            "uri": str(tmp_path / "data" / "train.lance"),
            "val_uri": str(tmp_path / "data" / "val.lance"),
            "ingest": {
                "source": "python-stdlib:max_mb=0.2",
                "val_fraction": 0.1,
                "sequence_length": 32,
                "tokenizer": f"hf:{tokenizer}",
                "vocab_size": 500,
            },
            "batch_size": 8,
            "num_workers": 0,
        },
        "task": {"name": "language_model", "options": {"layers": 1, "width": 32, "heads": 2}},
        "train": {"epochs": 1, "max_steps": 3, "lr": 0.003, "lr_scaling": "none", "precision": "fp32"},
        "checkpoint": {"dir": str(tmp_path / "checkpoints")},
        "logging": {"tensorboard_dir": str(tmp_path / "runs"), "progress": False},
    }
    spec_file = tmp_path / "lm.yaml"
    spec_file.write_text(yaml.safe_dump(raw))
    command = [sys.executable, "-m", "lance_hpc.submit", str(spec_file), "--local"]
    environ = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    first = subprocess.run(command, capture_output=True, text=True, env=environ, cwd=tmp_path, timeout=600)
    output = first.stdout + first.stderr
    assert first.returncode == 0, output
    said = f"tokenizer hf:{tokenizer} does not exist yet: training a 500-token byte-level BPE on the training documents"
    assert said in output and f"wrote {tokenizer}" in output, output
    assert load_tokenizer(f"hf:{tokenizer}").vocab_size == 500
    assert int(lance.dataset(raw["data"]["uri"]).schema.metadata[VOCAB_SIZE_KEY]) == 500
    assert "final validation bits per byte" in output, output
    again = subprocess.run(command, capture_output=True, text=True, env=environ, cwd=tmp_path, timeout=600)
    assert again.returncode == 0 and "does not exist yet" not in again.stdout + again.stderr
