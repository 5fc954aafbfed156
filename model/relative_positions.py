"""Relative position buckets as an additive per-head attention bias (MPNet; T5's bidirectional scheme).

The pair (query i, key j) falls in a bucket by its relative position r = j - i: half the buckets for
keys before the query (r < 0), half for the others; in each half the first quarter of all buckets are
exact distances (|r| = 0, 1, ...), the rest log-spaced up to `max_distance`, beyond which every distance
shares the half's last bucket. A learned table (buckets, heads) gives each head a bias per bucket,
added to the softmax scores of every layer after scaling (model/attention_math.py scaled_dot_product),
computed once per forward from T in the graph, so any length exports with a symbolic sequence axis.

The buckets are those of transformers' MPNetEncoder.relative_position_bucket, float32 logarithms
included: they are computed by that formula in PyTorch once, for every distance up to `max_distance`
(a constant table of 2·max_distance + 1 entries), and the graph looks a pair's bucket up by its clamped
distance, so ONNX Runtime never evaluates a logarithm that could round the other way at a bucket edge.
Clamping is exact: from `max_distance` on, the formula gives the half's last bucket.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from model.config import EncoderConfig


def relative_position_buckets(relative: torch.Tensor, num_buckets: int, max_distance: int) -> torch.Tensor:
    """The bucket (int64, same shape) of each relative position j - i, as transformers' MPNet computes it."""
    half = num_buckets // 2
    distance = -relative  # i - j, transformers' n
    bucket = (distance < 0).to(torch.long) * half
    distance = distance.abs()
    exact = half // 2
    # The log is only used where distance >= exact; clamping keeps log(0) out (the same buckets).
    scaled = torch.log(distance.clamp(min=exact).float() / exact) / math.log(max_distance / exact)
    large = torch.clamp(exact + (scaled * (half - exact)).to(torch.long), max=half - 1)
    return bucket + torch.where(distance < exact, distance, large)


class RelativePositionBias(nn.Module):
    """`weight` (buckets, heads): forward(T) is the (1, heads, T, T) bias of every (i, j) pair."""

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.max_distance = config.relative_attention_max_distance
        self.weight = nn.Parameter(torch.randn(config.relative_attention_buckets, config.n_heads))
        relative = torch.arange(-self.max_distance, self.max_distance + 1)
        # bucket of relative position r at index r + max_distance; a fixed table, never in a state dict
        self.register_buffer("buckets", relative_position_buckets(relative, config.relative_attention_buckets,
                                                                  self.max_distance), persistent=False)

    def forward(self, length: int) -> torch.Tensor:
        positions = torch.arange(length, device=self.weight.device)
        relative = positions[None, :] - positions[:, None]  # (T, T): j - i
        index = torch.clamp(relative, -self.max_distance, self.max_distance) + self.max_distance
        bias = F.embedding(self.buckets[index], self.weight)  # (T, T, heads)
        return bias.permute(2, 0, 1)[None]  # (1, heads, T, T)
