"""Multi-head self-attention: softmax dot-product (with its scalings), additive, linear (elu+1) and
performer (FAVOR+ random features).

The path is chosen once, in __init__ (model/attention_paths.py): "dense" takes the (B, T, T)
`allowed` matrix from `model.masks` and serves every mask kind; "sparse" (softmax) and "linear"
(linear, performer) take the per-row mask inputs and call the long-input ops of
`model.long_attention`, which the exporter turns into O(T·w) / O(T) graphs. A query row with no
allowed key returns zeros, never NaN (SEEDS.md).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from model import long_attention
from model.attention_math import kernel_attention, masked_softmax, scaled_dot_product  # noqa: F401 (re-exported)
from model.attention_paths import DENSE, LINEAR, SPARSE, long_path
from model.config import EncoderConfig
from model.disentangled_attention import DisentangledAttention
from model.mask_kinds import MaskKind
from model.norms import make_norm


class MaskInputs(NamedTuple):
    """The graph's mask inputs as the layers see them; `allowed` (B, T, T) on the dense path only."""

    attention_mask: torch.Tensor  # (B, T) int64, 1 = real token
    kind: torch.Tensor  # (B,) int64
    causal: torch.Tensor  # (B,) bool
    window: torch.Tensor  # (B,) int64
    step: torch.Tensor  # (B,) int64
    allowed: torch.Tensor | None = None
    allowed_local: torch.Tensor | None = None  # (B, T, T): `allowed` within the plan's local window
    # (1, heads, T, T) added to every layer's softmax scores after scaling: relative position buckets
    # (config.relative_attention_buckets; Encoder.relative_attention_bias), dense path only
    position_bias: torch.Tensor | None = None
    # disentangled attention (config.disentangled_terms): Encoder.relative_embeddings' (table (2·span, D), c2p
    # and p2c indices (T·T,)), from which each layer computes its position terms; dense path only
    disentangled: tuple | None = None


