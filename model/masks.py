"""Builds the [B, T, T] allowed-keys matrix from the per-row mask inputs, in torch.

This code is traced into the exported graph: the server sends a few integers per row and the
graph expands them. The rules are the ones in `model.mask_kinds` (documented there).
"""

from __future__ import annotations

import torch

from model.mask_kinds import MaskKind


def build_allowed(
    attention_mask: torch.Tensor,  # (B, T) int, 1 = real token
    mask_kind: torch.Tensor,  # (B,) int64, a MaskKind code per row
    mask_causal: torch.Tensor,  # (B,) bool
    mask_window: torch.Tensor,  # (B,) int64
    mask_step: torch.Tensor,  # (B,) int64, >= 1
    custom_mask: torch.Tensor,  # (B, T, T) bool
) -> torch.Tensor:
    """Returns (B, T, T) bool: allowed[b, i, j] is True when query i of row b may see key j."""
    length = attention_mask.shape[1]
    pos = torch.arange(length, device=attention_mask.device)
    d = (pos[:, None] - pos[None, :])[None]  # (1, T, T): i - j
    kind = mask_kind[:, None, None]  # (B, 1, 1)
    window = mask_window[:, None, None]
    step = torch.clamp(mask_step, min=1)[:, None, None]

    causal_rule = d >= 0
    local = d.abs() <= window  # (B, T, T)
    # (i - j) % step == 0  <=>  i % step == j % step: B x T remainders, not B x T x T (integer division
    # has no vector instruction; the [B, T, T] int64 remainder was 4 % of the graph at (8, 256)).
    residue = torch.remainder(pos[None, :], step[:, :, 0])  # (B, T)
    dilated = residue[:, :, None] == residue[:, None, :]  # (B, T, T)

    # A sum of products over the kinds (bool `where` has no ONNX Runtime CPU kernel).
    rule = (
        (kind == MaskKind.BIDIRECTIONAL)
        | ((kind == MaskKind.CAUSAL) & causal_rule)
        | ((kind == MaskKind.SLIDING_WINDOW) & local)
        | ((kind == MaskKind.DILATED) & dilated)
        | ((kind == MaskKind.LOCAL_STRIDED) & (local | dilated))
        | ((kind == MaskKind.CUSTOM) & custom_mask.to(torch.bool))
    )  # (B, T, T)

    flag = mask_causal.to(torch.bool)[:, None, None] & (kind >= MaskKind.SLIDING_WINDOW) & (
        kind <= MaskKind.LOCAL_STRIDED
    )
    rule = rule & (causal_rule | ~flag)
    return rule & (attention_mask[:, None, :] != 0)


def default_mask_inputs(
    attention_mask: torch.Tensor, kind: MaskKind = MaskKind.BIDIRECTIONAL, *,
    window: int = 0, step: int = 1, causal: bool = False, custom: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Mask inputs choosing one kind for every row (a convenience for callers and tests)."""
    batch, length = attention_mask.shape
    if custom is None:
        custom = torch.ones(batch, length, length, dtype=torch.bool)
    elif custom.dim() == 2:
        custom = custom.to(torch.bool).expand(batch, length, length).contiguous()
    return {
        "mask_kind": torch.full((batch,), int(kind), dtype=torch.int64),
        "mask_causal": torch.full((batch,), bool(causal), dtype=torch.bool),
        "mask_window": torch.full((batch,), int(window), dtype=torch.int64),
        "mask_step": torch.full((batch,), int(step), dtype=torch.int64),
        "custom_mask": custom.to(torch.bool),
    }


def within_window(length: int, window: int, device: torch.device | None = None) -> torch.Tensor:
    """(T, T) bool: |i - j| <= window (a local layer's pattern in the attention plan)."""
    pos = torch.arange(length, device=device)
    return (pos[:, None] - pos[None, :]).abs() <= window
