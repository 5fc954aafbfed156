"""ONNX subgraphs for the long-input attention ops of model/long_attention.py (torch.onnx's
custom_translation_table), built from ordinary ONNX ops with onnxscript, plus If / Loop nodes and one
contrib op (com.microsoft MultiHeadAttention) recorded as they are (`_node`, `_subgraph`).

No tensor here has two sequence-sized axes (a test checks the saved graphs' inferred shapes; the
global layers' tiles: tests/test_tiled_attention.py):

global   (a layer without `limit`) an If on the run's rows: every row attends to every real key
         (bidirectional rows, which a plan's global layer receives as dilated step-1 rows) ->
         MultiHeadAttention, whose CPU kernel is MLAS flash attention in L2-sized tiles (no mask
         input: key padding is an extra head column, 1 for queries, 0 / PAD_SCORE for keys); else
         the band and strided parts below.

sparse_softmax_attention, per row of a batch (model/attention_paths.py):
  band     K = clamp(max window of the run's band rows, MIN_BLOCK, T); queries in blocks of K, each
           against its previous, own and next block of keys, allowed where |i − j| <= the row's window.
           Query i = nb·K + a meets key j = (nb − 1)·K + c at distance i − j = K + a − c, the same for
           every block, so the band rule is one (K, 3K) table per row. The blocks run in a Loop over
           groups of G blocks (`_band`; G so that one group's scores, (B, H, G, K, 3K), are about
           BAND_GROUP_BYTES and stay in L2): per group queries (B, H, G, K, d), keys and values
           (B, H, G, 3K, d). A run with no strided row (sliding_window rows only) takes the band alone,
           normalised inside each group (an If), and skips the strided part and the merge.
  strided  S = the run's step (T when no row is strided); T padded to M·S; the S interleaved
           sub-sequences (B, H, S, M, d) attend within themselves, in a Loop over tiles of
           QUERY_TILE queries: scores (B, H, S, QUERY_TILE, M) per tile (never M x M), allowed where
           the row is strided and |i − j| > its band window (no key counted twice).
  merge    the two partial softmaxes are combined exactly: m = max(m₁, m₂),
           out = (e^(m₁−m)·o₁ + e^(m₂−m)·o₂) / (e^(m₁−m)·l₁ + e^(m₂−m)·l₂); a query with no allowed
           key (l = 0) gives zeros.
linear_attention:
  bidirectional rows  φ(Q)·(φ(K)ᵀV) / φ(Q)·Σφ(K), padded keys zeroed;
  causal rows         chunks of CHUNK queries: inside a chunk the masked quadratic form, across chunks
                      exclusive prefix sums (CumSum) of each chunk's φ(K)ᵀV and Σφ(K).
"""

from __future__ import annotations

import itertools

import numpy as np
from onnxscript import evaluator, ir
from onnxscript import opset18 as op

from model.attention_paths import CHUNK, MIN_BLOCK, QUERY_TILE
from model.mask_kinds import MaskKind

LOWEST = float(np.finfo(np.float32).min)
# A query's largest score is clamped up to this, so that a query with no allowed key (largest score
# LOWEST) gets exp(LOWEST - FLOOR) = 0 for every key instead of exp(0) = 1.
FLOOR = -1e30


# A key that is padding gets this added to its score on the fused path (an extra head column: 1 on
# the query side, 0 or PAD_SCORE on the key side), so its exponential is exactly 0 next to any real key.
PAD_SCORE = -1e30
_subgraph_names = itertools.count()
FLOAT = (ir.DataType.FLOAT,)


def _node(op_type: str, inputs: list, attributes: dict, domain: str = ""):
    """One node recorded as is, for what the opset wrappers cannot record: an op with a graph attribute
    (Loop, If) or a contrib op (com.microsoft). Returns its single output."""
    node = ir.Node(domain, op_type, inputs=inputs, num_outputs=1,
                   attributes=[ir.convenience.convert_attribute(k, v) for k, v in attributes.items()])
    evaluator.default().nodes.append(node)
    return node.outputs[0]


def _subgraph(build, inputs: tuple, types: tuple) -> ir.Graph:
    """The nodes `build(*inputs)` records, as a graph of their own (a Loop body, an If branch); they may
    use values of the enclosing graph (ONNX outer scope). Its values get names unique in the model;
    its outputs the element `types` given (ONNX checks them against the node's)."""
    outer = evaluator.default()
    recorder = type(outer)(outer.opset, {})
    with evaluator.default_as(recorder):
        outputs = build(*inputs)
    prefix = f"long_{next(_subgraph_names)}"
    for i, node in enumerate(recorder.nodes):
        node.name = f"{prefix}_n{i}"
        for j, value in enumerate(node.outputs):
            value.name = f"{prefix}_v{i}_{j}"
    for value, dtype in zip(outputs, types, strict=True):
        value.type = ir.TensorType(dtype)
    return ir.Graph(inputs, outputs, nodes=recorder.nodes, name=prefix)


