"""Disentangled attention (DeBERTa-v2/v3; config.disentangled_terms): position terms added to the softmax
scores of every layer, computed from the layer's own queries and keys.

  c2p(i, j) = q_i · K_r[c(i - j)]     content-to-position: the query with the position of its key
  p2c(i, j) = k_j · Q_r[p(j - i)]     position-to-content: the key with the position of the query

K_r and Q_r are one table of 2·span relative position embeddings, shared by every layer (`RelativeEmbeddings`,
after a LayerNorm when config.disentangled_norm), projected per layer by its own pos_key_proj / pos_query_proj
or, when config.disentangled_share_key, by its k / q projections (biases included). Both terms are scaled as the
content term q_i · k_j (config.scaling; DeBERTa: 1 / sqrt(head_dim · (1 + number of terms))).

The row of a pair is transformers' (modeling_deberta_v2.py, build_relative_position and the gathers of
DisentangledSelfAttention.disentangled_attention_bias): δ = the bucket of the relative position
(make_log_bucket_position with config.disentangled_buckets > 0: exact up to half the buckets, then log-spaced up
to disentangled_max_distance; without buckets the distance itself), c(r) = clamp(δ(r) + span, 0, 2·span - 1),
p(r) = clamp(-δ(r) + span, 0, 2·span - 1). As for MPNet's buckets (model/relative_positions.py), the rows are
computed by that formula in PyTorch once, float32 logarithms included, for every distance up to `reach` (past
which every row is the table's first or last: clamping the distance there is exact), and the graph looks a
pair's row up by its clamped distance, so it takes a symbolic sequence axis and never evaluates a logarithm.
"""

from __future__ import annotations

import torch
from torch import nn

from model.attention_paths import MAX_SEQUENCE
from model.config import EncoderConfig
from model.norms import make_norm


def log_bucket_positions(relative: torch.Tensor, buckets: int, max_distance: int) -> torch.Tensor:
    """transformers' make_log_bucket_position (int64 in, float out, as there): relative positions r with
    |r| <= buckets // 2 unchanged, larger ones sign(r)·(ceil(log(|r| / mid) / log((max_distance - 1) / mid)
    · (mid - 1)) + mid), mid = buckets // 2."""
    sign = torch.sign(relative)
    mid = buckets // 2
    inside = (relative < mid) & (relative > -mid)
    distance = torch.where(inside, relative.new_tensor(mid - 1), torch.abs(relative))
    scale = torch.log(relative.new_tensor((max_distance - 1) / mid, dtype=torch.float))
    log_position = torch.ceil(torch.log(distance / mid) / scale
                              * (mid - 1)) + mid
    return torch.where(distance <= mid, relative.type_as(log_position), log_position * sign)


