"""Length-sorted runs: one formed batch split into the session.runs that waste the least padding.

A batch is padded to its longest row, so a batch mixing a 10-token and a 250-token sequence computes
250 tokens for both. The batcher still forms batches in arrival order (FIFO: nobody is starved); this
module only decides how to *run* one: sort its rows by length and cut them into contiguous groups,
each padded to its own longest row, where the padding saved pays for the extra session.run.

The cost of one run of `rows` rows padded to `length` is modelled as

    rows * length * (1 + length / attention_width) + overhead_tokens

in token-equivalents: the per-token GEMMs (4·D·(2·D + d_ff) per layer), attention's per-token term
that grows with the length (4·L·D per layer; equal to the GEMMs at L = 2·D + d_ff), and a fixed
cost per call (graph dispatch, mask building, thread wake-ups; on a GPU, kernel launches and copies),
measured on the running backend at start (`calibrate`). `plan_runs` minimises the total exactly
(dynamic programming over the sorted lengths, O(n²) for n <= max_batch_size rows).

Padding never changes a row's result (the graph masks it out; tests/test_parity.py), so the split is
invisible to clients except in speed and in the response metadata (batch_size, batch_sequence_length).
Measured in docs/performance.md ("Length-sorted runs").
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from model.config import EncoderConfig

NEVER_SPLIT = math.inf  # overhead for a backend whose calibration showed no per-token cost


@dataclass(frozen=True)
class RunCost:
    overhead_tokens: float  # fixed cost of one session.run, in tokens of a short sequence
    attention_width: float  # the length at which attention's per-token cost equals the GEMMs'

    @classmethod
    def for_config(cls, config: EncoderConfig, overhead_tokens: float) -> "RunCost":
        return cls(overhead_tokens=overhead_tokens, attention_width=float(2 * config.d_model + config.d_ff))

    def work(self, rows: int, length: int) -> float:
        """The run's padded work in token-equivalents, without the fixed cost."""
        return rows * length * (1.0 + length / self.attention_width)

    def __call__(self, rows: int, length: int) -> float:
        return self.work(rows, length) + self.overhead_tokens


def plan_runs(lengths: Sequence[int], cost: RunCost) -> list[list[int]]:
    """Indices into `lengths`, grouped into runs (shortest rows first) of least total `cost`.

    One group (the whole batch) when splitting does not pay, e.g. when all lengths are equal or the
    overhead is NEVER_SPLIT.
    """
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    n = len(order)
    if n <= 1 or math.isinf(cost.overhead_tokens):
        return [order] if order else []
    # A run only ends after the last row of a length: rows of one length share a run (splitting them
    # adds a run's fixed cost and saves no padding), so the search is over distinct lengths only.
    ends = [j for j in range(1, n + 1) if j == n or lengths[order[j]] != lengths[order[j - 1]]]
    if len(ends) == 1:
        return [order]
    best = {0: 0.0}  # best[j]: least cost of running the j shortest rows
    cut = {}
    starts = [0]
    for j in ends:
        longest = lengths[order[j - 1]]
        best[j], cut[j] = min((best[i] + cost(j - i, longest), i) for i in starts)
        starts.append(j)
    runs: list[list[int]] = []
    j = n
    while j:
        runs.append(order[cut[j]:j])
        j = cut[j]
    return runs[::-1]


def calibrate(time_run: Callable[[int, int], float], config: EncoderConfig, *, max_rows: int,
              repeats: int = 3) -> RunCost:
    """The RunCost of a backend, from the best of `repeats` timings of two shapes.

    `time_run(rows, length)` runs one dummy batch and returns its seconds. From a short and a longer
    shape: seconds per token-equivalent = difference in time / difference in work, and the fixed
    cost = the short run's time minus its work. A backend whose longer run is not slower (a GPU on a
    small model is launch-bound) gets NEVER_SPLIT: there, splitting would only add calls.
    """
    short = (1, min(16, config.max_positions))
    long = (max(1, min(4, max_rows)), min(128, config.max_positions))
    shape = RunCost.for_config(config, 0.0)
    seconds = {s: min(time_run(*s) for _ in range(repeats)) for s in (short, long)}
    extra_work = shape.work(*long) - shape.work(*short)
    per_token = (seconds[long] - seconds[short]) / extra_work if extra_work > 0 else 0.0
    if per_token <= 0:
        return RunCost.for_config(config, NEVER_SPLIT)
    overhead = max(0.0, seconds[short] / per_token - shape.work(*short))
    return RunCost.for_config(config, overhead)


def timer(run: Callable[[int, int], object]) -> Callable[[int, int], float]:
    """`run(rows, length)` wrapped to return its wall seconds (for `calibrate`)."""

    def timed(rows: int, length: int) -> float:
        started = time.perf_counter()
        run(rows, length)
        return time.perf_counter() - started

    return timed
