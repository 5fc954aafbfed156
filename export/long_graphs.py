"""ONNX subgraphs for the long-input attention ops of model/long_attention.py (torch.onnx's
custom_translation_table), built from ordinary ONNX ops with onnxscript.

No tensor here has two sequence-sized axes (a test checks the saved graphs' inferred shapes):

sparse_softmax_attention, per row of a batch (model/attention_paths.py):
  band     K = clamp(max window of the run's band rows, MIN_BLOCK, T); T padded to NB·K; queries in
           blocks (B, H, NB, K, d), keys and values as each block's previous, own and next block
           (B, H, NB, 3K, d); scores (B, H, NB, K, 3K), allowed where |i − j| <= the row's window.
           Query i = nb·K + a meets key j = (nb − 1)·K + c at distance i − j = K + a − c, the same for
           every block, so the band rule is one (K, 3K) table per row.
  strided  S = the run's step (T when no row is strided); T padded to M·S; the S interleaved
           sub-sequences (B, H, S, M, d) attend within themselves: scores (B, H, S, M, M), allowed
           where the row is strided and |i − j| > its band window (no key counted twice).
  merge    the two partial softmaxes are combined exactly: m = max(m₁, m₂),
           out = (e^(m₁−m)·o₁ + e^(m₂−m)·o₂) / (e^(m₁−m)·l₁ + e^(m₂−m)·l₂); a query with no allowed
           key (l = 0) gives zeros.
linear_attention:
  bidirectional rows  φ(Q)·(φ(K)ᵀV) / φ(Q)·Σφ(K), padded keys zeroed;
  causal rows         chunks of CHUNK queries: inside a chunk the masked quadratic form, across chunks
                      exclusive prefix sums (CumSum) of each chunk's φ(K)ᵀV and Σφ(K).
"""

from __future__ import annotations

import numpy as np
from onnxscript import ir
from onnxscript import opset18 as op

from model.attention_paths import CHUNK, MIN_BLOCK
from model.mask_kinds import MaskKind

LOWEST = float(np.finfo(np.float32).min)
# A query's largest score is clamped up to this, so that a query with no allowed key (largest score
# LOWEST) gets exp(LOWEST - FLOOR) = 0 for every key instead of exp(0) = 1.
FLOOR = -1e30


def _i64(*values: int):
    return op.Constant(value=ir.tensor(np.array(values, np.int64)))


def _f32(value: float):
    return op.Constant(value=ir.tensor(np.array(value, np.float32)))


def _pad_seq(x, amount, axis: int, before=None):
    """x padded with zeros on `axis`: `before` (default 0) in front, `amount` behind (1-element int64)."""
    start = before if before is not None else _i64(0)
    return op.Pad(x, op.Concat(start, amount, axis=0), None, _i64(axis))


def _ceil_div(a, b):
    return op.Div(op.Sub(op.Add(a, b), _i64(1)), b)


def _row(x, rank: int):
    """A (B,) tensor reshaped to (B, 1, ..., 1) of `rank` dims, to broadcast against per-row tables."""
    return op.Reshape(x, _i64(-1, *([1] * (rank - 1))))


def _partial_softmax(scores, allowed, values):
    """Softmax pieces of one part over its allowed keys: (max, sum of exponentials, weighted values).

    `allowed` (no heads axis) becomes an additive bias of 0 / LOWEST once, shared by the heads; a
    disallowed key's exponential is then exp(LOWEST - max) = 0 exactly."""
    bias = op.Where(allowed, _f32(0.0), _f32(LOWEST))
    masked = op.Add(scores, bias)
    top = op.Max(op.ReduceMax(masked, _i64(-1), keepdims=1), _f32(FLOOR))
    weights = op.Exp(op.Sub(masked, top))
    return top, op.ReduceSum(weights, _i64(-1), keepdims=1), op.MatMul(weights, values)