def relative_rows(relative: torch.Tensor, config: EncoderConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(c(r), p(r)): the table rows (int64) of relative positions r = i - j for the c2p and p2c terms."""
    span = config.disentangled_span
    delta = relative
    if config.disentangled_buckets:
        delta = log_bucket_positions(relative, config.disentangled_buckets, config.disentangled_max_distance)
    delta = delta.to(torch.long)
    return torch.clamp(delta + span, 0, 2 * span - 1), torch.clamp(-delta + span, 0, 2 * span - 1)


def reach(config: EncoderConfig) -> int:
    """A distance from which on both rows are the table's ends (δ is monotone in r: δ(±r) beyond ±span), found
    by doubling; MAX_SEQUENCE at most (no admitted sequence has a pair farther apart)."""
    distance = config.disentangled_span
    while distance < MAX_SEQUENCE:
        # on the CPU explicitly: the answer is a number, also when the model is built on the meta device
        # (export/exporter.py check_memory counts a checkpoint's weights that way before reading them)
        c2p, p2c = relative_rows(torch.tensor([-distance, distance], device="cpu"), config)
        if c2p.tolist() == [0, 2 * config.disentangled_span - 1] and p2c.tolist() == c2p.flip(0).tolist():
            return distance
        distance *= 2
    return MAX_SEQUENCE


class RelativeEmbeddings(nn.Module):
    """The table every layer shares: `weight` (2·span, D) and its LayerNorm `norm` (disentangled_norm), and the
    rows c(r), p(r) of every relative position r at index r + reach (`c2p_rows`, `p2c_rows`)."""

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(2 * config.disentangled_span, config.d_model))
        self.norm = make_norm(config) if config.disentangled_norm else None
        self.reach = reach(config)
        # the rows of relative position r at index r + reach: fixed tables, never in a state dict
        c2p, p2c = relative_rows(torch.arange(-self.reach, self.reach + 1, device="cpu"), config)
        self.register_buffer("c2p_rows", c2p, persistent=False)
        self.register_buffer("p2c_rows", p2c, persistent=False)

    def forward(self, length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(the table, normalised; the c2p and p2c indices (T·T,) of each pair (i, j), row-major, into a layer's
        (T · 2·span) flattened products with the table: i·2·span + c(i - j) and j·2·span + p(j - i))."""
        table = self.norm(self.weight) if self.norm is not None else self.weight
        positions = torch.arange(length, device=self.weight.device)
        relative = positions[:, None] - positions[None, :]  # (T, T): i - j
        width = self.weight.shape[0]
        c2p = positions[:, None] * width + self.c2p_rows[torch.clamp(relative, -self.reach, self.reach) + self.reach]
        p2c = positions[None, :] * width + self.p2c_rows[torch.clamp(-relative, -self.reach, self.reach) + self.reach]
        return table, c2p.reshape(-1), p2c.reshape(-1)


class DisentangledAttention(nn.Module):
    """One layer's position terms: forward(...) is the (B, heads, T, T) sum of config.disentangled_terms, to add
    to the scaled scores. Owns the layer's pos_key_proj (c2p) / pos_query_proj (p2c) unless disentangled_share_key
    (then the layer's k_proj / q_proj project the table, passed in at call time)."""

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.n_heads, self.head_dim = config.n_heads, config.head_dim
        self.c2p, self.p2c = "c2p" in config.disentangled_terms, "p2c" in config.disentangled_terms
        inner = config.n_heads * config.head_dim
        share = config.disentangled_share_key
        self.pos_key_proj = nn.Linear(config.d_model, inner) if self.c2p and not share else None
        self.pos_query_proj = nn.Linear(config.d_model, inner) if self.p2c and not share else None

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(x.shape[0], self.n_heads, self.head_dim).transpose(0, 1)  # (heads, 2·span, head_dim)

    def forward(self, q: torch.Tensor, k: torch.Tensor, scale: float | torch.Tensor,
                positions: tuple[torch.Tensor, torch.Tensor, torch.Tensor], q_proj: nn.Module,
                k_proj: nn.Module) -> torch.Tensor:
        """q, k: (B, heads, T, head_dim), the layer's projections; positions: RelativeEmbeddings' output. Each term
        is one product with the table, (B, heads, T, 2·span), scaled there, and one Gather of its T·T entries by
        an index shared by the batch and the heads (no (B, heads, T, T) index, no transpose)."""
        table, c2p_index, p2c_index = positions
        b, h, t, _ = q.shape
        terms = []
        if self.c2p:  # q_i · K_r[c(i - j)]
            pos_key = self._heads((k_proj if self.pos_key_proj is None else self.pos_key_proj)(table))
            products = torch.matmul(q, pos_key.transpose(-1, -2)) * scale  # (B, heads, T, 2·span)
            terms.append(torch.index_select(products.reshape(b, h, -1), 2, c2p_index).reshape(b, h, t, t))
        if self.p2c:  # k_j · Q_r[p(j - i)]
            pos_query = self._heads((q_proj if self.pos_query_proj is None else self.pos_query_proj)(table))
            products = torch.matmul(k, pos_query.transpose(-1, -2)) * scale  # (B, heads, T, 2·span), per key
            terms.append(torch.index_select(products.reshape(b, h, -1), 2, p2c_index).reshape(b, h, t, t))
        return terms[0] if len(terms) == 1 else terms[0] + terms[1]
