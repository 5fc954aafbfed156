"""Pooling over valid tokens, with optional L2 normalisation (torch reference).

Padded positions (attention_mask = 0) never contribute; a row with no valid token pools to zeros.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def mean_pool(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Mean of hidden (B, T, D) over positions where attention_mask (B, T) is nonzero -> (B, D)."""
    weights = (attention_mask != 0).to(hidden.dtype)[:, :, None]  # (B, T, 1)
    total = (hidden * weights).sum(dim=1)
    count = weights.sum(dim=1).clamp(min=1.0)
    return total / count


def first_token(hidden: torch.Tensor) -> torch.Tensor:
    """The first position's hidden state (B, D), as BERT's [CLS] pooling."""
    return hidden[:, 0]


def last_token(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The last real token's hidden state (B, D): the highest position whose attention_mask is nonzero, so
    right- and left-padded rows alike (a row with no valid token reads position 0)."""
    positions = torch.arange(hidden.shape[1], device=hidden.device)[None]  # (1, T)
    last = (positions * (attention_mask != 0).to(positions.dtype)).amax(dim=1)  # (B,)
    index = last[:, None, None].expand(-1, 1, hidden.shape[2])  # (B, 1, D)
    return torch.gather(hidden, 1, index)[:, 0]  # (B, D)


def l2_normalize(vectors: torch.Tensor) -> torch.Tensor:
    return F.normalize(vectors, p=2.0, dim=-1)
