"""Analytic FLOP count of one encoder forward (multiply-add = 2 FLOPs).

Counted: the Q, K, V and output projections, attention scores QKᵀ and the weighted sum PV, the
two FFN matmuls. Not counted (a few % at these shapes): softmax, LayerNorm, biases, activation,
embeddings, mask building, pooling.
"""

from __future__ import annotations

from model.config import EncoderConfig


def encoder_flops(config: EncoderConfig, batch: int, length: int) -> int:
    d, ff, tokens = config.d_model, config.d_ff, batch * length
    projections = 4 * 2 * tokens * d * d  # Q, K, V, out: (B·T, D) x (D, D)
    attention = 2 * 2 * batch * length * length * d  # QKᵀ and PV over all heads: (T, hd) x (hd, T) x heads
    ffn = 2 * 2 * tokens * d * ff  # up (D -> d_ff) and down (d_ff -> D)
    return config.n_layers * (projections + attention + ffn)
