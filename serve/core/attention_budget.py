"""Which attention path each row runs on, and the memory budget that keeps long inputs from an OOM kill.

Each row runs on the cheapest attention path the export has that computes its mask kind exactly
(model/attention_paths.py): a 32k-token sliding-window row on the sparse graph, a bidirectional row on
the dense one, unless the dense one would not fit the budget and the sparse one, which holds its global
layers' scores in tiles, does (a 32k-token causal row of a decoder embedder). A request is admitted only
if its attention fits `max_attention_bytes` (estimated
from rows, lengths, paths, heads); one that does not gets RESOURCE_EXHAUSTED naming the limit and the
mask kinds that would fit, and the server goes on serving. The batcher never forms a batch whose
estimate exceeds the budget, so two admitted requests cannot add up past it either.

On CUDA two more things hold (docs/long-inputs.md, "On CUDA"): a plan's global layer holds all T² scores of
a bidirectional row (ONNX Runtime's CUDA MultiHeadAttention runs its unfused kernel for our head width),
and no attention tensor may pass CUDA_MAX_ELEMENTS: the kernels index with 32-bit integers, and one past
it ended in an illegal memory access that leaves the process's CUDA context unusable (ModernBERT-base
at 16k on an H200). A request past it is refused RESOURCE_EXHAUSTED naming the limit, and the batcher
never forms a run past it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from model.attention_paths import DENSE, MAX_SEQUENCE, RowMask, attention_bytes, cheapest, computes, score_elements
from model.config import EncoderConfig
from model.host_memory import memory_limit as available_memory  # the one reading of the cgroup
from model.mask_kinds import MaskKind
from serve.backend.session import CUDA
from serve.errors import TooLarge

# The share of the memory this process may use that attention may take by default.
DEFAULT_SHARE = 0.5
# What a client is told would fit, when its own request does not say (ModernBERT's local window).
EXAMPLE_WINDOW, EXAMPLE_STEP = 128, 64
MEMO_SIZE = 4096  # remembered (length, mask) answers; cleared when full
# The most elements one attention tensor may hold on CUDA: ONNX Runtime's CUDA kernels index with int32.
CUDA_MAX_ELEMENTS = (1 << 31) - 1


def default_budget() -> int:
    return int(available_memory() * DEFAULT_SHARE)


def gib(n: float) -> str:
    return f"{n / (1 << 30):.2f} GiB" if n >= (1 << 28) else f"{n / (1 << 20):.1f} MiB"


@dataclass(frozen=True)
class AttentionBudget:
    config: EncoderConfig
    paths: tuple[str, ...]  # the attention paths the backend has a graph for
    max_bytes: int
    # CUDA: the most elements one attention tensor of a run may hold (CUDA_MAX_ELEMENTS), and the fused
    # global layer holds its T² scores; 0: the CPU (no such bound, the fused kernel runs in tiles)
    max_elements: int = 0
    # (length, kind, window, step) -> (path, bytes): each row of every request asks, on the hot path
    _memo: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @classmethod
    def for_device(cls, config: EncoderConfig, paths: tuple[str, ...], max_bytes: int, provider: str):
        """The budget of a model whose sessions run on `provider` (BackendInfo.execution_provider)."""
        return cls(config, paths, max_bytes, CUDA_MAX_ELEMENTS if provider == CUDA else 0)

    def _row(self, length: int, mask: RowMask) -> tuple[str, int]:
        """(path, attention bytes) of one row of `length` under `mask`, remembered."""
        key = (length, mask)
        found = self._memo.get(key)
        if found is None:
            path = cheapest(length, mask, self.config, self.paths)
            found = (path, self._bytes(path, length, mask))
            if found[1] > self.max_bytes:  # the cheapest does not fit: an exact path that holds less (in tiles)
                held = min((self._bytes(other, length, mask), other) for other in self.paths
                           if computes(other, mask.kind, self.config))
                if held[0] < found[1]:
                    found = (held[1], held[0])
            if len(self._memo) >= MEMO_SIZE:
                self._memo.clear()
            self._memo[key] = found
        return found

    def _bytes(self, path: str, length: int, mask: RowMask) -> int:
        return attention_bytes(path, 1, length, mask, self.config, fused_tiles=not self.max_elements)

    def path(self, length: int, mask: RowMask) -> str:
        return self._row(length, mask)[0]

    def plan(self, lengths: np.ndarray, mask: RowMask) -> tuple[int, tuple[tuple[str, np.ndarray], ...]]:
        """The estimated attention bytes of rows of `lengths` under `mask`, and the rows grouped by
        the path each runs on (Rows.paths; () when every row runs dense): asked once per distinct length."""
        first = int(lengths[0])
        if len(lengths) == 1 or (lengths == first).all():
            path, size = self._row(first, mask)
            return size * len(lengths), (() if path == DENSE else ((path, np.arange(len(lengths))),))
        distinct, where = np.unique(lengths, return_inverse=True)
        found = [self._row(int(length), mask) for length in distinct]
        total = int(sum(size * count for (_, size), count in zip(found, np.bincount(where))))
        by_path: dict[str, list[int]] = {}
        for k, (path, _) in enumerate(found):
            by_path.setdefault(path, []).append(k)
        if list(by_path) == [DENSE]:
            return total, ()
        return total, tuple((path, np.flatnonzero(np.isin(where, ks))) for path, ks in by_path.items())

    def check(self, lengths: np.ndarray, mask: RowMask) -> tuple[int, tuple[tuple[str, np.ndarray], ...]]:
        """`plan(lengths, mask)`; TooLarge (RESOURCE_EXHAUSTED) when the request is over the budget."""
        total, paths = self.plan(lengths, mask)
        length, n = int(lengths[0]) if len(lengths) == 1 else int(lengths.max()), len(lengths)
        if total <= self.max_bytes:
            elements = n * self.row_elements(length, mask)  # the request's rows run as one block of `length`
            if self.max_elements and elements > self.max_elements:
                raise TooLarge(
                    f"sequences: attention for {f'{n} sequences, ' if n > 1 else ''}{mask.kind.label} at T={length} "
                    f"on the {self.path(length, mask)} path holds {elements} scores in one tensor, over the "
                    f"{self.max_elements} that ONNX Runtime's CUDA kernels index (32-bit); send fewer or shorter "
                    f"sequences, or a sliding_window / local_strided mask"
                )
            return total, paths
        fits = [kind.label for kind in MaskKind if kind != mask.kind and self._fits(kind, mask, length, n)]
        hint = (f"; at this length {', '.join(fits)} fit (sliding window {self._example(mask)[0]}, "
                f"step {self._example(mask)[1]})" if fits else "; send fewer or shorter sequences")
        many = f"{n} sequences, " if n > 1 else ""
        raise TooLarge(
            f"sequences: attention for {many}{mask.kind.label} at T={length} on the {self.path(length, mask)} path "
            f"needs about {gib(total)}, over max_attention_bytes={self.max_bytes} ({gib(self.max_bytes)}){hint}"
        )

    def row_elements(self, length: int, mask: RowMask) -> int:
        """Elements of the largest attention tensor one row of `length` holds on this device (0 where
        nothing bounds them: the CPU)."""
        if not self.max_elements:
            return 0
        path = self.path(length, mask)
        return int(score_elements(path, length, mask, self.config, peak=True, fused_tiles=False) * self.config.n_heads)

    def _example(self, mask: RowMask) -> tuple[int, int]:
        return (mask.window if mask.kind.uses_window else EXAMPLE_WINDOW,
                mask.step if mask.kind.uses_step and mask.step > 1 else EXAMPLE_STEP)

    def _fits(self, kind: MaskKind, mask: RowMask, length: int, rows: int) -> bool:
        window, step = self._example(mask)
        return self._admits(rows, length, RowMask(kind, window, step))

    def _admits(self, rows: int, length: int, mask: RowMask) -> bool:
        """Whether `rows` rows of `length` under `mask` fit the bytes and, on CUDA, the elements bound."""
        _, size = self._row(length, mask)
        return rows * size <= self.max_bytes and (
            not self.max_elements or rows * self.row_elements(length, mask) <= self.max_elements)

    def max_length(self) -> int:
        """The longest single row that fits on the cheapest path of any kind (shown as max_sequence_length)."""

        def fits(length: int) -> bool:
            for kind in MaskKind:
                mask = RowMask(kind, 0, length)
                if computes(self.path(length, mask), kind, self.config) and self._admits(1, length, mask):
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

