"""`python -m bench --quick` runs end to end (model and server) and writes well-formed JSON.

No timing is asserted: numbers on a shared test machine say nothing; docs/performance.md has a
real run.
"""

from __future__ import annotations

import json

from bench.__main__ import main


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
        assert server["throughput"][mode]["requests"] > 0
        assert server["throughput"][mode]["errors"] == 0
    assert len(server["memory"]["checkpoints"]) == 2
    for mode in ("split", "one_run"):  # mixed lengths: length-sorted runs vs one padded run per batch
        assert server["mixed_lengths"][mode]["requests"] > 0 and server["mixed_lengths"][mode]["errors"] == 0
    assert {t["target"] for t in report["targets"]} >= {"int8_vs_ort_fp32@8x256", "rss_growth_1k_to_20k"}
    assert "targets:" in capsys.readouterr().out