def _scalar(name: str, dtype: ir.DataType) -> ir.Value:
    return ir.Value(name=f"{name}_{next(_subgraph_names)}", type=ir.TensorType(dtype), shape=ir.Shape([]))


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


def first_query(index, tile):
    """The first query (on the strided part's group axis) of tile `index`: the tiling hook
    (tests/test_tiled_attention.py breaks it to show that validation catches a wrong tile boundary)."""
    return op.Mul(index, tile)


# Bytes of one group's band scores (B, H, G, K, 3K float32) in the band Loop: a group's element-wise
# passes (mask, max, exp, sum, the weighted values) then run on tensors that stay in a core's L2 cache,
# where one pass over the whole band streamed T-sized tensors from memory (at 32k, 200 MB each on the
# default model: per-token time grew 1.4-1.9x for Exp, Where, Sub and Slice from 4k to 32k).
BAND_GROUP_BYTES = 2 << 20


def first_block(index, group):
    """The first block of band group `index`: the band Loop's tiling hook (tests break it to show that
    validation catches a wrong group boundary)."""
    return op.Mul(index, group)


def _band(q, k, v, valid, block, allowed_of, *, normalized: bool = False):
    """Blocks of K = `block` queries against their previous, own and next block of keys, in a Loop over
    groups of G blocks (G from BAND_GROUP_BYTES at run time): queries (B, H, G, K, d), keys and values
    (B, H, G, 3K, d), scores (B, H, G, K, 3K), allowed = allowed_of(distance (K, 3K): i − j,
    key_ok (B, 1, G, 1, 3K)). Query i = nb·K + a meets key j = (nb − 1)·K + c at distance K + a − c, the
    same for every block. Returns the partial softmax pieces (max, sum, weighted values), each
    (B, H, T, n); `normalized`: the band's own softmax output (B, H, T, d), divided inside each group
    (no pieces to pack, slice and divide at full length)."""
    lead = op.Shape(q, start=0, end=2)  # [B, H]
    batch = op.Shape(q, start=0, end=1)
    length = op.Shape(q, start=2, end=3)  # [T]
    width = op.Shape(q, start=3, end=4)  # [d]
    blocks = _ceil_div(length, block)  # NB
    per_block = op.Mul(op.Mul(op.ReduceProd(lead, keepdims=1), op.Mul(block, op.Mul(block, _i64(3)))), _i64(4))
    group = op.Max(op.Min(op.Div(_i64(BAND_GROUP_BYTES), per_block), blocks), _i64(1))  # G
    groups = _ceil_div(blocks, group)
    padded = op.Mul(op.Mul(groups, group), block)  # tokens, a whole number of groups
    behind = op.Sub(op.Add(padded, block), length)
    qp = _pad_seq(q, op.Sub(padded, length), 2)  # (B, H, padded, d)
    kp, vp = _pad_seq(k, behind, 2, before=block), _pad_seq(v, behind, 2, before=block)  # a block each side
    okp = _pad_seq(valid, behind, 1, before=block)  # (B, padded + 2K)
    a = op.Range(_i64(0), op.Squeeze(block), _i64(1))
    c = op.Range(_i64(0), op.Squeeze(op.Mul(block, _i64(3))), _i64(1))
    distance = op.Sub(op.Add(op.Unsqueeze(a, _i64(1)), block), op.Unsqueeze(c, _i64(0)))  # (K, 3K): i - j
    framed = op.Add(group, _i64(2))

    def three(x, axis: int):
        """(..., G + 2 blocks, K, ...) -> each block's previous, own and next block (..., G, 3K, ...)."""
        parts = [op.Slice(x, _i64(s), op.Add(group, _i64(s)), _i64(axis)) for s in (0, 1, 2)]
        return op.Concat(*parts, axis=axis + 1)

    def one_group(index, condition):
        start = op.Mul(first_block(index, group), block)  # first token of the group
        span = op.Mul(group, block)
        q_g = op.Reshape(op.Slice(qp, start, op.Add(start, span), _i64(2)), op.Concat(lead, group, block, width, axis=0))
        kv_span = op.Add(start, op.Mul(framed, block))
        kv_shape = op.Concat(lead, framed, block, width, axis=0)
        k_g = three(op.Reshape(op.Slice(kp, start, kv_span, _i64(2)), kv_shape), 2)  # (B, H, G, 3K, d)
        v_g = three(op.Reshape(op.Slice(vp, start, kv_span, _i64(2)), kv_shape), 2)
        ok = three(op.Reshape(op.Slice(okp, start, kv_span, _i64(1)), op.Concat(batch, framed, block, axis=0)), 1)
        key_ok = op.Unsqueeze(op.Cast(ok, to=ir.DataType.BOOL), _i64(1, 3))  # (B, 1, G, 1, 3K)
        scores = op.MatMul(q_g, op.Transpose(k_g, perm=[0, 1, 2, 4, 3]))  # (B, H, G, K, 3K)
        top, total, out = _partial_softmax(scores, allowed_of(distance, key_ok), v_g)
        if normalized:  # (B, H, G, K, d); a query with no allowed key (total 0) gets zeros
            return [op.Identity(condition), op.Div(out, op.Where(op.Greater(total, _f32(0.0)), total, _f32(1.0)))]
        return [op.Identity(condition), op.Concat(out, top, total, axis=-1)]  # (B, H, G, K, d + 2)

    body = _subgraph(one_group, (_scalar("group_index", ir.DataType.INT64), _scalar("group_go_on", ir.DataType.BOOL)),
                     (ir.DataType.BOOL, ir.DataType.FLOAT))
    packed = _node("Loop", [op.Squeeze(groups), op.Constant(value=ir.tensor(np.array(True)))], {"body": body})
    # (groups, B, H, G, K, d + 2) -> (B, H, groups, G, K, d + 2) -> (B, H, T, d + 2)
    packed = op.Transpose(packed, perm=[1, 2, 0, 3, 4, 5])
    packed = op.Slice(op.Reshape(packed, op.Concat(lead, padded, _i64(-1), axis=0)), _i64(0), length, _i64(2))
    if normalized:
        return packed
    out = op.Slice(packed, _i64(0), _i64(-2), _i64(3))
    top = op.Slice(packed, _i64(-2), _i64(-1), _i64(3))
    total = op.Slice(packed, _i64(-1), _i64(1 << 62), _i64(3))
    return top, total, out


