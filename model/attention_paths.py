"""Attention paths: which exported graph computes which mask kinds, and what each costs (torch-free).

The mask kinds of SEEDS.md exist to cut attention's O(T²) cost. The dense graph computes every kind
from a [B, T, T] allowed matrix, so a window of 64 costs what full attention costs. The long-input
paths compute a kind at its own cost, exactly (the export validates each against the dense PyTorch
reference), without any tensor that has two sequence-sized axes:

  dense   every kind, O(T²): the [B, T, T] allowed matrix and full T × T scores.
  sparse  softmax attention, rows of kind sliding_window, dilated or local_strided (causal flag or
          not): blocked banded attention (T padded to blocks of K ≥ the batch's largest window; each
          block of queries sees its own and its two neighbour blocks, 3K keys) for the window part,
          and the step-k interleaved sub-sequences attending within themselves for the strided
          part: O(T·3K + T²/k), the two merged in one softmax (no key counted twice).
          Windows may differ between the rows of a run (masked inside the band); the step may not:
          rows of strided kinds in one run share one step (the server splits runs by step).
  linear  linear (elu+1) and performer attention, rows of kind bidirectional or causal: φ(K)ᵀV and
          Σφ(K) for bidirectional rows, chunks of CHUNK queries with prefix sums of the per-chunk
          φ(K)ᵀV for causal rows: O(T).

The server runs each row on the cheapest path that computes its kind exactly (`cheapest`), and
refuses a request whose attention would not fit its memory budget (`attention_bytes`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from model.config import EncoderConfig
from model.mask_kinds import MaskKind

DENSE, SPARSE, LINEAR = "dense", "sparse", "linear"
PATHS = (DENSE, SPARSE, LINEAR)

# The longest sequence a graph with computed positions is exported for (torch.export needs a bound),
# and the most the server ever admits.
MAX_SEQUENCE = 1 << 20
# Smallest block of the banded path (tiny blocks make many tiny matrix products).
MIN_BLOCK = 16
# Queries of each strided sub-sequence per tile on the sparse path's strided part (a Loop over
# tiles): one tile's scores are (rows, heads, S, QUERY_TILE, T/S), never T x T.
QUERY_TILE = 64
# Query chunk of the causal linear path (quadratic inside a chunk, prefix sums across chunks).
CHUNK = 64

# The kinds each path computes exactly, for the attention kinds it applies to.
PATH_KINDS = {
    DENSE: frozenset(MaskKind),
    SPARSE: frozenset({MaskKind.SLIDING_WINDOW, MaskKind.DILATED, MaskKind.LOCAL_STRIDED}),
    LINEAR: frozenset({MaskKind.BIDIRECTIONAL, MaskKind.CAUSAL}),
}

# Bytes of live float32 activations per attention score element, per path, at the peak of one
# layer (scores, their masked copy, exponentials, probabilities; the [B, T, T] mask and custom-mask
# input for dense). Measured with peak RSS on the default model (docs/performance.md, "Long inputs").
BYTES_PER_SCORE = {DENSE: 30.0, SPARSE: 18.0, LINEAR: 12.0}
# Disentangled attention (DeBERTa, config.disentangled_terms; dense only) holds its two position terms, their sum
# and their T·T indices beside the scores: its peak per score measured 1.9-2.1 × a plain dense graph's (peak RSS
# of fp32 graphs at d_model 256, 4 heads, 4 layers, T = 2048 and 4096, 256 buckets), so its dense score bytes
# are counted this many times.
DISENTANGLED_SCORE_FACTOR = 2.2
# Bytes per token per model dimension outside attention (hidden states, FFN activations, outputs).
BYTES_PER_TOKEN_DIM = 48.0


def long_path(config: EncoderConfig) -> str | None:
    """The long-input path an export of `config` has beside dense, or None (additive attention; relative
    position buckets and disentangled attention, whose terms the long-input ops do not add: such a model is
    served dense)."""
    if config.relative_attention_buckets or config.disentangled_terms:
        return None
    if config.attention == "softmax":
        return SPARSE
    if config.attention in ("linear", "performer"):
        return LINEAR
    return None


@dataclass(frozen=True)
class RowMask:
    """The mask fields of one row that decide its path and cost."""

    kind: MaskKind
    window: int = 0
    step: int = 1


def block_size(window: int, length: int) -> int:
    """The banded path's block K for a run whose largest window is `window`, at `length` tokens."""
    return max(1, min(max(window, MIN_BLOCK), length))


