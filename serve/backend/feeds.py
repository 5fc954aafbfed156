"""A batch's graph inputs: the one function that builds them (`pad_batch`) from validated rows.

The batcher calls it for every session.run, the backend for warm-up and the start-up probe.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from model.attention_paths import DENSE, RowMask
from model.config import EncoderConfig
from model.mask_kinds import MaskKind


@dataclass(frozen=True)
class Row:
    """One sequence of a request, as the batcher pads it into a batch."""

    inputs: np.ndarray  # int64 [T] or float32 [T, D]
    kind: int
    causal: bool
    window: int
    step: int
    custom: np.ndarray | None  # bool [T, T] for custom rows

    @functools.cached_property
    def length(self) -> int:  # read for every row at every step: kept once computed
        return int(self.inputs.shape[0])

    @property
    def mask(self) -> RowMask:
        return RowMask(MaskKind(self.kind), self.window, self.step)


def pad_batch(rows: list[Row], length: int, config: EncoderConfig, path: str = DENSE) -> dict[str, np.ndarray]:
    """The graph's inputs for `rows` on attention `path`, right-padded to `length` (padding is masked
    out). Only the dense graph takes the [B, T, T] custom mask."""
    n = len(rows)
    if config.input_kind == "tokens":
        first_name = "input_ids"
        first = np.full((n, length), config.pad_token_id, np.int64)
    else:
        first_name = "inputs_embeds"
        first = np.zeros((n, length, config.d_model), np.float32)
    attention = np.zeros((n, length), np.int64)
    custom = np.ones((n, length, length), bool) if path == DENSE else None
    for b, row in enumerate(rows):
        first[b, : row.length] = row.inputs
        attention[b, : row.length] = 1
        if row.custom is not None:
            custom[b] = False
            custom[b, : row.length, : row.length] = row.custom
    feeds = {
        first_name: first,
        "attention_mask": attention,
        "mask_kind": np.array([r.kind for r in rows], np.int64),
        "mask_causal": np.array([r.causal for r in rows], bool),
        "mask_window": np.array([r.window for r in rows], np.int64),
        "mask_step": np.array([max(r.step, 1) for r in rows], np.int64),
    }
    if custom is not None:
        feeds["custom_mask"] = custom
    if config.type_vocab_size:
        feeds["token_type_ids"] = np.zeros((n, length), np.int64)
    return feeds