def sparse_softmax_attention(q, k, v, attention_mask, mask_kind, mask_causal, mask_window, mask_step,
                             scale: float, limit: int = -1):
    if limit >= 0:
        return _local_layer_attention(q, k, v, attention_mask, mask_kind, mask_causal, mask_window, mask_step,
                                      scale, limit)
    heads, width = q.shape[1], q.shape[3]  # static: the fused op takes num_heads as an attribute
    q = op.Mul(q, _f32(scale))  # scaled once, on the (T, d) side rather than on the scores
    # A run of rows that all attend to every real key (a plan's bidirectional rows on a global layer
    # arrive as dilated, step 1, not causal) goes to ONNX Runtime's fused attention; any other run to
    # the banded + query-tiled strided parts. Neither holds a T x T tensor.
    not_causal = op.Not(op.Cast(mask_causal, to=ir.DataType.BOOL))
    full = op.And(op.And(op.Equal(mask_kind, _i64(int(MaskKind.DILATED))), not_causal), op.Equal(mask_step, _i64(1)))
    every_row_full = op.Cast(op.ReduceMin(op.Cast(full, to=ir.DataType.INT64), keepdims=0), to=ir.DataType.BOOL)
    return _node("If", [every_row_full], {
        "then_branch": _subgraph(lambda: [_fused_full_attention(q, k, v, attention_mask, heads, width)], (), FLOAT),
        "else_branch": _subgraph(lambda: [_banded_and_strided(q, k, v, attention_mask, mask_kind, mask_causal,
                                                              mask_window, mask_step)], (), FLOAT),
    })


