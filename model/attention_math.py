"""The masked attention arithmetic both attention modules share (torch): `model.attention` (the layers)
and `model.long_attention` (the long-input ops, whose eager form is this dense reference) import it,
and it imports neither, so the two never import each other.
"""

from __future__ import annotations

import torch


def masked_softmax(scores: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """softmax over the key axis where allowed; exactly 0 elsewhere and on rows with no key."""
    lowest = torch.finfo(scores.dtype).min
    probs = torch.softmax(torch.where(allowed, scores, lowest), dim=-1)
    return torch.where(allowed, probs, 0.0)


def scaled_dot_product(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float | torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """softmax(Q·Kᵀ · scale + bias)·V under `allowed`; shapes (..., T, d), allowed and the additive `bias`
    (relative positions: (1, heads, T, T)) broadcast to (..., T, T)."""
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale
    if bias is not None:
        scores = scores + bias
    return torch.matmul(masked_softmax(scores, allowed), v)


def kernel_attention(fq: torch.Tensor, fk: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """The masked quadratic form of kernel (linear, performer) attention: (W·V) / W·1 with
    W = φ(Q)·φ(K)ᵀ where allowed, 0 elsewhere; zeros for a query with no allowed key."""
    weights = torch.where(allowed, torch.matmul(fq, fk.transpose(-2, -1)), 0.0)  # (B, heads, T, T), >= 0
    norm = weights.sum(dim=-1, keepdim=True)
    return torch.matmul(weights, v) / torch.where(norm > 0, norm, 1.0)
