"""The reference encoder stack: embeddings, encoder layers, pooling (SEEDS.md, "Encoder layer").

Read top to bottom: Embeddings -> EncoderLayer x N -> (final norm for pre-norm) -> outputs.
`Encoder.forward` takes exactly the exported graph's inputs, in graph order (`model.signature`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from model.attention import MultiHeadAttention
from model.config import EncoderConfig
from model.masks import build_allowed
from model.pooling import mean_pool

def sinusoidal_table(length: int, d_model: int) -> torch.Tensor:
    """PE[t, 2k] = sin(t / 10000^(2k/D)), PE[t, 2k+1] = cos(t / 10000^(2k/D)); shape (T, D)."""
    position = torch.arange(length, dtype=torch.float64)[:, None]
    inv_freq = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float64) * (-math.log(10000.0) / d_model))
    table = torch.zeros(length, d_model, dtype=torch.float64)
    table[:, 0::2] = torch.sin(position * inv_freq)
    table[:, 1::2] = torch.cos(position * inv_freq[: d_model // 2])
    return table.to(torch.float32)


class Embeddings(nn.Module):
    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.config = config
        d = config.d_model
        self.tokens = nn.Embedding(config.vocab_size, d) if config.input_kind == "tokens" else None
        self.token_types = nn.Embedding(config.type_vocab_size, d) if config.type_vocab_size else None
        self.positions = nn.Embedding(config.max_positions, d) if config.positional == "learned" else None
        if config.positional == "sinusoidal":
            # Fixed table: a non-persistent buffer, so it never enters a state dict.
            self.register_buffer("sinusoidal", sinusoidal_table(config.max_positions, d), persistent=False)
        self.norm = nn.LayerNorm(d, eps=config.layer_norm_eps) if config.embedding_layer_norm else None

    def forward(self, x: torch.Tensor, token_type_ids: torch.Tensor | None) -> torch.Tensor:
        h = self.tokens(x) if self.tokens is not None else x  # (B, T, D)
        length = h.shape[1]
        if self.positions is not None:
            h = h + self.positions.weight[:length][None]
        elif self.config.positional == "sinusoidal":
            h = h + self.sinusoidal[:length][None]
        if self.token_types is not None:
            h = h + self.token_types(token_type_ids)
        if self.norm is not None:
            h = self.norm(h)
        return h


class FeedForward(nn.Module):
    """FFN(x) = act(x·W1 + b1)·W2 + b2."""

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.up = nn.Linear(config.d_model, config.d_ff)
        self.down = nn.Linear(config.d_ff, config.d_model)
        self.activation = F.relu if config.activation == "relu" else F.gelu  # exact (erf) GELU, as BERT

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.activation(self.up(x)))


class EncoderLayer(nn.Module):
    """post-norm: x = LN(x + MHA(x)); x = LN(x + FFN(x)).  pre-norm: x = x + MHA(LN(x)); ..."""

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.pre_norm = config.norm_placement == "pre"
        self.attention = MultiHeadAttention(config)
        self.attention_norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
        self.ffn = FeedForward(config)
        self.ffn_norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
        # Dropout after attention and FFN is inactive at inference; the reference omits it.

    def forward(self, x: torch.Tensor, allowed: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        if self.pre_norm:
            x = x + self.attention(self.attention_norm(x), allowed, attention_mask)
            return x + self.ffn(self.ffn_norm(x))
        x = self.attention_norm(x + self.attention(x, allowed, attention_mask))
        return self.ffn_norm(x + self.ffn(x))


class Encoder(nn.Module):
    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.config = config
        self.embeddings = Embeddings(config)
        self.layers = nn.ModuleList(EncoderLayer(config) for _ in range(config.n_layers))
        self.final_norm = (
            nn.LayerNorm(config.d_model, eps=config.layer_norm_eps) if config.norm_placement == "pre" else None
        )

    def forward(
        self,
        inputs: torch.Tensor,  # (B, T) int64 token ids, or (B, T, D) float features
        attention_mask: torch.Tensor,  # (B, T) int64, 1 = real token
        mask_kind: torch.Tensor,  # (B,) int64
        mask_causal: torch.Tensor,  # (B,) bool
        mask_window: torch.Tensor,  # (B,) int64
        mask_step: torch.Tensor,  # (B,) int64
        custom_mask: torch.Tensor,  # (B, T, T) bool
        token_type_ids: torch.Tensor | None = None,  # (B, T) int64, BERT-family only
    ) -> tuple[torch.Tensor, torch.Tensor]:
        allowed = build_allowed(attention_mask, mask_kind, mask_causal, mask_window, mask_step, custom_mask)
        h = self.embeddings(inputs, token_type_ids)  # (B, T, D)
        for layer in self.layers:
            h = layer(h, allowed, attention_mask)
        if self.final_norm is not None:
            h = self.final_norm(h)
        return h, mean_pool(h, attention_mask)


def build_encoder(config: EncoderConfig) -> Encoder:
    """A seeded, eval-mode encoder: the same config always gives the same weights."""
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(config.seed)
    try:
        model = Encoder(config)
    finally:
        torch.random.set_rng_state(generator_state)
    return model.eval()