def path_kinds(path: str, config: EncoderConfig) -> frozenset:
    """The mask kinds `path` computes for this config: the sparse path computes bidirectional and causal
    rows too, its global layers taking them as dilated rows of step 1 (every key, in tiles: the fused
    kernel for bidirectional runs, the query-tile Loop for causal ones); with an attention plan its local
    layers banded. Their work is T², as dense; the server takes this path for them when it holds less than
    the dense graph would and the dense one does not fit (serve/core/attention_budget.py)."""
    kinds = PATH_KINDS[path]
    if path == SPARSE:
        kinds = kinds | {MaskKind.BIDIRECTIONAL, MaskKind.CAUSAL}
    return kinds


def score_elements(path: str, length: int, mask: RowMask, config: EncoderConfig, *, peak: bool = False,
                   fused_tiles: bool = True) -> float:
    """Attention score elements one row computes per head and layer on `path` (its work), or holds at
    once (`peak`, its memory). On the sparse path the strided part runs in tiles of QUERY_TILE queries
    per sub-sequence, so it computes S·M² scores but holds S·min(M, QUERY_TILE)·M at a time (M = T/S).
    With an attention plan the work is the mean over the layers and the memory the largest layer's: a
    local layer on the sparse path costs its band T·3K, K = max(local_window, MIN_BLOCK), whatever the
    row's kind; a global layer what the row's kind costs (bidirectional and causal rows: T² work, as
    dense, in tiles of QUERY_TILE·T; bidirectional runs hold even less, in the fused kernel's L2-sized
    tiles, which this estimate does not count on). `fused_tiles=False`: the fused kernel holds every
    T² score of a bidirectional row's global layer, as ONNX Runtime's CUDA MultiHeadAttention does for
    our q/k head width (its unfused kernel; docs/long-inputs.md, "On CUDA")."""
    t = max(length, 1)
    if path == DENSE:
        return float(t * t)
    if path == LINEAR:
        features = config.performer_features if config.attention == "performer" else config.head_dim
        return float(t * (CHUNK + 2 * features))
    if config.local_layers:
        k = block_size(config.local_window, t)
        local = math.ceil(t / k) * k * 3 * k
        # a global layer: the row's kind on the plan-less sparse graph (bidirectional and causal in tiles, below)
        global_cost = score_elements(path, length, mask, config.replace(local_layers=()), peak=peak,
                                     fused_tiles=fused_tiles)
        n_local = len(config.local_layers)
        if peak:
            return float(max(local, global_cost) if n_local < config.n_layers else local)
        return float((n_local * local + (config.n_layers - n_local) * global_cost) / config.n_layers)
    if mask.kind in (MaskKind.BIDIRECTIONAL, MaskKind.CAUSAL):  # every key: dilated rows of step 1, in tiles
        if not fused_tiles and mask.kind == MaskKind.BIDIRECTIONAL:
            return float(t * t)
        mask = RowMask(MaskKind.DILATED, 0, 1)
    window = mask.window if mask.kind.uses_window else -1
    k = block_size(window, t)
    band = math.ceil(t / k) * k * 3 * k
    if mask.kind.uses_step:
        step = min(max(mask.step, 1), t)
        groups = math.ceil(t / step)
        strided = groups * step * (min(groups, QUERY_TILE) if peak else groups)
    else:
        strided = t
    return float(band + strided)


def computes(path: str, kind: MaskKind, config: EncoderConfig) -> bool:
    """Whether `path` computes rows of `kind` exactly for this config's attention."""
    return path == DENSE or (path == long_path(config) and kind in path_kinds(path, config))


def cheapest(length: int, mask: RowMask, config: EncoderConfig, available: tuple[str, ...]) -> str:
    """The path of `available` that computes the row exactly with the fewest score elements (dense on a tie)."""
    best, best_cost = DENSE, score_elements(DENSE, length, mask, config)
    for path in available:
        if path != DENSE and computes(path, mask.kind, config):
            cost = score_elements(path, length, mask, config)
            if cost < best_cost:
                best, best_cost = path, cost
    return best


def attention_bytes(path: str, rows: int, length: int, mask: RowMask, config: EncoderConfig, *,
                    fused_tiles: bool = True) -> int:
    """Estimated peak bytes of one run of `rows` rows of `length` tokens on `path` (one layer's attention
    at its peak, plus the activations that scale with the tokens)."""
    scores = (score_elements(path, length, mask, config, peak=True, fused_tiles=fused_tiles) * config.n_heads
              * BYTES_PER_SCORE[path] * (DISENTANGLED_SCORE_FACTOR if config.disentangled_terms else 1.0))
    ffn_width = 2 * config.d_ff if config.ffn == "gated" else config.d_ff  # a GLU's up projection is 2·d_ff wide
    tokens = length * max(config.d_model, ffn_width) * BYTES_PER_TOKEN_DIM / 4
    return int(rows * (scores + tokens))
