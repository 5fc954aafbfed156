"""Multi-head self-attention: softmax dot-product (with its scalings), additive, linear (elu+1).

All three take the same (B, T, T) `allowed` matrix from `model.masks`. A query row with no
allowed key returns zeros, never NaN (SEEDS.md).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from model.config import EncoderConfig


def masked_softmax(scores: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """softmax over the key axis where allowed; exactly 0 elsewhere and on rows with no key."""
    lowest = torch.finfo(scores.dtype).min
    probs = torch.softmax(torch.where(allowed, scores, lowest), dim=-1)
    return torch.where(allowed, probs, 0.0)


def scaled_dot_product(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float | torch.Tensor
) -> torch.Tensor:
    """softmax(Q·Kᵀ · scale)·V under `allowed`; shapes (..., T, d) and allowed (..., T, T)."""
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale
    return torch.matmul(masked_softmax(scores, allowed), v)


class MultiHeadAttention(nn.Module):
    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.config = config
        d, h = config.d_model, config.n_heads
        self.n_heads, self.head_dim = h, config.head_dim
        self.q_proj = nn.Linear(d, d)
        self.k_proj = nn.Linear(d, d)
        self.v_proj = nn.Linear(d, d)
        self.out_proj = nn.Linear(d, d)
        # The path is chosen once, here, not per call.
        self.kind = config.attention
        if self.kind == "additive":
            # a(q, k) = w_vᵀ · tanh(W_q·q + W_k·k): q and k are already the projections.
            self.additive_v = nn.Parameter(torch.randn(h, self.head_dim) / math.sqrt(self.head_dim))

    def _split(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        return x.view(b, t, self.n_heads, self.head_dim).transpose(1, 2)  # (B, heads, T, head_dim)

    def _scale(self, q: torch.Tensor, k: torch.Tensor, attention_mask: torch.Tensor):
        cfg = self.config
        if cfg.scaling == "sqrt_dk":
            return q, k, 1.0 / math.sqrt(self.head_dim)
        if cfg.scaling == "temperature":
            return q, k, 1.0 / cfg.temperature
        if cfg.scaling == "cosine":
            return F.normalize(q, dim=-1), F.normalize(k, dim=-1), 1.0 / cfg.temperature
        # "length": 1/sqrt(d_k·T) with T the row's real (unpadded) length at run time, so that a
        # sequence scores the same alone or inside a padded batch.
        real = attention_mask.sum(dim=1).clamp(min=1).to(q.dtype)  # (B,)
        return q, k, torch.rsqrt(real * self.head_dim)[:, None, None, None]

    def forward(
        self, x: torch.Tensor, allowed: torch.Tensor, attention_mask: torch.Tensor
    ) -> torch.Tensor:
        b, t, d = x.shape
        q = self._split(self.q_proj(x))
        k = self._split(self.k_proj(x))
        v = self._split(self.v_proj(x))
        keep = allowed[:, None]  # (B, 1, T, T), broadcast over heads
        if self.kind == "softmax":
            q, k, scale = self._scale(q, k, attention_mask)
            y = scaled_dot_product(q, k, v, keep, scale)
        elif self.kind == "additive":
            feats = torch.tanh(q[:, :, :, None, :] + k[:, :, None, :, :])  # (B, heads, T, T, head_dim)
            scores = torch.einsum("bhijd,hd->bhij", feats, self.additive_v)
            y = torch.matmul(masked_softmax(scores, keep), v)
        else:  # linear: φ(x) = elu(x) + 1; the masked (quadratic) form serves every mask kind
            weights = torch.matmul(F.elu(q) + 1, (F.elu(k) + 1).transpose(-2, -1))
            weights = torch.where(keep, weights, 0.0)  # (B, heads, T, T), all >= 0
            norm = weights.sum(dim=-1, keepdim=True)
            y = torch.matmul(weights, v) / torch.where(norm > 0, norm, 1.0)
        y = y.transpose(1, 2).reshape(b, t, d)  # (B, T, D)
        return self.out_proj(y)


def linear_attention_prefix(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """The O(T) form of linear attention: φ(Q)·(φ(K)ᵀ·V) / φ(Q)·Σφ(K), causal with running sums.

    Unmasked only; used by tests to prove the masked quadratic form above computes the same thing.
    """
    fq, fk = F.elu(q) + 1, F.elu(k) + 1
    if not causal:
        kv = torch.matmul(fk.transpose(-2, -1), v)  # (..., d, d_v)
        z = fk.sum(dim=-2)  # (..., d)
        return torch.matmul(fq, kv) / (fq * z[..., None, :]).sum(-1, keepdim=True)
    kv = torch.cumsum(fk[..., :, :, None] * v[..., :, None, :], dim=-3)  # (..., T, d, d_v)
    z = torch.cumsum(fk, dim=-2)  # (..., T, d)
    num = torch.einsum("...td,...tde->...te", fq, kv)
    return num / (fq * z).sum(-1, keepdim=True)
