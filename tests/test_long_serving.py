"""Long inputs end to end: the real server (subprocess, 127.0.0.1) picks each row's attention path,
answers long sparse requests equal to the dense PyTorch encoder, and refuses what would not fit its
memory budget with RESOURCE_EXHAUSTED while it keeps serving (serve/core/attention_budget.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from export.contract import FP32_TOLERANCE
from model.mask_kinds import MaskKind
from client import EncoderClient, build_request
from tests.concurrency import call_concurrently

ATOL = FP32_TOLERANCE["limit"]
# a 4096-token bidirectional row of the tiny model does not fit the dense graph (~1.9 GiB) but fits the sparse one
# (in tiles); a 65,536-token one fits neither, a window row of that length does
BUDGET = 256 * 1024 * 1024


@pytest.fixture(scope="module")
def server(serve_start, serve_long_export_dir):
    return serve_start(serve_long_export_dir, "--max-attention-bytes", str(BUDGET),
                       "--max-response-bytes", str(4 * 1024 * 1024))


@pytest.fixture(scope="module")
def reference(reference_for, serve_long_export_dir):
    return reference_for(serve_long_export_dir)


def _ids(length: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, 97, length)


def test_a_long_sliding_window_request_runs_sparse_and_equals_pytorch(server, reference):
    ids = _ids(3000)
    with EncoderClient(server.target, timeout=120) as client:
        response = client.stub.Encode(build_request([ids], mask="sliding_window", window=16, hidden_states=True),
                                      timeout=120)
    assert list(response.metadata.attention_paths) == ["sparse"]
    hidden, pooled = reference(ids, MaskKind.SLIDING_WINDOW, window=16)
    from client import parse_response

    out = parse_response(response)
    np.testing.assert_allclose(out.hidden_states[0], hidden, atol=ATOL, rtol=0)
    np.testing.assert_allclose(out.embeddings[0], pooled, atol=ATOL, rtol=0)


def test_requests_of_different_kinds_at_once_each_take_their_path_and_equal_pytorch(server, reference):
    """Formed into one batch, the rows split between the dense and sparse graphs (and by step)."""
    asks = [("bidirectional", {}), ("sliding_window", {"window": 5}), ("dilated", {"step": 3}),
            ("local_strided", {"window": 2, "step": 7}), ("causal", {}), ("dilated", {"step": 4, "causal": True})]
    ids = [_ids(300 + 37 * i, seed=i) for i in range(len(asks))]

    def call(i: int):
        kind, params = asks[i]
        with EncoderClient(server.target, timeout=120) as client:
            return client.stub.Encode(build_request([ids[i]], mask=kind, **params), timeout=120)

    responses = call_concurrently(call, len(asks), timeout=180)
    for i, ((kind, params), response) in enumerate(zip(asks, responses)):
        assert response is not None, f"request {i} ({kind}) failed"
        want = "dense" if kind in ("bidirectional", "causal") else "sparse"
        assert list(response.metadata.attention_paths) == [want], kind
        _, pooled = reference(ids[i], MaskKind.parse(kind), window=params.get("window", 0),
                              step=params.get("step", 1), causal=params.get("causal", False))
        got = np.frombuffer(response.results[0].embedding.data, np.float32)
        np.testing.assert_allclose(got, pooled, atol=ATOL, rtol=0, err_msg=kind)


@pytest.mark.parametrize("kind", ["bidirectional", "causal"])
def test_a_row_the_dense_graph_cannot_hold_runs_sparse_in_tiles_and_equals_pytorch(server, reference, kind):
    """4096 tokens: the dense graph's T x T scores (~1.9 GiB) are over the budget; the sparse graph holds its
    global layers' scores in tiles (the fused kernel, the query-tile Loop), so the row is served there."""
    ids = _ids(4096, seed=5)
    with EncoderClient(server.target, timeout=300) as client:
        response = client.stub.Encode(build_request([ids], mask=kind), timeout=300)
    assert list(response.metadata.attention_paths) == ["sparse"]
    _, pooled = reference(ids, MaskKind.parse(kind))
    np.testing.assert_allclose(np.frombuffer(response.results[0].embedding.data, np.float32), pooled, atol=ATOL, rtol=0)


def test_an_over_budget_request_gets_resource_exhausted_naming_the_limit_and_what_fits(server):
    """A custom mask runs on the dense graph only: at 2048 tokens its T x T scores (~0.5 GiB) are over the
    budget, and the refusal names the kinds that fit at that length (on the sparse graph)."""
    custom = np.ones((2048, 2048), bool)
    with EncoderClient(server.target, retries=0, timeout=300) as client:
        with pytest.raises(grpc.RpcError) as refused:
            client.encode([_ids(2048)], mask="custom", custom=custom)
        # the server stays up and serves the same length on a kind that fits
        out = client.encode([_ids(2048)], mask="sliding_window", window=8)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    message = refused.value.details()
    assert f"max_attention_bytes={BUDGET}" in message and "T=2048" in message
    assert "sliding_window" in message and "bidirectional" in message
    assert out.embeddings[0].shape == (32,) and np.isfinite(out.embeddings[0]).all()
    with grpc.insecure_channel(server.target) as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
    assert health.status == health_pb2.HealthCheckResponse.SERVING


def test_rows_that_fit_alone_are_refused_together_naming_their_count(server):
    """Eight 4096-token bidirectional rows: each fits the sparse graph's tiles, together they pass the budget."""
    with EncoderClient(server.target, retries=0, timeout=300) as client:
        with pytest.raises(grpc.RpcError) as refused:
            client.encode([_ids(4096, seed=i) for i in range(8)], mask="bidirectional")
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "8 sequences" in refused.value.details() and f"max_attention_bytes={BUDGET}" in refused.value.details()


def test_model_info_reports_the_attention_budget_and_the_length_it_allows(server):
    with EncoderClient(server.target) as client:
        limits = client.model_info().limits
    assert limits.max_attention_bytes == BUDGET
    # sinusoidal positions: no table limit, the budget decides (a window-0 row of this length fits)
    assert 32768 < limits.max_sequence_length < 1 << 20


def test_hidden_states_over_the_response_limit_are_refused_with_the_way_out(server):
    with EncoderClient(server.target, retries=0) as client:
        with pytest.raises(grpc.RpcError) as refused:
            client.encode([_ids(40_000)], mask="sliding_window", window=4, hidden_states=True)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "max_response_bytes=4194304" in refused.value.details()
    assert "hidden_states=false" in refused.value.details()


def test_the_path_metric_counts_rows_per_attention_path(server):
    with EncoderClient(server.target) as client:
        client.encode([_ids(2000)], mask="sliding_window", window=3)
    metrics = server.metrics()
    sparse = [line for line in metrics.splitlines() if line.startswith('encoder_attention_path_rows_total{path="sparse"}')]
    assert sparse and float(sparse[0].split()[-1]) >= 1


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="GLIBC_TUNABLES: Linux only")
def test_the_server_runs_with_malloc_on_transparent_huge_pages(server):
    """serve/__main__.py re-execs itself once so glibc's malloc madvises huge pages on its large chunks
    (the 32k/4k cost step of the long-input graphs); same process id."""
    environ = Path(f"/proc/{server.proc.pid}/environ").read_bytes().split(b"\0")
    assert b"GLIBC_TUNABLES=glibc.malloc.hugetlb=1" in environ
