"""``language_model``: next-token prediction on packed token sequences.

Each row holds ``sequence_length + 1`` tokens (``lance-hpc ingest text:<glob>`` or
``python-stdlib`` writes them); the model reads the first ``sequence_length`` and is scored on
predicting each following token. Reported: loss (nats per token), perplexity, bits per byte of
the original text (from the split's bytes per token, which ingest records), and tokens per second.
"""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
import torch
from torch import nn

from lance_hpc.errors import UserError
from lance_hpc.imports import is_import_path, load_callable
from lance_hpc.tasks.base import (
    Batch,
    DatasetInfo,
    Decoder,
    FieldSpec,
    Task,
    TaskError,
    column_problems,
)
from lance_hpc.tasks.formats import KIND_KEY, TOKEN_SEQUENCES_KIND, TokenInfo
from lance_hpc.tasks.gpt import GPT
from lance_hpc.tasks.options import LanguageModelOptions


class TokenDecoder(Decoder):
    """Worker half: one fixed-size list of tokens per row, as int32."""

    def __init__(self, column: str, row_tokens: int) -> None:
        self.column, self.row_tokens = column, row_tokens
        self.columns = (column,)

    def fields(self) -> dict[str, FieldSpec]:
        return {"tokens": FieldSpec((self.row_tokens,), torch.int32)}

    def decode(self, table: pa.Table, out: Batch, rng: np.random.Generator) -> dict[int, str]:
        column = table.column(self.column).combine_chunks()
        tokens = column.flatten().to_numpy(zero_copy_only=False).reshape(len(column), self.row_tokens)
        out["tokens"].copy_(torch.from_numpy(tokens.astype(np.int32)))
        return {int(index): "null sequence" for index in np.flatnonzero(~column.is_valid().to_numpy(zero_copy_only=False))}


class LanguageModel(Task[LanguageModelOptions]):
    """Cross-entropy of each next token; reports loss, perplexity, bits per byte and tokens/s."""

    Options = LanguageModelOptions
    metrics = ("loss_sum", "tokens", "samples")
    tags = {
        "train/loss": "mean next-token loss (nats) since the previous log point, over all ranks",
        "train/perplexity": "exp(train/loss)",
        "train/bits_per_byte": "train/loss in bits per byte of the original text",
        "train/tokens_per_s": "tokens trained on per second, all ranks together",
        "val/loss": "next-token loss (nats) over the whole validation set",
        "val/perplexity": "exp(val/loss)",
        "val/bits_per_byte": "val/loss in bits per byte of the held-out text",
    }
    headline_metric = "bits_per_byte"

    def __init__(self, options: LanguageModelOptions, train: DatasetInfo, val: DatasetInfo | None = None) -> None:
        super().__init__(options, train, val)
        problems = []
        for info in filter(None, (train, val)):
            problems += column_problems(
                info,
                "tokens_column",
                options.tokens_column,
                "fixed-size lists of integer tokens",
                lambda kind: pa.types.is_fixed_size_list(kind) and pa.types.is_integer(kind.value_type),
            )
        if problems:
            raise TaskError("language_model", problems)
        self.row_tokens = train.schema.field(options.tokens_column).type.list_size
        if val is not None and val.schema.field(options.tokens_column).type.list_size != self.row_tokens:
            problems.append(
                f"task.options.tokens_column: {val.uri} has sequences of "
                f"{val.schema.field(options.tokens_column).type.list_size} tokens, {train.uri} of {self.row_tokens}\n"
                "      fix: ingest both splits with the same sequence_length"
            )
        tokens = {"train": _token_info(train), "val": _token_info(val)}
        vocab = options.vocab_size or (tokens["train"].vocab_size if tokens["train"] else None)
        if vocab is None:
            problems.append(
                f"task.options.vocab_size: {train.uri} does not record its vocabulary size\n"
                "      fix: set task.options.vocab_size"
            )
        if problems:
            raise TaskError("language_model", problems)
        assert vocab is not None  # a problem above otherwise
        self.vocab_size = int(vocab)
        self.sequence_length = self.row_tokens - 1
        if options.model == "gpt" and options.width % options.heads:
            raise UserError(
                f"task.options.width ({options.width}) is not a multiple of task.options.heads ({options.heads})\n"
                "  fix: e.g. width: 256 with heads: 4"
            )
        self.bytes_per_token = {split: found.bytes_per_token if found else None for split, found in tokens.items()}

    def decoder(self, train: bool) -> TokenDecoder:
        return TokenDecoder(self.options.tokens_column, self.row_tokens)

    def build_model(self) -> nn.Module:
        if is_import_path(self.options.model):
            factory = load_callable(self.options.model, "task.options.model")
            return factory(vocab_size=self.vocab_size, sequence_length=self.sequence_length)
        if self.options.model != "gpt":
            raise UserError(f"task.options.model: unknown model {self.options.model!r}\n  fix: use gpt or my_pkg.models:build")
        return GPT(
            self.vocab_size,
            self.sequence_length,
            layers=self.options.layers,
            width=self.options.width,
            heads=self.options.heads,
            dropout=self.options.dropout,
        )

    def blocks(self, model: nn.Module) -> list[nn.Module] | None:
        return list(model.blocks) if isinstance(model, GPT) else None

    def forward(self, model: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = batch["tokens"].long()
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        logits = model(inputs)
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
        count = torch.tensor(float(targets.numel()), device=tokens.device)
        rows = torch.tensor(float(tokens.shape[0]), device=tokens.device)
        return loss, torch.stack([loss.detach() * count, count, rows])

    def report(self, sums: dict[str, float], prefix: str, seconds: float | None = None) -> dict[str, float]:
        loss = sums["loss_sum"] / max(sums["tokens"], 1.0)
        values = {f"{prefix}/loss": loss, f"{prefix}/perplexity": math.exp(min(loss, 50.0))}
        bytes_per_token = self.bytes_per_token.get(prefix)
        if bytes_per_token:
            values[f"{prefix}/bits_per_byte"] = loss / math.log(2) / bytes_per_token
        if seconds:
            values[f"{prefix}/tokens_per_s"] = sums["tokens"] / seconds
        return values


def _token_info(info: DatasetInfo | None) -> TokenInfo | None:
    """What text ingest recorded about the tokens of ``info``; None for token datasets made elsewhere."""
    if info is None:
        return None
    metadata = info.schema.metadata
    if not metadata or metadata.get(KIND_KEY) != TOKEN_SEQUENCES_KIND:
        return None
    return TokenInfo.from_metadata(metadata, info.uri)