def sparse_softmax_attention(q, k, v, attention_mask, mask_kind, mask_causal, mask_window, mask_step,
                             scale: float, limit: int = -1):
    if limit >= 0:
        return _local_layer_attention(q, k, v, attention_mask, mask_kind, mask_causal, mask_window, mask_step,
                                      scale, limit)
    lead = op.Shape(q, start=0, end=2)  # [B, H]
    length = op.Shape(q, start=2, end=3)  # [T]
    q = op.Mul(q, _f32(scale))  # scaled once, on the (T, d) side rather than on the scores
    band_rows = op.Or(op.Equal(mask_kind, _i64(int(MaskKind.SLIDING_WINDOW))),
                      op.Equal(mask_kind, _i64(int(MaskKind.LOCAL_STRIDED))))
    strided_rows = op.Or(op.Equal(mask_kind, _i64(int(MaskKind.DILATED))),
                         op.Equal(mask_kind, _i64(int(MaskKind.LOCAL_STRIDED))))
    band_window = op.Where(band_rows, mask_window, _i64(-1))  # (B,): -1 = no band keys
    causal = op.Cast(mask_causal, to=ir.DataType.BOOL)
    valid = op.Cast(attention_mask, to=ir.DataType.INT64)  # (B, T) 0/1

    # ---- band: blocks of K queries against their previous, own and next block of keys
    block = op.Min(op.Max(op.ReduceMax(band_window, keepdims=1), _i64(MIN_BLOCK)), op.Max(length, _i64(1)))
    blocks = _ceil_div(length, block)  # NB
    padded = op.Mul(blocks, block)
    tail = op.Sub(padded, length)
    qb = op.Reshape(_pad_seq(q, tail, 2), op.Concat(lead, blocks, block, _i64(-1), axis=0))  # (B, H, NB, K, d)

    def windows(x, axis: int, shape):
        """x (..., T, ...) -> each block's previous, own and next block, concatenated on the block axis + 1."""
        framed = op.Reshape(_pad_seq(x, op.Add(tail, block), axis, before=block), shape)  # NB + 2 blocks
        parts = [op.Slice(framed, _i64(s), op.Add(blocks, _i64(s)), _i64(axis)) for s in (0, 1, 2)]
        return op.Concat(*parts, axis=axis + 1)

    kv_shape = op.Concat(lead, op.Add(blocks, _i64(2)), block, _i64(-1), axis=0)
    kb = windows(k, 2, kv_shape)  # (B, H, NB, 3K, d)
    vb = windows(v, 2, kv_shape)
    key_ok = windows(valid, 1, op.Concat(op.Shape(q, start=0, end=1), op.Add(blocks, _i64(2)), block, axis=0))
    key_ok = op.Unsqueeze(op.Cast(key_ok, to=ir.DataType.BOOL), _i64(1, 3))  # (B, 1, NB, 1, 3K)
    a = op.Range(_i64(0), op.Squeeze(block), _i64(1))
    c = op.Range(_i64(0), op.Squeeze(op.Mul(block, _i64(3))), _i64(1))
    distance = op.Sub(op.Add(op.Unsqueeze(a, _i64(1)), block), op.Unsqueeze(c, _i64(0)))  # (K, 3K): i - j
    in_band = op.LessOrEqual(op.Abs(distance), _row(band_window, 5))  # (B, 1, 1, K, 3K)
    forward_ok = op.Or(op.Not(_row(causal, 5)), op.GreaterOrEqual(distance, _i64(0)))
    allowed = op.And(op.And(in_band, forward_ok), key_ok)  # (B, 1, NB, K, 3K)
    scores = op.MatMul(qb, op.Transpose(kb, perm=[0, 1, 2, 4, 3]))  # (B, H, NB, K, 3K)
    top1, sum1, out1 = _partial_softmax(scores, allowed, vb)

    def band_to_sequence(x):  # (B, H, NB, K, n) -> (B, H, T, n)
        flat = op.Reshape(x, op.Concat(lead, padded, _i64(-1), axis=0))
        return op.Slice(flat, _i64(0), length, _i64(2))

    top1, sum1, out1 = band_to_sequence(top1), band_to_sequence(sum1), band_to_sequence(out1)

    # ---- strided: the S interleaved sub-sequences attend within themselves
    step = op.ReduceMax(op.Where(strided_rows, mask_step, _i64(0)), keepdims=1)
    step = op.Min(op.Where(op.Greater(step, _i64(0)), step, length), op.Max(length, _i64(1)))  # S
    groups = _ceil_div(length, step)  # M
    span = op.Mul(groups, step)
    extra = op.Sub(span, length)

    def interleave(x):  # (B, H, T, d) -> (B, H, S, M, d): sub-sequence r holds r, r + S, r + 2S, ...
        grid = op.Reshape(_pad_seq(x, extra, 2), op.Concat(lead, groups, step, _i64(-1), axis=0))
        return op.Transpose(grid, perm=[0, 1, 3, 2, 4])

    qs, ks, vs = interleave(q), interleave(k), interleave(v)
    key_ok = op.Reshape(_pad_seq(valid, extra, 1), op.Concat(op.Shape(q, start=0, end=1), groups, step, axis=0))
    key_ok = op.Unsqueeze(op.Cast(op.Transpose(key_ok, perm=[0, 2, 1]), to=ir.DataType.BOOL), _i64(1, 3))  # (B,1,S,1,M)
    g = op.Range(_i64(0), op.Squeeze(groups), _i64(1))
    distance = op.Mul(op.Sub(op.Unsqueeze(g, _i64(1)), op.Unsqueeze(g, _i64(0))), step)  # (M, M): i - j
    beyond_band = op.Greater(op.Abs(distance), _row(band_window, 5))
    forward_ok = op.Or(op.Not(_row(causal, 5)), op.GreaterOrEqual(distance, _i64(0)))
    allowed = op.And(op.And(op.And(_row(strided_rows, 5), beyond_band), forward_ok), key_ok)  # (B, 1, S, M, M)
    scores = op.MatMul(qs, op.Transpose(ks, perm=[0, 1, 2, 4, 3]))  # (B, H, S, M, M)
    top2, sum2, out2 = _partial_softmax(scores, allowed, vs)

    def strided_to_sequence(x):  # (B, H, S, M, n) -> (B, H, T, n)
        flat = op.Reshape(op.Transpose(x, perm=[0, 1, 3, 2, 4]), op.Concat(lead, span, _i64(-1), axis=0))
        return op.Slice(flat, _i64(0), length, _i64(2))

    top2, sum2, out2 = strided_to_sequence(top2), strided_to_sequence(sum2), strided_to_sequence(out2)

    # ---- one softmax over the union
    top = op.Max(top1, top2)
    w1, w2 = op.Exp(op.Sub(top1, top)), op.Exp(op.Sub(top2, top))
    total = op.Add(op.Mul(w1, sum1), op.Mul(w2, sum2))  # (B, H, T, 1)
    numerator = op.Add(op.Mul(w1, out1), op.Mul(w2, out2))
    return op.Div(numerator, op.Where(op.Greater(total, _f32(0.0)), total, _f32(1.0)))


