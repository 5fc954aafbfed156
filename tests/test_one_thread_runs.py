"""Runs too small to share their work take a 1-thread session (serve/backend/session.py: session_plan,
one_thread_below, OnnxRuntimeBackend.calibrate_one_thread and session_for)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from serve.backend.export_dir import load_export
from serve.core.batch_plan import RunCost
from serve.backend.session import (ONE_THREAD_MAX_GRAPH_BYTES, OnnxRuntimeBackend, dummy_batch, one_thread_below,
                                   session_plan)

CPUS = len(os.sched_getaffinity(0))
several_cpus = pytest.mark.skipif(CPUS < 2, reason="one CPU: every session has one thread already")


def test_no_run_takes_one_thread_when_it_is_not_faster_at_the_smallest_shape():
    assert one_thread_below([(18.0, -1e-5), (1024.0, 2e-4)]) == 0.0
    assert one_thread_below([(18.0, 0.0)]) == 0.0
    assert one_thread_below([]) == 0.0


def test_the_threshold_is_where_the_gain_of_one_thread_falls_to_zero_between_two_shapes():
    # +0.05 ms at 18, +0.01 ms at 1024, -0.03 ms at 6144: zero a quarter of the way from 1024 to 6144
    assert one_thread_below([(18.0, 5e-5), (1024.0, 1e-5), (6144.0, -3e-5)]) == pytest.approx(1024 + 5120 / 4)
    assert one_thread_below([(18.0, 4e-5), (1024.0, -4e-5)]) == pytest.approx(18 + 1006 / 2)


def test_the_threshold_is_never_past_the_largest_shape_measured():
    assert one_thread_below([(18.0, 5e-5), (1024.0, 1e-5), (6144.0, 1e-6)]) == 6144.0


def test_the_session_plan_adds_a_one_thread_session_only_for_a_small_graph_on_several_cpus_by_default():
    small, big = 1 << 20, ONE_THREAD_MAX_GRAPH_BYTES + 1
    plan = session_plan("cpu", 0, 1, small, 8)
    assert (plan.threads, plan.wide, plan.separate_one_thread, plan.copies) == (8, False, True, 2)
    assert session_plan("cpu", 0, 1, big, 8).copies == 1  # a big graph: its weights once
    assert not session_plan("cpu", 4, 1, small, 8).one_thread_runs  # --intra-op-threads: every run on 4
    assert not session_plan("cuda", 0, 1, small, 8).one_thread_runs
    assert not session_plan("cpu", 0, 1, small, 1).one_thread_runs
    # instances split the CPUs: a wide session for lone batches, and the narrow one is the 1-thread one
    plan = session_plan("cpu", 0, 8, small, 8)
    assert (plan.threads, plan.wide, plan.one_thread_runs, plan.separate_one_thread, plan.copies) == (1, True, True,
                                                                                                      False, 2)
    assert session_plan("cpu", 0, 2, small, 8).copies == 3  # narrow (4 threads), wide (8) and one thread


@several_cpus
def test_a_run_below_the_threshold_takes_the_one_thread_session_and_answers_as_the_others(serve_export_dir):
    backend = OnnxRuntimeBackend(load_export(serve_export_dir))
    assert backend.one_thread is not None and backend.one_thread is not backend.session
    assert backend.one_thread.get_session_options().intra_op_num_threads == 1
    assert backend.session.get_session_options().intra_op_num_threads == CPUS
    small, large = dummy_batch(backend.config, 1, 16), dummy_batch(backend.config, 2, 16)
    assert backend.session_for(small) is backend.session  # not calibrated: no run takes it
    work = RunCost.for_config(backend.config, 0.0).work
    backend.use_one_thread_below(work(2, 16), work)  # (1, 16) is below, (2, 16) is not
    assert backend.session_for(small) is backend.one_thread
    assert backend.session_for(small, wide=True) is backend.one_thread
    assert backend.session_for(large) is backend.session
    ids = np.random.default_rng(0).integers(1, backend.config.vocab_size, (1, 16))
    small["input_ids"] = ids
    answer = backend.encode(small)
    multi = backend.session.run(list(backend.outputs), small)
    for got, want in zip(answer, multi):
        np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)


@several_cpus
def test_calibration_sets_a_threshold_within_the_shapes_it_measured_or_drops_the_session(serve_export_dir):
    backend = OnnxRuntimeBackend(load_export(serve_export_dir))
    work = RunCost.for_config(backend.config, 0.0).work
    below = backend.calibrate_one_thread(work)
    limit = backend.config.position_limit  # 128: the largest shape measured is (8, 128)
    assert 0.0 <= below <= work(8, limit)
    assert backend.one_thread_below == below
    assert (backend.one_thread is None) == (below == 0.0)


def test_a_pinned_thread_count_loads_no_one_thread_session(serve_export_dir):
    backend = OnnxRuntimeBackend(load_export(serve_export_dir), intra_op_threads=1)
    assert backend.one_thread is None
    assert backend.calibrate_one_thread(RunCost.for_config(backend.config, 0.0).work) == 0.0
    assert backend.session_for(dummy_batch(backend.config, 1, 4)) is backend.session
