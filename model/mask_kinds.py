"""The attention mask kinds, defined once (SEEDS.md, "Mask kinds").

The exported graph takes the choice per row of a batch as small integer inputs (see MASK_INPUTS)
and builds the [B, T, T] mask inside the graph, so changing mask kind needs no re-export and no
reload. This module imports no torch: the server validates requests against it.

For query i and key j a key is allowed when pad[j] = 1 and the kind's rule holds:
  bidirectional   always
  causal          j <= i
  sliding_window  |i - j| <= window            (window >= 0)
  dilated         (i - j) % step == 0          (step >= 1; j = i always allowed)
  local_strided   |i - j| <= window or (i - j) % step == 0
  custom          a caller-given boolean [T, T] (every row) or [B, T, T]
The causal flag may be combined with sliding_window, dilated and local_strided (both must hold).
A query with no allowed key attends to nothing: its attention output is zeros, never NaN.
"""

from __future__ import annotations

import enum

import numpy as np


class MaskKind(enum.IntEnum):
    BIDIRECTIONAL = 0
    CAUSAL = 1
    SLIDING_WINDOW = 2
    DILATED = 3
    LOCAL_STRIDED = 4
    CUSTOM = 5

    @property
    def label(self) -> str:
        return self.name.lower()

    @property
    def uses_window(self) -> bool:
        return self in (MaskKind.SLIDING_WINDOW, MaskKind.LOCAL_STRIDED)

    @property
    def uses_step(self) -> bool:
        return self in (MaskKind.DILATED, MaskKind.LOCAL_STRIDED)

    @property
    def takes_causal_flag(self) -> bool:
        return self in (MaskKind.SLIDING_WINDOW, MaskKind.DILATED, MaskKind.LOCAL_STRIDED)

    @classmethod
    def parse(cls, text: str) -> "MaskKind":
        try:
            return cls[text.strip().upper().replace("-", "_")]
        except KeyError:
            raise ValueError(
                f"unknown mask kind {text!r}; expected one of {', '.join(k.label for k in cls)}"
            ) from None


# Graph inputs that carry the per-row mask choice, in graph order, with dtype and shape.
MASK_INPUTS = {
    "mask_kind": ("int64", ("batch",)),
    "mask_causal": ("bool", ("batch",)),
    "mask_window": ("int64", ("batch",)),
    "mask_step": ("int64", ("batch",)),
    "custom_mask": ("bool", ("batch", "sequence", "sequence")),
}


def allowed_keys(
    kind: MaskKind,
    length: int,
    *,
    window: int = 0,
    step: int = 1,
    causal: bool = False,
    pad: np.ndarray | None = None,
    custom: np.ndarray | None = None,
) -> np.ndarray:
    """Reference [T, T] boolean matrix of allowed (query, key) pairs for one row, in numpy.

    Written from the definitions above, independently of the torch and graph implementation,
    so tests can check one against the other.
    """
    i = np.arange(length)[:, None]
    j = np.arange(length)[None, :]
    d = i - j
    if kind == MaskKind.BIDIRECTIONAL:
        rule = np.ones((length, length), bool)
    elif kind == MaskKind.CAUSAL:
        rule = d >= 0
    elif kind == MaskKind.SLIDING_WINDOW:
        rule = np.abs(d) <= window
    elif kind == MaskKind.DILATED:
        rule = d % step == 0
    elif kind == MaskKind.LOCAL_STRIDED:
        rule = (np.abs(d) <= window) | (d % step == 0)
    elif kind == MaskKind.CUSTOM:
        rule = np.asarray(custom, bool)
    else:  # pragma: no cover - IntEnum is closed
        raise ValueError(kind)
    if causal and kind.takes_causal_flag:
        rule = rule & (d >= 0)
    if pad is not None:
        rule = rule & np.asarray(pad, bool)[None, :]
    return rule