def _local_layer_attention(q, k, v, attention_mask, mask_kind, mask_causal, mask_window, mask_step,
                           scale: float, limit: int):
    """A local layer of the attention plan (keys at |i − j| <= limit): every allowed key is in the band,
    so only the band part runs, with K = max(limit, MIN_BLOCK). The request's mask intersects the
    layer's window per row: bidirectional and causal rows see |i − j| <= limit (causal: j <= i too);
    sliding_window rows min(window, limit); dilated rows the keys at multiples of the step within
    the limit; local_strided rows the union of the two."""
    lead = op.Shape(q, start=0, end=2)  # [B, H]
    length = op.Shape(q, start=2, end=3)  # [T]
    q = op.Mul(q, _f32(scale))
    kind = mask_kind

    def is_kind(*kinds):
        out = op.Equal(kind, _i64(int(kinds[0])))
        for other in kinds[1:]:
            out = op.Or(out, op.Equal(kind, _i64(int(other))))
        return out

    full_rows = is_kind(MaskKind.BIDIRECTIONAL, MaskKind.CAUSAL)
    band_rows = is_kind(MaskKind.SLIDING_WINDOW, MaskKind.LOCAL_STRIDED)
    lattice_rows = is_kind(MaskKind.DILATED, MaskKind.LOCAL_STRIDED)
    band_window = op.Where(full_rows, _i64(limit),
                           op.Where(band_rows, op.Min(mask_window, _i64(limit)), _i64(-1)))  # (B,)
    flagged = op.And(op.Cast(mask_causal, to=ir.DataType.BOOL),
                     is_kind(MaskKind.SLIDING_WINDOW, MaskKind.DILATED, MaskKind.LOCAL_STRIDED))
    causal = op.Or(is_kind(MaskKind.CAUSAL), flagged)
    step = op.Max(mask_step, _i64(1))
    valid = op.Cast(attention_mask, to=ir.DataType.INT64)  # (B, T) 0/1

    block = op.Min(_i64(max(limit, MIN_BLOCK)), op.Max(length, _i64(1)))
    blocks = _ceil_div(length, block)  # NB
    padded = op.Mul(blocks, block)
    tail = op.Sub(padded, length)
    qb = op.Reshape(_pad_seq(q, tail, 2), op.Concat(lead, blocks, block, _i64(-1), axis=0))  # (B, H, NB, K, d)

    def windows(x, axis: int, shape):
        framed = op.Reshape(_pad_seq(x, op.Add(tail, block), axis, before=block), shape)  # NB + 2 blocks
        parts = [op.Slice(framed, _i64(s), op.Add(blocks, _i64(s)), _i64(axis)) for s in (0, 1, 2)]
        return op.Concat(*parts, axis=axis + 1)

    kv_shape = op.Concat(lead, op.Add(blocks, _i64(2)), block, _i64(-1), axis=0)
    kb = windows(k, 2, kv_shape)  # (B, H, NB, 3K, d)
    vb = windows(v, 2, kv_shape)
    key_ok = windows(valid, 1, op.Concat(op.Shape(q, start=0, end=1), op.Add(blocks, _i64(2)), block, axis=0))
    key_ok = op.Unsqueeze(op.Cast(key_ok, to=ir.DataType.BOOL), _i64(1, 3))  # (B, 1, NB, 1, 3K)
    a = op.Range(_i64(0), op.Squeeze(block), _i64(1))
    c = op.Range(_i64(0), op.Squeeze(op.Mul(block, _i64(3))), _i64(1))
    distance = op.Sub(op.Add(op.Unsqueeze(a, _i64(1)), block), op.Unsqueeze(c, _i64(0)))  # (K, 3K): i - j
    apart = op.Abs(distance)
    in_band = op.LessOrEqual(apart, _row(band_window, 5))  # (B, 1, 1, K, 3K)
    on_lattice = op.And(op.And(_row(lattice_rows, 5), op.LessOrEqual(apart, _i64(limit))),
                        op.Equal(op.Mod(apart, _row(step, 5)), _i64(0)))
    forward_ok = op.Or(op.Not(_row(causal, 5)), op.GreaterOrEqual(distance, _i64(0)))
    allowed = op.And(op.And(op.Or(in_band, on_lattice), forward_ok), key_ok)  # (B, 1, NB, K, 3K)
    scores = op.MatMul(qb, op.Transpose(kb, perm=[0, 1, 2, 4, 3]))  # (B, H, NB, K, 3K)
    _, total, out = _partial_softmax(scores, allowed, vb)
    out = op.Div(out, op.Where(op.Greater(total, _f32(0.0)), total, _f32(1.0)))
    flat = op.Reshape(out, op.Concat(lead, padded, _i64(-1), axis=0))
    return op.Slice(flat, _i64(0), length, _i64(2))  # (B, H, T, d)


