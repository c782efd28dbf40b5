"""A small GPT-style decoder (Radford et al., 2019) for language-model demos: pre-norm blocks,
causal attention through PyTorch's fused kernel, and an output head tied to the token embedding."""

from __future__ import annotations

import math
from typing import Any, cast

import torch
from torch import nn
from torch.nn import functional as F


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention in which each position sees itself and the positions before it."""

    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.dropout = dropout
        self.qkv = nn.Linear(width, 3 * width)
        self.projection = nn.Linear(width, width)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        batch, length, width = hidden.shape
        # [B, T, 3, heads, head_width] -> three [B, heads, T, head_width]: the layout SDPA expects
        query, key, value = self.qkv(hidden).view(batch, length, 3, self.heads, width // self.heads).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(
            query, key, value, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        return self.projection(attended.transpose(1, 2).reshape(batch, length, width))


class Block(nn.Module):
    """Pre-norm transformer block: the residual stream is never normalised, which keeps deep stacks stable."""

    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(width)
        self.attention = CausalSelfAttention(width, heads, dropout)
        self.mlp_norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width), nn.Dropout(dropout))
        self.attention_dropout = nn.Dropout(dropout)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden + self.attention_dropout(self.attention(self.attention_norm(hidden)))
        return hidden + self.mlp(self.mlp_norm(hidden))


class GPT(nn.Module):
    """Token ids [B, T] in, next-token logits [B, T, vocab_size] out, for any T up to sequence_length."""

    def __init__(
        self,
        vocab_size: int,
        sequence_length: int,
        layers: int = 4,
        width: int = 256,
        heads: int = 4,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        if width % heads != 0:
            raise ValueError(f"width ({width}) must be divisible by heads ({heads}): each head gets width // heads")
        self.sequence_length = sequence_length
        self.token_embedding = nn.Embedding(vocab_size, width)
        self.position_embedding = nn.Embedding(sequence_length, width)
        self.dropout = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(width, heads, dropout) for _ in range(layers))
        self.final_norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab_size, bias=False)
        self.head.weight = self.token_embedding.weight  # tied: fewer parameters, and rare tokens learn from both ends
        self.apply(self._init_weights)
        for block in self.blocks:
            assert isinstance(block, Block)
            # every block adds two projections to the residual stream; scaling them keeps its variance
            # independent of depth at initialisation (GPT-2)
            for projection in (block.attention.projection, cast(nn.Linear, block.mlp[2])):
                nn.init.normal_(projection.weight, mean=0.0, std=0.02 / math.sqrt(2 * layers))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        if length > self.sequence_length:
            raise ValueError(
                f"sequences of {length} tokens are longer than the model's sequence_length ({self.sequence_length}): "
                "it has no position embedding beyond that"
            )
        positions = torch.arange(length, device=tokens.device)
        hidden = self.dropout(self.token_embedding(tokens) + self.position_embedding(positions))
        for block in self.blocks:
            hidden = block(hidden)
        return self.head(self.final_norm(hidden))


def gpt(vocab_size: int, sequence_length: int, **options: Any) -> nn.Module:
    """A freshly initialised :class:`GPT`; options are its keyword arguments (layers, width, heads, dropout)."""
    return GPT(vocab_size, sequence_length, **options)
