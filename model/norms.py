"""The stack's normalisations (config.norm), in one place: every norm of the encoder, its q/k norms and its
head's comes from `make_norm`.

  layer      LayerNorm: (x − mean) / sqrt(var + eps) · w + b (BERT, ModernBERT; bias per config.norm_bias)
  rms        RMSNorm: x / sqrt(mean(x²) + eps) · w (Qwen2/3, Llama; transformers' Qwen3RMSNorm)
  rms_gemma  Gemma's RMSNorm: x / sqrt(mean(x²) + eps) · (1 + w), its weight stored as the offset from 1
             (transformers' Gemma3RMSNorm)
"""

from __future__ import annotations

import torch
from torch import nn

from model.config import EncoderConfig


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, offset: float = 0.0) -> None:
        super().__init__()
        self.eps, self.offset = eps, offset
        # ones for w·x (Qwen), zeros for (1 + w)·x (Gemma): both start as the identity scale
        self.weight = nn.Parameter(torch.full((size,), 1.0 - offset))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed * (self.weight + self.offset) if self.offset else self.weight * normed


def make_norm(config: EncoderConfig, size: int | None = None) -> nn.Module:
    """The config's norm over the last `size` features (default d_model)."""
    size = size or config.d_model
    if config.norm == "layer":
        return nn.LayerNorm(size, eps=config.layer_norm_eps, bias=config.norm_bias)
    return RMSNorm(size, config.layer_norm_eps, offset=1.0 if config.norm == "rms_gemma" else 0.0)