def rotate(x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Rotary positions on (B, heads, T, head_dim), rotate-half layout (transformers' convention):
    x·cos + rotate_half(x)·sin with rotate_half([x₁, x₂]) = [−x₂, x₁]."""
    cos, sin = rotary  # (T, head_dim) each
    half = x.shape[-1] // 2
    turned = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + turned * sin


def global_layer_kinds(kind: torch.Tensor, causal: torch.Tensor, step: torch.Tensor):
    """On the sparse path a global layer computes bidirectional and causal rows too: as dilated rows
    of step 1 (every key; causal flag for causal rows), i.e. dense attention in the strided part."""
    full = (kind == MaskKind.BIDIRECTIONAL) | (kind == MaskKind.CAUSAL)
    new_kind = torch.where(full, torch.full_like(kind, int(MaskKind.DILATED)), kind)
    new_causal = (kind == MaskKind.CAUSAL) | (causal.to(torch.bool) & ~full)  # no bool Where on ORT's CPU
    new_step = torch.where(full, torch.ones_like(step), step)
    return new_kind, new_causal, new_step


def performer_features(x: torch.Tensor, omega: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """FAVOR+ positive random features φ(x) = exp(ω·x − ‖x‖²/2)/√m (SEEDS.md), x scaled by d^(-1/4)
    so that φ(q)·φ(k) estimates exp(q·k/√d). A constant is subtracted from the exponent for range
    (it cancels in the normalised attention): per query its own largest feature; for keys (`valid`
    given) the largest over the row's real keys, and no padded key's feature exceeds 1.

    x: (B, heads, T, d); omega: (heads, d, m); valid: (B, T) for keys. Returns (B, heads, T, m)."""
    d, m = x.shape[-1], omega.shape[-1]
    x = x * d ** -0.25
    logits = torch.matmul(x, omega[None]) - (x * x).sum(dim=-1, keepdim=True) / 2  # (B, heads, T, m)
    if valid is None:
        shift = logits.amax(dim=-1, keepdim=True)
        return torch.exp(logits - shift) / math.sqrt(m)
    lowest = torch.finfo(logits.dtype).min
    real = valid[:, None, :, None] != 0
    shift = torch.where(real, logits, lowest).amax(dim=(-2, -1), keepdim=True)  # (B, heads, 1, 1)
    shift = torch.where(shift > lowest, shift, 0.0)  # a row with no real key: anything finite
    return torch.exp(torch.clamp(logits - shift, max=0.0)) / math.sqrt(m)


class MultiHeadAttention(nn.Module):
    def __init__(self, config: EncoderConfig, path: str = DENSE, window: int | None = None) -> None:
        super().__init__()
        self.config = config
        d, h = config.d_model, config.n_heads
        self.n_heads, self.head_dim, self.kv_heads = h, config.head_dim, config.kv_heads
        self.window = window  # a local layer of the attention plan: keys at |i - j| <= window only
        inner, kv_inner, qkv_bias = h * self.head_dim, self.kv_heads * self.head_dim, config.has_qkv_bias
        self.q_proj = nn.Linear(d, inner, bias=qkv_bias)
        self.k_proj = nn.Linear(d, kv_inner, bias=qkv_bias)
        self.v_proj = nn.Linear(d, kv_inner, bias=qkv_bias)
        self.out_proj = nn.Linear(inner, d, bias=config.linear_bias)
        # Qwen3 / Gemma3: each head's q and k normalised over head_dim (one weight shared by the heads)
        self.q_norm = make_norm(config, self.head_dim) if config.qk_norm else None
        self.k_norm = make_norm(config, self.head_dim) if config.qk_norm else None
        # The paths are chosen once, here, not per call.
        self.kind = config.attention
        if path not in (DENSE, long_path(config)):
            raise ValueError(f"attention={config.attention!r} has no {path!r} path (it has dense"
                             f"{', ' + long_path(config) if long_path(config) else ''})")
        self.path = path
        # DeBERTa: position terms on the scores (the long paths do not add them: long_path is None)
        self.disentangled = DisentangledAttention(config) if config.disentangled_terms else None
        if self.kind == "additive":
            # a(q, k) = w_vᵀ · tanh(W_q·q + W_k·k): q and k are already the projections.
            self.additive_v = nn.Parameter(torch.randn(h, self.head_dim) / math.sqrt(self.head_dim))
        if self.kind == "performer":
            # ω ~ N(0, I) drawn once from the config's seed: a fixed table, never in a state dict,
            # stored in the exported graph as a constant.
            generator = torch.Generator().manual_seed(config.seed + 0x5EED)
            omega = torch.randn(h, self.head_dim, config.performer_features, generator=generator)
            self.register_buffer("omega", omega, persistent=False)

    def _split(self, x: torch.Tensor, heads: int | None = None) -> torch.Tensor:
        b, t, _ = x.shape
        return x.view(b, t, heads or self.n_heads, self.head_dim).transpose(1, 2)  # (B, heads, T, head_dim)

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

    def _features(self, q: torch.Tensor, k: torch.Tensor, attention_mask: torch.Tensor):
        """φ(Q), φ(K) of the kernel attentions: elu + 1 (linear) or random features (performer)."""
        if self.kind == "linear":
            return F.elu(q) + 1, F.elu(k) + 1
        return performer_features(q, self.omega), performer_features(k, self.omega, attention_mask)

    def forward(self, x: torch.Tensor, masks: MaskInputs, rotary: tuple | None = None) -> torch.Tensor:
        b, t, d = x.shape
        q = self._split(self.q_proj(x))
        k = self._split(self.k_proj(x), self.kv_heads)
        v = self._split(self.v_proj(x), self.kv_heads)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if rotary is not None:
            q, k = rotate(q, rotary), rotate(k, rotary)
        if self.kv_heads != self.n_heads:  # grouped-query attention: query head i reads key/value head i // group
            group = self.n_heads // self.kv_heads
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        if self.path == SPARSE:
            q, k, scale = self._scale(q, k, masks.attention_mask)
            if isinstance(scale, torch.Tensor):  # per row: fold it into q, the op takes a constant
                q, scale = q * scale, 1.0
            kind, causal, step = masks.kind, masks.causal, masks.step
            if self.window is None:
                kind, causal, step = global_layer_kinds(kind, causal, step)
            y = long_attention.sparse_softmax_attention(
                q, k, v, masks.attention_mask, kind, causal, masks.window, step, float(scale),
                -1 if self.window is None else self.window)
        elif self.path == LINEAR:
            fq, fk = self._features(q, k, masks.attention_mask)
            y = long_attention.linear_attention(fq, fk, v, masks.attention_mask, masks.kind)
        else:
            allowed = masks.allowed if self.window is None else masks.allowed_local
            keep = allowed[:, None]  # (B, 1, T, T), broadcast over heads
            if self.kind == "softmax":
                q, k, scale = self._scale(q, k, masks.attention_mask)
                bias = masks.position_bias
                if self.disentangled is not None:
                    bias = self.disentangled(q, k, scale, masks.disentangled, self.q_proj, self.k_proj)
                y = scaled_dot_product(q, k, v, keep, scale, bias)
            elif self.kind == "additive":
                feats = torch.tanh(q[:, :, :, None, :] + k[:, :, None, :, :])  # (B, heads, T, T, head_dim)
                scores = torch.einsum("bhijd,hd->bhij", feats, self.additive_v)
                y = torch.matmul(masked_softmax(scores, keep), v)
            else:  # linear, performer: the masked (quadratic) form serves every mask kind
                fq, fk = self._features(q, k, masks.attention_mask)
                y = kernel_attention(fq, fk, v, keep)
        y = y.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim)  # (B, T, heads·head_dim)
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
