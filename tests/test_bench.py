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
from tests.conftest import NEEDS_NATIVE


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


@pytest.mark.parametrize("protocol, targets, rounds", [("grpc", 2, 2), ("http", 1, 1)])
def test_the_lone_call_bench_measures_each_target_in_every_round(serve_export_dir, tmp_path, protocol, targets,
                                                                 rounds):
    from bench import lone_call

    out = tmp_path / "lone.json"
    more = ["--with-flags", "--express-run-ms 0"] if targets == 2 else []
    assert lone_call.main([str(serve_export_dir), *more, "--protocol", protocol, "--rounds", str(rounds),
                           "--calls", "20", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert len(report["rounds"]) == rounds and all(len(measured) == targets for measured in report["rounds"])
    for measured in (m for r in report["rounds"] for m in r.values()):
        assert measured["p50_ms"] > 0
        # /proc counts CPU in 10 ms ticks: 20 calls on the tiny model may read 0; the threads are still named
        assert measured["cpu_us_per_call"] >= 0 and measured["threads_us_per_call"]


# --- the floor under the lone request (bench/bare_native.py): a measuring tool, but its answers must be the graph's
@NEEDS_NATIVE
@pytest.mark.parametrize("hop", [False, True], ids=["on-the-pump", "one-hop"])
def test_the_bare_floor_answers_kserve_v2_with_the_graphs_own_pooled_embedding(serve_export_dir, tmp_path, hop):
    import subprocess
    import sys

    import grpc
    import numpy as np
    import onnxruntime as ort

    from model.export_format import read_metadata
    from model.mask_kinds import MaskKind
    from serve.protocols.kserve_v2 import M
    from tests.subprocess_env import REPO, repo_env

    port_file = tmp_path / "port.json"
    args = [sys.executable, "-m", "bench.bare_native", "--export-dir", str(serve_export_dir), "--port-file",
            str(port_file)] + (["--hop"] if hop else [])
    server = subprocess.Popen(args, cwd=REPO, env=repo_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True)
    try:
        seen = []  # its lines until it listens (an early exit ends them: its error is in them)
        for line in server.stdout:
            seen.append(line)
            if "event=serving" in line:
                break
        assert "event=serving" in "".join(seen), "".join(seen)
        port = json.loads(port_file.read_text())["port"]
        ids = np.array([[5, 17, 42, 8, 99, 3], [1, 2, 3, 4, 5, 6]], np.int64)
        request = M["ModelInferRequest"](model_name="any", id="r1")
        request.inputs.add(name="input_ids", datatype="INT64", shape=list(ids.shape))
        request.raw_input_contents.append(ids.tobytes())
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer",
                                        request_serializer=lambda m: m.SerializeToString(),
                                        response_deserializer=M["ModelInferResponse"].FromString)
            answer = infer(request, timeout=60)
            with pytest.raises(grpc.RpcError) as other:
                channel.unary_unary("/inference.GRPCInferenceService/ServerLive")(b"", timeout=60)
        assert other.value.code() == grpc.StatusCode.UNIMPLEMENTED
        assert (answer.id, answer.outputs[0].name, list(answer.outputs[0].shape)) == ("r1", "embeddings", [2, 32])
        got = np.frombuffer(answer.raw_output_contents[0], "<f4").reshape(2, 32)

        # the same graph in process, its inputs written out here (every row whole, bidirectional, no custom mask)
        metadata = read_metadata(serve_export_dir)
        session = ort.InferenceSession(str(metadata.graph_file(serve_export_dir, "fp32")[0]),
                                       providers=["CPUExecutionProvider"])
        n, t = ids.shape
        feeds = {"input_ids": ids, "attention_mask": np.ones((n, t), np.int64),
                 "mask_kind": np.full(n, int(MaskKind.BIDIRECTIONAL), np.int64), "mask_causal": np.zeros(n, bool),
                 "mask_window": np.zeros(n, np.int64), "mask_step": np.ones(n, np.int64),
                 "custom_mask": np.ones((n, t, t), bool)}
        expected = session.run(["mean_pooled"], feeds)[0]
        np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5)
    finally:
        server.terminate()
        server.wait(timeout=60)  # raises TimeoutExpired if SIGTERM did not end it


# --- the padding-mask graph (bench/padding_graph.py): an experiment, but its two graphs must answer alike
def test_the_padding_mask_graph_answers_bidirectional_rows_as_the_dense_graph_with_fewer_nodes(serve_export_dir,
                                                                                               tmp_path):
    from bench.padding_graph import main as padding_graph

    out = tmp_path / "padding.json"
    assert padding_graph([str(serve_export_dir), "--shapes", "1x8,2x16", "--rounds", "1", "--runs", "2",
                          "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [(row["batch"], row["length"]) for row in result["rows"]] == [(1, 8), (2, 16)]
    for row in result["rows"]:
        assert row["max_abs_difference"] <= 1e-6
        assert row["padding_nodes"] < row["full_nodes"]
    assert result["mixed_max_abs_difference"] <= 1e-6  # rows padded inside the batch
