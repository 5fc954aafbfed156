"""The front end's transports (serve/transport/): native (gRPC C++, bytes only) and grpcio, each under
one Router with the same rules. Real server processes (or an in-process server whose inference waits
at a gate the test opens), real clients; every test runs on both transports."""

from __future__ import annotations

import threading
import time

import grpc
import numpy as np
import pytest

grpcclient = pytest.importorskip("tritonclient.grpc")

from client import EncoderClient, build_request  # noqa: E402
from serve.protocols.pb import pb_grpc  # noqa: E402
from serve.transport.rpc import Rpc  # noqa: E402
from tests.conftest import NEEDS_NATIVE, TRANSPORTS  # noqa: E402
from tests.reliability_common import (  # noqa: E402
    assert_sigterm_under_load_answers_every_accepted_request,
    wait_until,
)
from tests.test_kserve_v2 import infer  # noqa: E402  (the v2 helper, one home)
from tests.test_serve_lifecycle import GatedServer  # noqa: E402

ATOL = 1e-5  # same graph, different batch-mates: float noise

# every method the server answers, with how it is called (unary or a stream of requests)
UNARY = ["/encoder.v1.EncoderService/Encode", "/encoder.v1.EncoderService/GetModelInfo",
         "/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch",
         *(f"/inference.GRPCInferenceService/{m}" for m in
           ("ServerLive", "ServerReady", "ModelReady", "ServerMetadata", "ModelMetadata", "ModelInfer"))]
STREAMS = ["/encoder.v1.EncoderService/EncodeStream",
           "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"]


@pytest.fixture(scope="module", params=TRANSPORTS)
def server(request, serve_start, serve_export_dir):
    started = serve_start(serve_export_dir, "--transport", request.param)
    assert started.transport == request.param
    return started


def test_concurrent_requests_share_a_batch_and_each_equals_its_row_alone(server):
    """Requests handed over together form one batch; a row's numbers do not depend on its batch-mates.
    Up to 5 rounds for a shared batch to show, without sleeps."""
    rng = np.random.default_rng(7)
    rows = [rng.integers(1, 100, size=(1, n)) for n in rng.integers(3, 40, size=16)]
    clients = [grpcclient.InferenceServerClient(url=server.target) for _ in rows]
    alone = [infer(clients[0], ids).as_numpy("last_hidden_state") for ids in rows]
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


@pytest.mark.parametrize("method", UNARY + STREAMS)
def test_bytes_that_are_no_protobuf_get_invalid_argument_naming_the_method(server, method):
    with grpc.insecure_channel(server.target) as channel:
        if method in STREAMS:
            call = channel.stream_stream(method)  # bytes as they are
            with pytest.raises(grpc.RpcError) as caught:
                list(call(iter([b"\xff\xff\xff\xff"]), timeout=30))
        else:
            call = (channel.unary_stream if method.endswith("/Watch") else channel.unary_unary)(method)
            with pytest.raises(grpc.RpcError) as caught:
                result = call(b"\xff\xff\xff\xff", timeout=30)
                list(result) if method.endswith("/Watch") else result
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details() == f"request: the bytes are not a valid protobuf request for {method}"
    assert EncoderClient(server.target).health() == "SERVING"  # and the server goes on serving