def linear_attention(fq, fk, v, attention_mask, mask_kind):
    lead = op.Shape(fq, start=0, end=2)  # [B, H]
    length = op.Shape(fq, start=2, end=3)
    real = op.Unsqueeze(op.Cast(attention_mask, to=ir.DataType.BOOL), _i64(1, 3))  # (B, 1, T, 1)
    fk = op.Where(real, fk, _f32(0.0))  # padded keys count for nothing

    # bidirectional rows: φ(Q)·(φ(K)ᵀV) / φ(Q)·Σφ(K)
    kv = op.MatMul(op.Transpose(fk, perm=[0, 1, 3, 2]), v)  # (B, H, F, d)
    key_sum = op.ReduceSum(fk, _i64(2), keepdims=1)  # (B, H, 1, F)
    num_all = op.MatMul(fq, kv)  # (B, H, T, d)
    den_all = op.ReduceSum(op.Mul(fq, key_sum), _i64(-1), keepdims=1)  # (B, H, T, 1)

    # causal rows: chunks of CHUNK queries
    chunks = _ceil_div(length, _i64(CHUNK))
    span = op.Mul(chunks, _i64(CHUNK))
    extra = op.Sub(span, length)
    shape = op.Concat(lead, chunks, _i64(CHUNK, -1), axis=0)
    qc, kc, vc = (op.Reshape(_pad_seq(x, extra, 2), shape) for x in (fq, fk, v))  # (B, H, NC, C, ·)
    lower = op.Constant(value=ir.tensor(np.tril(np.ones((CHUNK, CHUNK), np.float32))))
    inside = op.Mul(op.MatMul(qc, op.Transpose(kc, perm=[0, 1, 2, 4, 3])), lower)  # (B, H, NC, C, C)
    kc_t = op.Transpose(kc, perm=[0, 1, 2, 4, 3])
    before_kv = op.CumSum(op.MatMul(kc_t, vc), _i64(2), exclusive=1)  # (B, H, NC, F, d): earlier chunks
    before_sum = op.CumSum(op.ReduceSum(kc, _i64(3), keepdims=1), _i64(2), exclusive=1)  # (B, H, NC, 1, F)
    num_c = op.Add(op.MatMul(inside, vc), op.MatMul(qc, before_kv))
    den_c = op.Add(op.ReduceSum(inside, _i64(-1), keepdims=1),
                   op.ReduceSum(op.Mul(qc, before_sum), _i64(-1), keepdims=1))

    def to_sequence(x):  # (B, H, NC, C, n) -> (B, H, T, n)
        return op.Slice(op.Reshape(x, op.Concat(lead, span, _i64(-1), axis=0)), _i64(0), length, _i64(2))

    causal = _row(op.Equal(mask_kind, _i64(int(MaskKind.CAUSAL))), 4)  # (B, 1, 1, 1)
    numerator = op.Where(causal, to_sequence(num_c), num_all)
    denominator = op.Where(causal, to_sequence(den_c), den_all)
    return op.Div(numerator, op.Where(op.Greater(denominator, _f32(0.0)), denominator, _f32(1.0)))


def translation_table() -> dict:
    """torch op -> ONNX translation, for torch.onnx.export(custom_translation_table=...)."""
    import torch

    import model.long_attention  # noqa: F401  (registers the ops)

    return {
        torch.ops.encoder.sparse_softmax_attention.default: sparse_softmax_attention,
        torch.ops.encoder.linear_attention.default: linear_attention,
    }
