"""Length-sorted runs (serve/core/batch_plan.py): the planner and the per-run cost measurement."""

from __future__ import annotations

import itertools
import math

from hypothesis import given, settings
from hypothesis import strategies as st

from model.config import EncoderConfig
from serve.core.batch_plan import NEVER_SPLIT, RunCost, calibrate, plan_runs

CONFIG = EncoderConfig(d_model=32, n_heads=2, n_layers=1, d_ff=64, vocab_size=100, max_positions=256)


def _cost(overhead: float) -> RunCost:
    return RunCost.for_config(CONFIG, overhead)


def _total(runs: list[list[int]], lengths: list[int], cost: RunCost) -> float:
    return sum(cost(len(run), max(lengths[i] for i in run)) for run in runs)


def _brute_force_best(lengths: list[int], cost: RunCost) -> float:
    """Least total cost over every way to cut the sorted lengths into contiguous runs."""
    ordered = sorted(lengths)
    n = len(ordered)
    best = math.inf
    for cuts in itertools.product((False, True), repeat=n - 1):
        total, start = 0.0, 0
        for end in [i + 1 for i, cut in enumerate(cuts) if cut] + [n]:
            total += cost(end - start, ordered[end - 1])
            start = end
        best = min(best, total)
    return best


def test_equal_lengths_run_as_one_batch():
    assert plan_runs([40] * 6, _cost(0.0)) == [list(range(6))]


def test_never_split_keeps_the_batch_whole_whatever_the_lengths():
    runs = plan_runs([3, 250, 7, 190], _cost(NEVER_SPLIT))
    assert len(runs) == 1 and sorted(runs[0]) == [0, 1, 2, 3]


def test_far_apart_lengths_split_into_runs_shortest_first():
    lengths = [200, 4, 210, 5, 6, 190]
    runs = plan_runs(lengths, _cost(100.0))
    assert [sorted(lengths[i] for i in run) for run in runs] == [[4, 5, 6], [190, 200, 210]]


def test_a_large_per_run_cost_keeps_close_lengths_together():
    # splitting [20] from [24, 28] saves 2 rows x 8 tokens of padding, less than one more run costs
    lengths = [20, 24, 28]
    assert len(plan_runs(lengths, _cost(64.0))) == 1
    assert len(plan_runs(lengths, _cost(0.0))) > 1


def test_an_empty_batch_has_no_runs():
    assert plan_runs([], _cost(0.0)) == []


@settings(max_examples=200, deadline=None)
@given(lengths=st.lists(st.integers(1, 256), min_size=1, max_size=9),
       overhead=st.sampled_from([0.0, 4.0, 32.0, 500.0]))
def test_the_plan_covers_every_row_once_and_costs_the_least_possible(lengths, overhead):
    cost = _cost(overhead)
    runs = plan_runs(lengths, cost)
    assert sorted(i for run in runs for i in run) == list(range(len(lengths)))
    longest = [max(lengths[i] for i in run) for run in runs]
    assert longest == sorted(longest)  # shortest run first
    assert math.isclose(_total(runs, lengths, cost), _brute_force_best(lengths, cost), rel_tol=1e-9)


def _linear_timer(fixed_s: float, per_token_s: float):
    shape = _cost(0.0)
    return lambda rows, length: fixed_s + per_token_s * shape.work(rows, length)


def test_calibrate_recovers_the_fixed_cost_in_tokens_from_two_timings():
    measured = calibrate(_linear_timer(fixed_s=0.002, per_token_s=0.0001), CONFIG, max_rows=32)
    assert math.isclose(measured.overhead_tokens, 20.0, rel_tol=1e-6)  # 2 ms / 0.1 ms per token
    assert measured.attention_width == 2 * CONFIG.d_model + CONFIG.d_ff


def test_calibrate_never_splits_when_longer_runs_are_not_slower():
    # a launch-bound backend (a GPU on a small model): more tokens cost nothing, so splitting only adds calls
    assert calibrate(lambda rows, length: 0.001, CONFIG, max_rows=32).overhead_tokens == NEVER_SPLIT


def test_calibrate_keeps_the_shapes_within_the_model_and_the_batch_limits():
    seen = []
    small = EncoderConfig(d_model=32, n_heads=2, n_layers=1, d_ff=64, vocab_size=100, max_positions=12)
    calibrate(lambda rows, length: seen.append((rows, length)) or 0.001 * rows * length, small, max_rows=2)
    assert seen and all(rows <= 2 and length <= 12 for rows, length in seen)