def _fused_full_attention(q, k, v, attention_mask, heads: int, width: int):
    """softmax(Q·Kᵀ)·V over each row's real keys with com.microsoft MultiHeadAttention, whose CPU kernel
    (MLAS flash attention) runs in L2-sized query × key tiles with an online softmax, never holding
    T x T scores, when it has no mask input. The key padding therefore rides in the product: one more
    head column, 1 for every query and 0 (real key) or PAD_SCORE (padding) for keys, so a padded key
    scores PAD_SCORE and its exponential is exactly 0 beside any real key. A row with no real key
    gets zeros (as on the dense path). q is already scaled (scale=1)."""
    if not isinstance(heads, int) or not isinstance(width, int):
        raise ValueError(f"the fused global layer needs static heads and head_dim, got {q.shape}")
    batch_heads_length = op.Shape(q, start=0, end=3)  # [B, H, T]
    column = op.Concat(batch_heads_length, _i64(1), axis=0)
    real = op.Unsqueeze(op.Cast(attention_mask, to=ir.DataType.BOOL), _i64(1, 3))  # (B, 1, T, 1)
    q_ext = op.Concat(q, op.Expand(_f32(1.0), column), axis=-1)  # (B, H, T, d + 1)
    k_ext = op.Concat(k, op.Expand(op.Where(real, _f32(0.0), _f32(PAD_SCORE)), column), axis=-1)
    seq_shape = op.Concat(op.Shape(q, start=0, end=1), op.Shape(q, start=2, end=3), _i64(-1), axis=0)  # [B, T, -1]

    def by_token(x):  # (B, H, T, n) -> (B, T, H·n), the layout MultiHeadAttention takes
        return op.Reshape(op.Transpose(x, perm=[0, 2, 1, 3]), seq_shape)

    out = _node("MultiHeadAttention", [by_token(q_ext), by_token(k_ext), by_token(v)],
                {"num_heads": heads, "scale": 1.0}, domain="com.microsoft")  # (B, T, H·d)
    out = op.Transpose(op.Reshape(out, op.Concat(op.Shape(q, start=0, end=1), op.Shape(q, start=2, end=3),
                                                 _i64(heads, width), axis=0)), perm=[0, 2, 1, 3])
    real_keys = op.ReduceMax(op.Cast(attention_mask, to=ir.DataType.INT64), _i64(1), keepdims=0)  # (B,)
    any_key = op.Unsqueeze(op.Greater(real_keys, _i64(0)), _i64(1, 2, 3))  # (B, 1, 1, 1)
    return op.Where(any_key, out, _f32(0.0))  # (B, H, T, d)


