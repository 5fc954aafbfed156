"""The native KServe v2 lane (`--kserve-native-port`: serve/native_lane.py, native/kserve_lane.cc) on a
real server subprocess, called with the real tritonclient. tests/test_kserve_v2.py runs the whole v2
protocol on both ports; these are what the lane adds: batching in C++, the fast and slow paths giving
the same answers, and a drain that answers every call."""

from __future__ import annotations

import signal
import threading

import numpy as np
import pytest

grpcclient = pytest.importorskip("tritonclient.grpc")
from tritonclient.utils import InferenceServerException  # noqa: E402

from serve.config import ServerConfig  # noqa: E402
from serve.native_lane import missing_reason  # noqa: E402
from tests.test_kserve_v2 import _v2_call, _v2_request, infer  # noqa: E402  (the v2 helpers, one home)

NATIVE_MISSING = missing_reason()
needs_lane = pytest.mark.skipif(NATIVE_MISSING is not None, reason=str(NATIVE_MISSING))
ATOL = 1e-5  # same graph, different batch-mates: float noise


@pytest.fixture(scope="module")
def server(serve_start, serve_export_dir):
    if NATIVE_MISSING is not None:
        pytest.skip(NATIVE_MISSING)
    return serve_start(serve_export_dir, "--kserve-native-port", "0")


def lane(server):
    return grpcclient.InferenceServerClient(url=f"127.0.0.1:{server.kserve_native_port}")


@needs_lane
def test_concurrent_requests_share_a_batch_and_each_equals_its_row_alone(server):
    """Requests that arrive while a batch runs form the next one (C++ batch formation); a row's
    numbers do not depend on its batch-mates. Up to 5 rounds for a shared batch to show, without sleeps."""
    rng = np.random.default_rng(7)
    rows = [rng.integers(1, 100, size=(1, n)) for n in rng.integers(3, 40, size=16)]
    python = grpcclient.InferenceServerClient(url=server.target)
    alone = [infer(python, ids).as_numpy("last_hidden_state") for ids in rows]
    clients = [lane(server) for _ in rows]
    for _ in range(5):
        start, results = threading.Barrier(len(rows)), [None] * len(rows)

        def send(i: int) -> None:
            start.wait()
            results[i] = infer(clients[i], rows[i])

        threads = [threading.Thread(target=send, args=(i,)) for i in range(len(rows))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        for got, expected in zip(results, alone):
            np.testing.assert_allclose(got.as_numpy("last_hidden_state"), expected, atol=ATOL, rtol=0)
        if max(r.get_response().parameters["batch_size"].int64_param for r in results) > 1:
            return
    pytest.fail("16 simultaneous requests never shared a session.run in 5 rounds")


@needs_lane
def test_typed_contents_take_the_python_path_and_agree_with_raw_ones(server):
    """Raw contents are read in C++ (fast path), typed ones by serve/kserve.py (slow path): one answer."""
    ids = np.array([[5, 17, 3, 99, 42, 7]], np.int64)
    fast = infer(lane(server), ids).as_numpy("embeddings")
    typed = _v2_request(("input_ids", "INT64", [1, 6], ids[0].tolist()), outputs=("embeddings",))
    code, details, response = _v2_call(f"127.0.0.1:{server.kserve_native_port}", typed)
    assert code == "OK", details
    slow = np.frombuffer(response.raw_output_contents[0], "<f4").reshape(1, -1)
    np.testing.assert_allclose(slow, fast, atol=ATOL, rtol=0)


@needs_lane
@pytest.mark.parametrize("method", ["ModelInfer", "ModelReady"])
def test_bytes_that_are_no_protobuf_are_invalid_argument_as_on_the_python_port(server, method):
    """Every lane method is raw in C++; unparsable bytes reach Python, which names the method."""
    import grpc

    answers = []
    for port in (server.port, server.kserve_native_port):
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_unary(f"/inference.GRPCInferenceService/{method}")  # bytes as they are
            with pytest.raises(grpc.RpcError) as caught:
                call(b"\xff\xff\xff\xff", timeout=30)
            answers.append((caught.value.code(), caught.value.details()))
    assert answers[0] == answers[1]
    assert answers[1][0] == grpc.StatusCode.INVALID_ARGUMENT
    assert f"not a valid protobuf request for /inference.GRPCInferenceService/{method}" in answers[1][1]


@needs_lane
def test_int32_ids_and_masks_equal_int64_ones(server):
    ids = np.array([[5, 6, 7, 8], [9, 10, 0, 0]])
    attention = np.array([[1, 1, 1, 1], [1, 1, 0, 0]])
    wide = infer(lane(server), ids, attention=attention)
    narrow = infer(lane(server), ids, attention=attention, dtype="INT32")
    for name in ("last_hidden_state", "embeddings"):
        np.testing.assert_array_equal(narrow.as_numpy(name), wide.as_numpy(name))
    assert not narrow.as_numpy("last_hidden_state")[1, 2:].any()  # zeros at padding


@needs_lane
def test_pooling_first_and_normalize_are_computed_per_row(server):
    ids = np.array([[5, 6, 7, 8], [9, 10, 11, 12]])
    plain = infer(lane(server), ids)
    hidden = plain.as_numpy("last_hidden_state")
    first = infer(lane(server), ids, pooling="first", normalize=True).as_numpy("embeddings")
    expected = hidden[:, 0] / np.linalg.norm(hidden[:, 0], axis=1, keepdims=True)
    np.testing.assert_allclose(first, expected, atol=1e-6, rtol=0)


@needs_lane
def test_sigterm_under_load_answers_every_lane_call_ok_or_unavailable(serve_start, serve_export_dir):
    """A drain answers what the lane admitted, refuses the rest with UNAVAILABLE (retry-safe), never
    CANCELLED or a lost call, and the process exits 0."""
    server = serve_start(serve_export_dir, "--kserve-native-port", "0", "--drain-quiet-ms", "200")
    clients, codes, lock = 6, [], threading.Lock()
    first = [threading.Event() for _ in range(clients)]

    def load(i: int) -> None:
        client = lane(server)
        ids = np.arange(1, 20 + i)[None]
        while True:
            try:
                infer(client, ids, outputs=("embeddings",))
                code = "OK"
            except InferenceServerException as error:
                code = str(error.status()).replace("StatusCode.", "")
            with lock:
                codes.append(code)
            first[i].set()
            if code != "OK":
                return

    threads = [threading.Thread(target=load, args=(i,), daemon=True) for i in range(clients)]
    for thread in threads:
        thread.start()
    for event in first:  # every client has been answered once: load is running
        assert event.wait(60)
    server.proc.send_signal(signal.SIGTERM)
    for thread in threads:
        thread.join(60)
    assert server.proc.wait(60) == 0, server.log()[-2000:]
    assert set(codes) <= {"OK", "UNAVAILABLE"}, sorted(set(codes))
    assert codes.count("OK") >= clients
    assert "drained=True" in server.log()


def test_the_lane_refuses_tls_and_tokens_because_it_serves_plaintext():
    with pytest.raises(ValueError, match="kserve_native_port serves plaintext"):
        ServerConfig(kserve_native_port=0, auth_token="secret")
    with pytest.raises(ValueError, match="kserve_native_port serves plaintext"):
        ServerConfig(kserve_native_port=0, tls_cert="c.pem", tls_key="k.pem")
    assert ServerConfig(kserve_native_port=-1, auth_token="secret").kserve_native_port == -1
