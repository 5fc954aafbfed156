"""Which attention path each row runs on, and the memory budget that keeps long inputs from an OOM kill.

Each row runs on the cheapest attention path the export has that computes its mask kind exactly
(model/attention_paths.py): a 32k-token sliding-window row on the sparse graph, a bidirectional row on
the dense one. A request is admitted only if its attention fits `max_attention_bytes` (estimated
from rows, lengths, paths, heads); one that does not gets RESOURCE_EXHAUSTED naming the limit and the
mask kinds that would fit, and the server goes on serving. The batcher never forms a batch whose
estimate exceeds the budget, so two admitted requests cannot add up past it either.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from model.attention_paths import MAX_SEQUENCE, RowMask, attention_bytes, cheapest, computes
from model.config import EncoderConfig
from model.host_memory import memory_limit as available_memory  # the one reading of the cgroup
from model.mask_kinds import MaskKind
from serve.errors import TooLarge

# The share of the memory this process may use that attention may take by default.
DEFAULT_SHARE = 0.5
# What a client is told would fit, when its own request does not say (ModernBERT's local window).
EXAMPLE_WINDOW, EXAMPLE_STEP = 128, 64
MEMO_SIZE = 4096  # remembered (length, mask) answers; cleared when full


def default_budget() -> int:
    return int(available_memory() * DEFAULT_SHARE)


def gib(n: float) -> str:
    return f"{n / (1 << 30):.2f} GiB" if n >= (1 << 28) else f"{n / (1 << 20):.1f} MiB"


@dataclass(frozen=True)
class AttentionBudget:
    config: EncoderConfig
    paths: tuple[str, ...]  # the attention paths the backend has a graph for
    max_bytes: int
    # (length, kind, window, step) -> (path, bytes): each row of every request asks, on the hot path
    _memo: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def _row(self, length: int, mask: RowMask) -> tuple[str, int]:
        """(path, attention bytes) of one row of `length` under `mask`, remembered."""
        key = (length, mask)
        found = self._memo.get(key)
        if found is None:
            path = cheapest(length, mask, self.config, self.paths)
            found = (path, attention_bytes(path, 1, length, mask, self.config))
            if len(self._memo) >= MEMO_SIZE:
                self._memo.clear()
            self._memo[key] = found
        return found

    def path(self, length: int, mask: RowMask) -> str:
        return self._row(length, mask)[0]

    def plan(self, lengths: np.ndarray, mask: RowMask) -> tuple[int, tuple[tuple[str, np.ndarray], ...]]:
        """The estimated attention bytes of rows of `lengths` under `mask`, and the rows grouped by
        the path each runs on (Rows.paths): asked once per distinct length."""
        first = int(lengths[0])
        if len(lengths) == 1 or (lengths == first).all():
            path, size = self._row(first, mask)
            return size * len(lengths), ((path, np.arange(len(lengths))),)
        distinct, where = np.unique(lengths, return_inverse=True)
        found = [self._row(int(length), mask) for length in distinct]
        total = int(sum(size * count for (_, size), count in zip(found, np.bincount(where))))
        by_path: dict[str, list[int]] = {}
        for k, (path, _) in enumerate(found):
            by_path.setdefault(path, []).append(k)
        return total, tuple((path, np.flatnonzero(np.isin(where, ks))) for path, ks in by_path.items())

    def check(self, lengths: np.ndarray, mask: RowMask) -> tuple[int, tuple[tuple[str, np.ndarray], ...]]:
        """`plan(lengths, mask)`; TooLarge (RESOURCE_EXHAUSTED) when the request is over the budget."""
        total, paths = self.plan(lengths, mask)
        if total <= self.max_bytes:
            return total, paths
        length, n = int(lengths.max()), len(lengths)
        fits = [kind.label for kind in MaskKind if kind != mask.kind and self._fits(kind, mask, length, n)]
        hint = (f"; at this length {', '.join(fits)} fit (sliding window {self._example(mask)[0]}, "
                f"step {self._example(mask)[1]})" if fits else "; send fewer or shorter sequences")
        many = f"{n} sequences, " if n > 1 else ""
        raise TooLarge(
            f"sequences: attention for {many}{mask.kind.label} at T={length} on the {self.path(length, mask)} path "
            f"needs about {gib(total)}, over max_attention_bytes={self.max_bytes} ({gib(self.max_bytes)}){hint}"
        )

    def _example(self, mask: RowMask) -> tuple[int, int]:
        return (mask.window if mask.kind.uses_window else EXAMPLE_WINDOW,
                mask.step if mask.kind.uses_step and mask.step > 1 else EXAMPLE_STEP)

    def _fits(self, kind: MaskKind, mask: RowMask, length: int, rows: int) -> bool:
        window, step = self._example(mask)
        other = RowMask(kind, window, step)
        path = cheapest(length, other, self.config, self.paths)
        return rows * attention_bytes(path, 1, length, other, self.config) <= self.max_bytes

    def max_length(self) -> int:
        """The longest single row that fits on the cheapest path of any kind (shown as max_sequence_length)."""

        def fits(length: int) -> bool:
            for kind in MaskKind:
                mask = RowMask(kind, 0, length)
                path = cheapest(length, mask, self.config, self.paths)
                if computes(path, kind, self.config) and attention_bytes(path, 1, length, mask, self.config) <= self.max_bytes:
                    return True
            return False

        return longest(fits, MAX_SEQUENCE)


def longest(fits, high: int) -> int:
    """The largest length in [0, high] that `fits` (the lengths that fit form a prefix)."""
    low = 0
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return low