def test_an_unknown_method_is_unimplemented(server):
    with grpc.insecure_channel(server.target) as channel:
        with pytest.raises(grpc.RpcError) as caught:
            channel.unary_unary("/encoder.v1.EncoderService/Nope")(b"", timeout=30)
    assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_a_watch_stream_stays_open_while_unary_calls_on_its_channel_answer(server):
    """grpc.health's Watch answers one request with a stream (a unary call answers once, with its status):
    the transport keeps the stream open, its first message SERVING, while Encode answers beside it."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(server.target) as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(
            health_pb2.HealthCheckRequest(service="encoder.v1.EncoderService"), timeout=60)
        first = next(watch)
        assert first.status == health_pb2.HealthCheckResponse.SERVING
        out = pb_grpc.EncoderServiceStub(channel).Encode(build_request([[5, 17, 3]]), timeout=30)
        assert len(out.results) == 1
        assert watch.running()  # the stream is still open: no status came after its first message
        watch.cancel()


def _express_runs(server) -> float:
    for line in server.metrics().splitlines():
        if line.startswith("encoder_express_runs_total "):
            return float(line.split()[1])
    raise AssertionError("no encoder_express_runs_total in /metrics")


@NEEDS_NATIVE
def test_a_lone_client_is_answered_by_express_runs_with_the_same_numbers(serve_start, serve_export_dir):
    """One client, one call at a time, on the native transport: each call after the model's first run (which
    measures its seconds per token) runs on the transport's thread (serve/core/express.py), seen in /metrics,
    and its answer equals the batcher's (express runs off). The budget is set high so a busy machine's slower
    runs still qualify."""
    rng = np.random.default_rng(11)
    rows = [rng.integers(1, 100, size=(1, n)) for n in (3, 17, 40, 8)]
    answers = {}
    for budget in ("1000", "0"):
        started = serve_start(serve_export_dir, "--transport", "native", "--express-run-ms", budget)
        client = grpcclient.InferenceServerClient(url=started.target)
        answers[budget] = [infer(client, ids).as_numpy("last_hidden_state") for ids in rows]
        assert _express_runs(started) == (len(rows) - 1 if budget != "0" else 0)
        assert started.terminate() == 0
    for express, queued in zip(answers["1000"], answers["0"]):
        np.testing.assert_allclose(express, queued, atol=ATOL, rtol=0)


def _requests_total(gated: GatedServer, code: str) -> float:
    return gated.server.metrics.registry.get_sample_value(
        "encoder_requests_total", {"method": "Encode", "code": code}) or 0.0


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_the_batch_hand_off_drops_expired_and_cancelled_calls_and_refuses_overflow(serve_export_dir, transport):
    """While a batch runs (held at a gate), calls queue: one whose deadline passes and one its client
    cancels are dropped when the next batch forms, never run; a call past max_queue_size is refused
    RESOURCE_EXHAUSTED at once; the rest are answered, and every outcome is counted once."""
    gated = GatedServer(serve_export_dir, transport=transport, max_queue_size=2)
    try:
        with grpc.insecure_channel(gated.target) as channel:
            stub = pb_grpc.EncoderServiceStub(channel)
            running = stub.Encode.future(build_request([[1, 2, 3]]), timeout=60)
            assert gated.entered.wait(30)  # the batch runs, held at the gate
            engine = gated.server.engine()
            cancelled = stub.Encode.future(build_request([[6, 7]]), timeout=60)
            expiring = stub.Encode.future(build_request([[4, 5]]), timeout=3)
            assert wait_until(lambda: engine.batcher.queue_depth() == 2, 30)
            with pytest.raises(grpc.RpcError) as overflow:  # the queue holds 2
                stub.Encode(build_request([[8, 9]]), timeout=30)
            assert overflow.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "max_queue_size=2" in overflow.value.details()
            with pytest.raises(grpc.RpcError) as late:
                expiring.result()
            assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            cancelled.cancel()
            assert wait_until(lambda: all(t.cancelled for t in list(engine.batcher._queue)), 30)
            gated.release.set()
            assert running.result().results[0].HasField("embedding")
            assert stub.Encode(build_request([[10, 11]]), timeout=30).results[0].HasField("embedding")
            assert wait_until(lambda: _requests_total(gated, "CANCELLED") == 1, 30)
        assert _requests_total(gated, "OK") == 2
        assert _requests_total(gated, "DEADLINE_EXCEEDED") == 1
        assert _requests_total(gated, "RESOURCE_EXHAUSTED") == 1
        assert gated.server.metrics.registry.get_sample_value("encoder_sequences_total") == 2  # none ran dropped
    finally:
        gated.release.set()
        gated.server.shutdown(5)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_sigterm_under_load_loses_no_admitted_call(serve_start, serve_export_dir, transport):
    codes = assert_sigterm_under_load_answers_every_accepted_request(serve_start, serve_export_dir,
                                                                     "--transport", transport)
    assert codes


# --- the native transport's clock: a call's latency and deadline count from its arrival, not from when the
# pump took it (under load a burst waits for the pump: docs/performance.md "Where a request's time goes")
CLOCK_METHOD = "/test.Clock/Arrive"


@pytest.fixture
def bare_transport():
    """The compiled transport alone, listening on a loopback port, with no pump: the test takes its events."""
    from serve.transport.native import load_module

    module = load_module()
    transport = module.Transport()
    port = transport.start("127.0.0.1:0", 1 << 20, None, [])
    yield module, transport, port
    transport.stop(0)


def _first_start(module, transport, within_s: float = 60.0) -> tuple:
    """The next START event (gRPC's threads push it; `next` blocks until one is queued), failing after `within_s`."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        for event in transport.next(deadline - time.monotonic()):
            if event[0] == module.START:
                return event
    raise AssertionError(f"no call reached the transport within {within_s:g} s")


@NEEDS_NATIVE
def test_a_calls_arrival_is_stamped_on_pythons_monotonic_clock(bare_transport):
    module, transport, port = bare_transport
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_unary(CLOCK_METHOD)
        before = time.monotonic()
        future = call.future(b"request", timeout=60)
        event = _first_start(module, transport)
        taken = time.monotonic()
        _, call_id, method, payload, _, remaining, arrived = event
        assert (method, payload) == (CLOCK_METHOD, b"request")
        assert before <= arrived <= taken
        # the deadline gRPC holds: 60 s after the client sent it, seen from the arrival
        assert 60 - (arrived - before) - 1.0 <= remaining <= 60
        transport.finish(call_id, grpc.StatusCode.OK.value[0], "", b"answer")
        assert future.result(timeout=30) == b"answer"


@NEEDS_NATIVE
@pytest.mark.parametrize("here", [False, True], ids=["by-the-writer-thread", "on-the-calling-thread"])
def test_an_answer_and_a_refusal_arrive_whichever_thread_sends_them(bare_transport, here):
    module, transport, port = bare_transport
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_unary(CLOCK_METHOD)
        answered, refused = call.future(b"one", timeout=60), None
        transport.finish(_first_start(module, transport)[1], grpc.StatusCode.OK.value[0], "", b"answer", here)
        refused = call.future(b"two", timeout=60)
        transport.finish(_first_start(module, transport)[1], grpc.StatusCode.RESOURCE_EXHAUSTED.value[0],
                         "queue full", None, here)
        assert answered.result(timeout=30) == b"answer"
        with pytest.raises(grpc.RpcError) as error:
            refused.result(timeout=30)
        assert (error.value.code(), error.value.details()) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full")


@NEEDS_NATIVE
def test_a_call_the_client_cancels_reaches_python_as_cancel_and_is_forgotten(bare_transport):
    module, transport, port = bare_transport
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        pending = channel.unary_unary(CLOCK_METHOD).future(b"one", timeout=60)
        call_id = _first_start(module, transport)[1]
        assert transport.open_calls() == 1
        pending.cancel()
        deadline, cancels = time.monotonic() + 60, []
        while not cancels and time.monotonic() < deadline:
            cancels = [e for e in transport.next(1.0) if e[0] == module.CANCEL and e[1] == call_id]
        assert cancels, "the client's cancel never reached Python"
        transport.finish(call_id, grpc.StatusCode.OK.value[0], "", b"too late", True)  # ignored, harmlessly
        assert wait_until(lambda: transport.open_calls() == 0, 30)
        answered = channel.unary_unary(CLOCK_METHOD).future(b"two", timeout=60)  # the transport serves on
        transport.finish(_first_start(module, transport)[1], grpc.StatusCode.OK.value[0], "", b"answer", False)
        assert answered.result(timeout=30) == b"answer"


@NEEDS_NATIVE
def test_a_transport_that_cannot_listen_says_where_and_another_starts_after_it():
    from serve.transport.native import load_module

    module = load_module()
    failed = module.Transport()  # 192.0.2.1: a documentation address (RFC 5737), on no interface here
    with pytest.raises(RuntimeError, match="cannot listen on 192.0.2.1:0"):
        failed.start("192.0.2.1:0", 1 << 20, None, [])
    failed.stop(0)  # nothing to stop, and no crash
    working = module.Transport()
    try:
        assert working.start("127.0.0.1:0", 1 << 20, None, []) > 0
    finally:
        working.stop(0)


def test_a_calls_deadline_counts_from_its_arrival():
    arrived = time.monotonic() - 2.0  # the call waited 2 s for the pump
    rpc = Rpc(CLOCK_METHOD, (), remaining=5.0, received=arrived)
    assert rpc.received == arrived
    assert rpc.deadline == arrived + 5.0
    assert rpc.time_remaining() <= 3.0


def test_a_call_with_no_arrival_given_counts_from_now():
    before = time.monotonic()
    rpc = Rpc(CLOCK_METHOD, (), remaining=None)
    assert before <= rpc.received <= time.monotonic()
    assert rpc.deadline is None and rpc.time_remaining() is None
