"""A request's rows in batch form (`Rows`), and the one function that builds a run's graph inputs
from them (`pad_batch`).

A request's sequences are held as one right-padded block with each row's length, as KServe v2 sends
them and as ONNX Runtime takes them: a run that is exactly one request's block is fed that block
itself, and a run of several requests' rows copies each request's rows in one slice assignment. No
per-row objects, no per-row loops except for custom masks of unequal-length rows.

The batcher calls `pad_batch` for every session.run, the backend for warm-up and the start-up probe.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from model.attention_paths import DENSE
from model.config import EncoderConfig
from model.mask_kinds import MaskKind

# read-only constant arrays kept (all-true custom masks, all-ones attention masks, mask choices) per shape: at
# most this many bytes in all (a [32, 512, 512] custom mask is 8 MiB)
CONSTANTS_BYTES = 64 << 20


@dataclass(frozen=True, eq=False)
class Rows:
    """A request's sequences as the batcher runs them: one block and each row's length. The mask is
    the request's (every row shares it); each row's attention path is decided once, at admission."""

    block: np.ndarray  # int64 [n, T] token ids (pad id past each length) or float32 [n, T, D] (zeros)
    lengths: np.ndarray  # int64 [n]: row i is block[i, :lengths[i]]
    kind: int = int(MaskKind.BIDIRECTIONAL)
    causal: bool = False
    window: int = 0
    step: int = 1
    custom: np.ndarray | None = None  # bool [n, T, T] (kind=custom): False past each row's length
    paths: tuple[tuple[str, np.ndarray], ...] = ()  # (path, row indices) per path; (): every row dense
    attention_bytes: int = 0  # their attention's estimated memory (serve/core/attention_budget.py)
    types: np.ndarray | None = None  # int64 [n, T] token type ids (sentence pairs); None: zeros
    row_elements: int = 0  # CUDA: elements of the largest attention tensor one row holds at `longest`; 0: unbounded
    longest: int = 0  # the longest row's length (0: computed from `lengths`)
    tokens: int = 0  # the rows' tokens in all (0: computed from `lengths`)

    def __post_init__(self) -> None:  # what its maker did not already know, from the lengths
        if not self.longest:
            object.__setattr__(self, "longest", int(self.lengths.max()) if len(self.lengths) else 0)
        if not self.tokens:
            object.__setattr__(self, "tokens", int(self.lengths.sum()))

    def __len__(self) -> int:
        return len(self.block)

    @property
    def full(self) -> bool:
        """Every row is `longest` long (no padding inside the block)."""
        return self.tokens == len(self) * self.longest


_cache: dict[tuple, np.ndarray] = {}
_cached_bytes = [0]


def constant(shape: tuple[int, ...], value, dtype) -> np.ndarray:
    """A read-only array of one value (an all-true custom mask, all-ones attention mask, a run's shared mask
    choice, the lengths of a block's rows), kept for the shapes runs reuse: fed as is, never written."""
    key = (shape, value, np.dtype(dtype).str)
    array = _cache.get(key)
    if array is None:
        array = np.full(shape, value, dtype)
        array.flags.writeable = False
        if _cached_bytes[0] + array.nbytes > CONSTANTS_BYTES:
            _cache.clear()
            _cached_bytes[0] = 0
        if array.nbytes <= CONSTANTS_BYTES:
            _cache[key] = array
            _cached_bytes[0] += array.nbytes
    return array


def _per_row(values: list, counts: list[int], dtype) -> np.ndarray:
    """Each piece's one value, once per row of the piece."""
    if len(values) == 1 or all(v == values[0] for v in values):
        return constant((sum(counts),), values[0], dtype)
    return np.repeat(np.array(values, dtype), counts)


def run_lengths(pieces: list[tuple[Rows, np.ndarray | None]]) -> tuple[np.ndarray, int]:
    """Each row's length in a run of `pieces` (as pad_batch lays them out), and their tokens in all."""
    if all(index is None for _, index in pieces):
        lengths = pieces[0][0].lengths if len(pieces) == 1 else np.concatenate([rows.lengths for rows, _ in pieces])
        return lengths, sum(rows.tokens for rows, _ in pieces)
    lengths = np.concatenate([rows.lengths if index is None else rows.lengths[index] for rows, index in pieces])
    return lengths, int(lengths.sum())


def pad_batch(pieces: list[tuple[Rows, np.ndarray | None]], length: int, config: EncoderConfig,
              path: str = DENSE, lengths: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """The graph's inputs for `pieces` (each a request's Rows and the indices of its rows in this run,
    None: all of them, in order) on attention `path`, right-padded to `length` (padding is masked
    out). `lengths`: each row's length in the run, where the caller has them (`run_lengths`). Only the
    dense graph takes the [B, T, T] custom mask."""
    if lengths is None:
        lengths = run_lengths(pieces)[0]
    if all(index is None and rows.block.shape[1] == length for rows, index in pieces):
        # whole requests of the run's width (one: its block is the batch): stacked, nothing to pad
        first = pieces[0][0].block if len(pieces) == 1 else np.concatenate([rows.block for rows, _ in pieces])
        counts = [len(rows) for rows, _ in pieces]
    else:
        counts = [len(rows) if index is None else len(index) for rows, index in pieces]
        n = sum(counts)
        if config.input_kind == "tokens":
            first = np.full((n, length), config.pad_token_id, np.int64)
        else:
            first = np.zeros((n, length, config.d_model), np.float32)
        at = 0
        for (rows, index), count in zip(pieces, counts):
            width = min(length, rows.block.shape[1])
            block = rows.block[:, :width] if index is None else rows.block[index, :width]
            first[at:at + count, :width] = block
            at += count
    n = len(lengths)
    full = all(index is None and rows.full and rows.longest == length for rows, index in pieces)
    feeds = {
        "input_ids" if config.input_kind == "tokens" else "inputs_embeds": first,
        "attention_mask": constant((n, length), 1, np.int64) if full else
        (np.arange(length) < lengths[:, None]).astype(np.int64),
        "mask_kind": _per_row([rows.kind for rows, _ in pieces], counts, np.int64),
        "mask_causal": _per_row([rows.causal for rows, _ in pieces], counts, bool),
        "mask_window": _per_row([rows.window for rows, _ in pieces], counts, np.int64),
        "mask_step": _per_row([max(rows.step, 1) for rows, _ in pieces], counts, np.int64),
    }
    if path == DENSE:
        if all(rows.custom is None for rows, _ in pieces):
            feeds["custom_mask"] = constant((n, length, length), True, bool)
        else:
            custom = np.ones((n, length, length), bool)
            at = 0
            for (rows, index), count in zip(pieces, counts):
                if rows.custom is not None:  # False past each row's length (Rows.custom)
                    width = min(length, rows.custom.shape[1])
                    block = rows.custom if index is None else rows.custom[index]
                    custom[at:at + count] = False
                    custom[at:at + count, :width, :width] = block[:, :width, :width]
                at += count
            feeds["custom_mask"] = custom
    if config.type_vocab_size:
        feeds["token_type_ids"] = _types(pieces, counts, n, length)
    return feeds


def _types(pieces: list[tuple[Rows, np.ndarray | None]], counts: list[int], n: int, length: int) -> np.ndarray:
    """The run's token type ids: each piece's own (sentence pairs), zeros for rows without them."""
    if len(pieces) == 1 and pieces[0][1] is None and pieces[0][0].types is not None \
            and pieces[0][0].types.shape[1] == length:
        return pieces[0][0].types
    types = np.zeros((n, length), np.int64)
    at = 0
    for (rows, index), count in zip(pieces, counts):
        if rows.types is not None:
            width = min(length, rows.types.shape[1])
            types[at:at + count, :width] = rows.types[:, :width] if index is None else rows.types[index, :width]
        at += count
    return types
