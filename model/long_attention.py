"""The long-input attention paths as torch custom ops (model/attention_paths.py says what each does).

Each op is one node for torch.export: its eager implementation here is the *dense* masked reference
(it builds the rows' [B, T, T] allowed matrix, so it is exact and easy to read, but quadratic); the
exporter translates the node into the O(T·w) / O(T) ONNX subgraph (export/long_graphs.py). The export
then validates that graph against the dense PyTorch encoder, so the two are proven equal, not
assumed. Inputs are the per-row mask inputs of the graph, never a [B, T, T] tensor.
"""

from __future__ import annotations

import torch

from model.attention_math import kernel_attention, scaled_dot_product
from model.masks import build_allowed, within_window


def _allowed(attention_mask, mask_kind, mask_causal, mask_window, mask_step) -> torch.Tensor:
    batch, length = attention_mask.shape
    custom = torch.ones(batch, length, length, dtype=torch.bool, device=attention_mask.device)
    return build_allowed(attention_mask, mask_kind, mask_causal, mask_window, mask_step, custom)[:, None]


@torch.library.custom_op("encoder::sparse_softmax_attention", mutates_args=())
def sparse_softmax_attention(
    q: torch.Tensor,  # (B, heads, T, head_dim), already scaled per row where the scaling is per row
    k: torch.Tensor,  # (B, heads, T, head_dim)
    v: torch.Tensor,  # (B, heads, T, head_dim)
    attention_mask: torch.Tensor,  # (B, T) int64
    mask_kind: torch.Tensor,  # (B,) int64: sliding_window, dilated or local_strided
    mask_causal: torch.Tensor,  # (B,) bool
    mask_window: torch.Tensor,  # (B,) int64
    mask_step: torch.Tensor,  # (B,) int64: one step for every strided row of the batch
    scale: float,
    limit: int = -1,  # a local layer of the attention plan: keys at |i - j| <= limit only (-1: none)
) -> torch.Tensor:
    """softmax(Q·Kᵀ·scale)·V over each row's allowed keys (within `limit` on a local layer); zeros for
    a query with none. Rows of every kind are computed (bidirectional and causal ones too)."""
    allowed = _allowed(attention_mask, mask_kind, mask_causal, mask_window, mask_step)
    if limit >= 0:
        allowed = allowed & within_window(q.shape[2], limit, q.device)
    return scaled_dot_product(q, k, v, allowed, scale)


@sparse_softmax_attention.register_fake
def _(q, k, v, attention_mask, mask_kind, mask_causal, mask_window, mask_step, scale, limit=-1):
    return torch.empty_like(v)


@torch.library.custom_op("encoder::linear_attention", mutates_args=())
def linear_attention(
    fq: torch.Tensor,  # (B, heads, T, F): φ(Q), all >= 0
    fk: torch.Tensor,  # (B, heads, T, F): φ(K), all >= 0
    v: torch.Tensor,  # (B, heads, T, head_dim)
    attention_mask: torch.Tensor,  # (B, T) int64
    mask_kind: torch.Tensor,  # (B,) int64: bidirectional or causal
) -> torch.Tensor:
    """φ(Q)·Σ φ(K)ᵀV / φ(Q)·Σ φ(K) over each row's allowed keys; zeros for a query with none."""
    batch = mask_kind.shape[0]
    flags = torch.zeros(batch, dtype=torch.bool, device=mask_kind.device)
    ones = torch.ones(batch, dtype=torch.int64, device=mask_kind.device)
    allowed = _allowed(attention_mask, mask_kind, flags, ones, ones)
    return kernel_attention(fq, fk, v, allowed)


@linear_attention.register_fake
def _(fq, fk, v, attention_mask, mask_kind):
    return torch.empty_like(v)

