"""Inputs for validating an export: shapes other than the export sample, every mask kind.

`make_feeds` builds one batch of graph inputs (numpy, keyed by graph input name) from per-row
mask choices; the validator and the tests use it alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from model.attention_paths import DENSE, LINEAR, SPARSE, path_kinds
from model.config import EncoderConfig
from model.mask_kinds import MaskKind
from model.signature import input_names


@dataclass(frozen=True)
class MaskSpec:
    kind: MaskKind = MaskKind.BIDIRECTIONAL
    window: int = 0
    step: int = 1
    causal: bool = False
    custom_seed: int | None = None  # custom: a random boolean matrix drawn from this seed

    def label(self) -> str:
        parts = [self.kind.label]
        if self.kind.uses_window:
            parts.append(f"w={self.window}")
        if self.kind.uses_step:
            parts.append(f"k={self.step}")
        if self.causal:
            parts.append("causal")
        return "+".join(parts)


# One spec per mask kind and causal combination (SEEDS.md, "Mask kinds").
EVERY_MASK = (
    MaskSpec(MaskKind.BIDIRECTIONAL),
    MaskSpec(MaskKind.CAUSAL),
    MaskSpec(MaskKind.SLIDING_WINDOW, window=2),
    MaskSpec(MaskKind.SLIDING_WINDOW, window=3, causal=True),
    MaskSpec(MaskKind.DILATED, step=3),
    MaskSpec(MaskKind.DILATED, step=2, causal=True),
    MaskSpec(MaskKind.LOCAL_STRIDED, window=1, step=4),
    MaskSpec(MaskKind.LOCAL_STRIDED, window=2, step=5, causal=True),
    MaskSpec(MaskKind.CUSTOM, custom_seed=7),
)


def make_feeds(
    config: EncoderConfig,
    lengths: list[int],
    masks: MaskSpec | list[MaskSpec],
    *,
    seed: int = 0,
    padded_to: int | None = None,
    left_pad: bool = False,
) -> dict[str, np.ndarray]:
    """A batch with one row per entry of `lengths` (0 = fully padded row), padded to the longest
    (or `padded_to`), each row with its own MaskSpec. Custom rows get an all-false query row too."""
    rng = np.random.default_rng(seed)
    batch = len(lengths)
    length = max(padded_to or 0, max(lengths), 1)
    specs = masks if isinstance(masks, list) else [masks] * batch
    attention = np.zeros((batch, length), np.int64)
    for row, n in enumerate(lengths):
        if left_pad:
            attention[row, length - n:] = 1
        else:
            attention[row, :n] = 1
    custom = np.ones((batch, length, length), bool)
    for row, spec in enumerate(specs):
        if spec.kind == MaskKind.CUSTOM:
            matrix = np.random.default_rng(spec.custom_seed).random((length, length)) < 0.5
            matrix[length // 2] = False  # a query with no allowed key: must give zeros, not NaN
            custom[row] = matrix
    feeds: dict[str, np.ndarray] = {}
    first = input_names(config)[0]
    if first == "input_ids":
        feeds[first] = rng.integers(0, config.vocab_size, (batch, length), dtype=np.int64)
    else:
        feeds[first] = rng.standard_normal((batch, length, config.d_model)).astype(np.float32)
    feeds["attention_mask"] = attention
    feeds["mask_kind"] = np.array([int(s.kind) for s in specs], np.int64)
    feeds["mask_causal"] = np.array([s.causal for s in specs], bool)
    feeds["mask_window"] = np.array([s.window for s in specs], np.int64)
    feeds["mask_step"] = np.array([s.step for s in specs], np.int64)
    feeds["custom_mask"] = custom
    if config.type_vocab_size:
        feeds["token_type_ids"] = rng.integers(0, config.type_vocab_size, (batch, length), dtype=np.int64)
    return feeds


# The long-input paths' own cases (model/attention_paths.py): windows 0, small, and past the
# sequence (the band covers everything), steps 1, small, and past the sequence (only the diagonal).
LONG_MASKS = {
    SPARSE: (
        MaskSpec(MaskKind.SLIDING_WINDOW, window=0),
        MaskSpec(MaskKind.SLIDING_WINDOW, window=2),
        MaskSpec(MaskKind.SLIDING_WINDOW, window=5, causal=True),
        MaskSpec(MaskKind.SLIDING_WINDOW, window=100),
        MaskSpec(MaskKind.DILATED, step=1),
        MaskSpec(MaskKind.DILATED, step=3),
        MaskSpec(MaskKind.DILATED, step=2, causal=True),
        MaskSpec(MaskKind.DILATED, step=100),
        MaskSpec(MaskKind.LOCAL_STRIDED, window=1, step=4),
        MaskSpec(MaskKind.LOCAL_STRIDED, window=2, step=5, causal=True),
        MaskSpec(MaskKind.LOCAL_STRIDED, window=20, step=7),
    ),
    LINEAR: (MaskSpec(MaskKind.BIDIRECTIONAL), MaskSpec(MaskKind.CAUSAL)),
}
# Rows of one batch on a long path: different kinds and windows, one step (the sparse path's rule).
LONG_MIXED = {
    SPARSE: [MaskSpec(MaskKind.SLIDING_WINDOW, window=3), MaskSpec(MaskKind.LOCAL_STRIDED, window=9, step=4, causal=True),
             MaskSpec(MaskKind.DILATED, step=4), MaskSpec(MaskKind.SLIDING_WINDOW, window=40, causal=True),
             MaskSpec(MaskKind.DILATED, step=4, causal=True), MaskSpec(MaskKind.SLIDING_WINDOW, window=0)],
    LINEAR: [MaskSpec(MaskKind.BIDIRECTIONAL), MaskSpec(MaskKind.CAUSAL)] * 3,
}


# Rows a sparse graph computes besides LONG_MASKS[SPARSE] (model/attention_paths.py path_kinds).
PLAN_MASKS = (MaskSpec(MaskKind.BIDIRECTIONAL), MaskSpec(MaskKind.CAUSAL))


@dataclass(frozen=True)
class Case:
    label: str
    feeds: dict


def validation_cases(config: EncoderConfig, *, long_length: int = 67, path: str = DENSE) -> list[Case]:
    """Shapes the export sample (batch 2, length 16) does not have — length 1, primes, longer
    than the sample, batch 1 and > 1, mixed and left padding, a fully padded row — on every mask
    kind the graph's attention path computes, plus one batch whose rows each chose a different kind
    (on a long path: different kinds and windows, one step)."""
    limit = config.position_limit or long_length
    longest = min(long_length, limit)
    shapes = [[1], [13], [5, 13, 1], [longest, 31, 0, 7]]
    specs = EVERY_MASK if path == DENSE else LONG_MASKS[path]
    if path == SPARSE:  # the sparse graph computes these rows too (its global layers in tiles)
        specs = (*specs, *PLAN_MASKS)
    cases = []
    for index, spec in enumerate(specs):
        for lengths in shapes:
            lengths = [min(n, limit) for n in lengths]
            feeds = make_feeds(config, lengths, spec, seed=index)
            cases.append(Case(f"{spec.label()} lengths={lengths}", feeds))
    mixed = list(EVERY_MASK) if path == DENSE else LONG_MIXED[path]
    lengths = [min(n, limit) for n in (3, 17, 29, 11, 23, 1, 19, 13, 7)][: len(mixed)]
    cases.append(Case("mixed kinds per row", make_feeds(config, lengths, mixed, seed=99)))
    if path == SPARSE and config.local_layers:
        rows = [MaskSpec(MaskKind.BIDIRECTIONAL), MaskSpec(MaskKind.SLIDING_WINDOW, window=2),
                MaskSpec(MaskKind.CAUSAL), MaskSpec(MaskKind.SLIDING_WINDOW, window=40, causal=True)]
        cases.append(Case("bidirectional, causal and window rows in one run",
                          make_feeds(config, [min(n, limit) for n in (29, 17, 23, 5)], rows, seed=98)))
    if MaskKind.CAUSAL in path_kinds(path, config):
        cases.append(Case(
            "causal + left padding",
            make_feeds(config, [5, 11], MaskSpec(MaskKind.CAUSAL), seed=5, left_pad=True),
        ))
    return cases
