"""`python -m bench --quick` runs end to end (model and server) and writes well-formed JSON.

No timing is asserted: numbers on a shared test machine say nothing; docs/performance.md has a
real run.
"""

from __future__ import annotations

import json

import pytest

from bench import engine_cost
from bench.__main__ import main
from bench.server_bench import split_cpu


def test_quick_bench_runs_and_writes_well_formed_json(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["--quick", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["format"] == "encoder-bench/1" and report["quick"] is True
    assert report["matmul_gflops"] > 0
    engines = {row["engine"] for row in report["model"]}
    assert {"torch-eager", "ort-fp32", "ort-optimized", "ort-int8"} <= engines
    for row in report["model"]:
        assert row["median_ms"] > 0 and row["gflops_per_s"] > 0 and row["runs"] >= 1
    server = report["server"]
    assert server["latency"]["server"]["n"] > 0 and server["latency"]["in_process"]["n"] > 0
    assert server["latency"]["bare_grpc"]["n"] > 0  # the gRPC-in-Python floor, measured beside them
    for mode in ("batching_on", "batching_off"):
        load = server["throughput"][mode]
        assert load["requests"] > 0
        assert load["errors"] == 0
        # the evidence every server test carries (issue 13): rows per session.run, CPU per request split
        assert 1.0 <= load["rows_per_run"] <= (32 if mode == "batching_on" else 1)
        # (/proc counts CPU in 10 ms ticks: the quick run's few requests on the tiny model, with ONNX Runtime's
        # threads no longer spinning, may read 0 on both sides; a real run's figures: docs/performance.md)
        assert load["front_cpu_ms_per_request"] >= 0 and load["model_cpu_ms_per_request"] >= 0
    assert len(server["memory"]["checkpoints"]) == 2
    for mode in ("split", "one_run"):  # mixed lengths: length-sorted runs vs one padded run per batch
        assert server["mixed_lengths"][mode]["requests"] > 0 and server["mixed_lengths"][mode]["errors"] == 0
        assert server["mixed_lengths"][mode]["front_cpu_ms_per_request"] >= 0
    assert {t["target"] for t in report["targets"]} >= {"int8_vs_ort_fp32@8x256", "rss_growth_1k_to_20k"}
    assert "targets:" in capsys.readouterr().out


def test_server_cpu_splits_into_the_busiest_startup_threads_as_model_and_the_rest_as_front_end():
    before = {1: 0.0, 2: 1.0, 3: 0.0, 4: 0.5}
    after = {1: 0.1, 2: 3.0, 3: 1.5, 4: 0.6, 9: 0.7}  # 9: a handler thread started under load
    front, model = split_cpu(before, after, startup=frozenset({1, 2, 3, 4}), model_threads=2)
    assert model == pytest.approx(2.0 + 1.5)  # threads 2 and 3
    assert front == pytest.approx(0.1 + 0.1 + 0.7)  # 1, 4 and the new thread 9


def test_the_engine_cost_bench_runs_the_real_engine_and_answers_every_request(serve_export_dir, tmp_path):
    out = tmp_path / "engine.json"
    assert engine_cost.main(["--export-dir", str(serve_export_dir), "--front-ends", "1", "--outstanding", "4",
                             "--rounds", "1", "--seconds", "1", "--run-ms", "0.2", "--out", str(out)]) == 0
    (measured,) = json.loads(out.read_text())["rounds"]
    assert measured["requests_per_s"] > 0 and measured["failed"] == 0
    assert 1 <= measured["rows_per_run"] <= 4  # at most the requests in flight
    assert {"engine-service", "engine-outbox", "batcher-0"} <= set(measured["by_thread_us"])