def _banded_and_strided(q, k, v, attention_mask, mask_kind, mask_causal, mask_window, mask_step):
    """Rows of every kind (q already scaled): the band part and the strided part, merged (module doc)."""
    lead = op.Shape(q, start=0, end=2)  # [B, H]
    length = op.Shape(q, start=2, end=3)  # [T]
    band_rows = op.Or(op.Equal(mask_kind, _i64(int(MaskKind.SLIDING_WINDOW))),
                      op.Equal(mask_kind, _i64(int(MaskKind.LOCAL_STRIDED))))
    strided_rows = op.Or(op.Equal(mask_kind, _i64(int(MaskKind.DILATED))),
                         op.Equal(mask_kind, _i64(int(MaskKind.LOCAL_STRIDED))))
    band_window = op.Where(band_rows, mask_window, _i64(-1))  # (B,): -1 = no band keys
    causal = op.Cast(mask_causal, to=ir.DataType.BOOL)
    valid = op.Cast(attention_mask, to=ir.DataType.INT64)  # (B, T) 0/1

    # ---- band: blocks of K queries against their previous, own and next block of keys, in groups
    block = op.Min(op.Max(op.ReduceMax(band_window, keepdims=1), _i64(MIN_BLOCK)), op.Max(length, _i64(1)))
    window_of_row, causal_of_row = _row(band_window, 5), op.Not(_row(causal, 5))

    def band_allowed(distance, key_ok):  # (B, 1, G, K, 3K): |i - j| <= the row's window, causal rows j <= i
        in_band = op.LessOrEqual(op.Abs(distance), window_of_row)
        forward_ok = op.Or(causal_of_row, op.GreaterOrEqual(distance, _i64(0)))
        return op.And(op.And(in_band, forward_ok), key_ok)


    # ---- strided: the S interleaved sub-sequences attend within themselves, in tiles of queries; then one
    # softmax over the union. A run without strided rows (sliding_window rows only) skips both: its
    # band's own softmax is the answer (an If on the run's rows).
    def strided_and_merged():
        top1, sum1, out1 = _band(q, k, v, valid, block, band_allowed)
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
        ks_t = op.Transpose(ks, perm=[0, 1, 2, 4, 3])  # (B, H, S, d, M)
        tile = op.Min(_i64(QUERY_TILE), groups)  # queries of each sub-sequence per tile
        tiles = _ceil_div(groups, tile)
        qs = _pad_seq(qs, op.Sub(op.Mul(tiles, tile), groups), 3)  # (B, H, S, tiles·tile, d)
        keys_at = op.Unsqueeze(op.Range(_i64(0), op.Squeeze(groups), _i64(1)), _i64(0))  # (1, M)
        strided_ok = _row(strided_rows, 5)
        no_causal = op.Not(_row(causal, 5))
        band_limit = _row(band_window, 5)

        def one_tile(index, condition):
            """Queries [start, start + tile) of every sub-sequence against all of its keys: scores
            (B, H, S, tile, M), a tile's softmax pieces packed as (out, max, sum) on the last axis."""
            start = first_query(index, tile)
            q_tile = op.Slice(qs, start, op.Add(start, tile), _i64(3))  # (B, H, S, tile, d)
            queries_at = op.Unsqueeze(op.Add(op.Range(_i64(0), op.Squeeze(tile), _i64(1)), start), _i64(1))  # (tile, 1)
            distance = op.Mul(op.Sub(queries_at, keys_at), step)  # (tile, M): i - j
            allowed = op.And(op.And(op.And(strided_ok, op.Greater(op.Abs(distance), band_limit)),
                                    op.Or(no_causal, op.GreaterOrEqual(distance, _i64(0)))), key_ok)  # (B, 1, S, tile, M)
            top, total, out = _partial_softmax(op.MatMul(q_tile, ks_t), allowed, vs)
            return [op.Identity(condition), op.Concat(out, top, total, axis=-1)]

        body = _subgraph(one_tile, (_scalar("tile_index", ir.DataType.INT64), _scalar("tile_go_on", ir.DataType.BOOL)),
                         (ir.DataType.BOOL, ir.DataType.FLOAT))
        packed = _node("Loop", [op.Squeeze(tiles), op.Constant(value=ir.tensor(np.array(True)))], {"body": body})
        # (tiles, B, H, S, tile, d + 2) -> (B, H, S, tiles, tile, d + 2) -> (B, H, S, M, d + 2)
        packed = op.Transpose(packed, perm=[1, 2, 3, 0, 4, 5])
        packed = op.Reshape(packed, op.Concat(lead, step, _i64(-1), op.Add(op.Shape(vs, start=4, end=5), _i64(2)), axis=0))
        packed = op.Slice(packed, _i64(0), groups, _i64(3))
        out2 = op.Slice(packed, _i64(0), _i64(-2), _i64(4))
        top2 = op.Slice(packed, _i64(-2), _i64(-1), _i64(4))
        sum2 = op.Slice(packed, _i64(-1), _i64(1 << 62), _i64(4))

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

    def band_only():
        return _band(q, k, v, valid, block, band_allowed, normalized=True)

    any_strided = op.Cast(op.ReduceMax(op.Cast(strided_rows, to=ir.DataType.INT64), keepdims=0), to=ir.DataType.BOOL)
    return _node("If", [any_strided], {"then_branch": _subgraph(lambda: [strided_and_merged()], (), FLOAT),
                                        "else_branch": _subgraph(lambda: [band_only()], (), FLOAT)})


def _local_layer_attention(q, k, v, attention_mask, mask_kind, mask_causal, mask_window, mask_step,
                           scale: float, limit: int):
    """A local layer of the attention plan (keys at |i − j| <= limit): every allowed key is in the band,
    so only the band part runs, with K = max(limit, MIN_BLOCK). The request's mask intersects the
    layer's window per row: bidirectional and causal rows see |i − j| <= limit (causal: j <= i too);
    sliding_window rows min(window, limit); dilated rows the keys at multiples of the step within
    the limit; local_strided rows the union of the two."""
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
    window_of_row, lattice_of_row, step_of_row = _row(band_window, 5), _row(lattice_rows, 5), _row(step, 5)
    causal_of_row = op.Not(_row(causal, 5))

    def local_allowed(distance, key_ok):  # (B, 1, G, K, 3K)
        apart = op.Abs(distance)
        in_band = op.LessOrEqual(apart, window_of_row)
        on_lattice = op.And(op.And(lattice_of_row, op.LessOrEqual(apart, _i64(limit))),
                            op.Equal(op.Mod(apart, step_of_row), _i64(0)))
        forward_ok = op.Or(causal_of_row, op.GreaterOrEqual(distance, _i64(0)))
        return op.And(op.And(op.Or(in_band, on_lattice), forward_ok), key_ok)

    return _band(q, k, v, valid, block, local_allowed, normalized=True)  # (B, H, T, d)


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
