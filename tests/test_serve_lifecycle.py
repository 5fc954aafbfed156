"""Server lifecycle: readiness after warm-up, draining on SIGTERM, failing fast on a missing GPU."""

from __future__ import annotations

import queue
import subprocess
import sys
import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from serve.assembly.app import create_server
from client import EncoderClient, build_request
from serve.config import ServerConfig
from serve.assembly.loading import default_backend
from serve.protocols.pb import pb_grpc
from tests.reliability_common import assert_sigterm_under_load_answers_every_accepted_request, wait_until
from tests.subprocess_env import REPO, repo_env



def _health(target: str) -> int:
    with grpc.insecure_channel(target) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status


def test_health_is_serving_only_after_warm_up(serve_export_dir):
    release, warming = threading.Event(), threading.Event()
    order: list[str] = []

    def slow_backend(export, config):
        backend = default_backend(export, config)
        real_warm_up = backend.warm_up

        def warm_up():
            warming.set()
            release.wait(30)
            order.append("warm")
            return real_warm_up()

        backend.warm_up = warm_up
        return backend

    config = ServerConfig(port=0, metrics_port=-1, http_port=0, export_dir=str(serve_export_dir))
    server, port = create_server(config, backend_factory=slow_backend)
    server.start()
    loader = threading.Thread(target=server.load)
    loader.start()
    try:
        target = f"127.0.0.1:{port}"
        assert warming.wait(30)
        assert _health(target) == health_pb2.HealthCheckResponse.NOT_SERVING
        with EncoderClient(target, retries=0) as client:
            with pytest.raises(grpc.RpcError) as caught:
                client.encode([[1, 2, 3]])
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "loading" in caught.value.details()
            release.set()
            loader.join(30)
            assert order == ["warm"]
            assert _health(target) == health_pb2.HealthCheckResponse.SERVING
            assert client.encode([[1, 2, 3]]).embeddings.shape == (1, 32)
    finally:
        release.set()
        loader.join(30)
        server.shutdown(5)


def test_sigterm_under_load_answers_every_accepted_request_and_exits_zero(serve_start, serve_export_dir):
    # tests/test_reliability_chaos.py runs the same with a CPU hog beside it
    assert_sigterm_under_load_answers_every_accepted_request(serve_start, serve_export_dir)


class GatedServer:
    """An in-process server whose inference calls, once armed, wait at a gate the test opens: the test
    decides when a batch finishes, so what it asserts about a drain never depends on timing."""

    def __init__(self, export_dir, **fields) -> None:
        self.entered, self.release, self._armed = threading.Event(), threading.Event(), threading.Event()

        def gated(export, config):
            backend = default_backend(export, config)
            real_encode = backend.encode

            def encode(*args, **kwargs):
                if self._armed.is_set():
                    self.entered.set()
                    self.release.wait(30)
                return real_encode(*args, **kwargs)

            backend.encode = encode
            return backend

        config = ServerConfig(port=0, metrics_port=-1, http_port=0, export_dir=str(export_dir), **fields)
        self.server, port = create_server(config, backend_factory=gated)
        self.target = f"127.0.0.1:{port}"
        self.server.start()
        self.server.load()
        self._armed.set()  # warm-up and the start-up probe ran through the open gate

    def shutdown_in_background(self, grace: float) -> tuple[threading.Thread, list]:
        result: list = []
        thread = threading.Thread(target=lambda: result.append(self.server.shutdown(grace)))
        thread.start()
        return thread, result

    def wait_not_serving(self) -> None:
        """Returns once health reports NOT_SERVING (a Watch stream: no polling)."""
        with grpc.insecure_channel(self.target) as channel:
            for reply in health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=30):
                if reply.status == health_pb2.HealthCheckResponse.NOT_SERVING:
                    return


def _events(caplog, name: str) -> list[dict]:
    return [getattr(r, "fields", {}) for r in caplog.records if r.getMessage() == name]


def test_draining_refuses_new_calls_unavailable_and_answers_every_admitted_one_streams_included(
        serve_export_dir, caplog):
    caplog.set_level("INFO", logger="serve")
    gated = GatedServer(serve_export_dir)
    sent: queue.Queue = queue.Queue()
    with grpc.insecure_channel(gated.target) as channel:
        stub = pb_grpc.EncoderServiceStub(channel)
        stream = stub.EncodeStream(iter(sent.get, None), timeout=60)
        sent.put(build_request([[1, 2, 3]], request_id="a"))
        assert gated.entered.wait(30)  # "a" runs, held at the gate
        unary = stub.Encode.future(build_request([[4, 5, 6]]), timeout=60)
        engine = gated.server.engine()
        assert wait_until(lambda: engine.batcher.queue_depth() == 1, 30)  # admitted, queued behind "a"
        drain, drained = gated.shutdown_in_background(grace=60)
        gated.wait_not_serving()
        with pytest.raises(grpc.RpcError) as late:  # arrives while draining: refused, retry-safe
            stub.Encode(build_request([[7, 8]]), timeout=30)
        assert late.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "shutting down" in late.value.details()
        gated.release.set()
        first = next(stream)
        assert first.response.request_id == "a" and not first.error.code
        with pytest.raises(grpc.RpcError) as ended:  # then the stream ends, UNAVAILABLE, saying why
            next(stream)
        assert ended.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "after answering its 1 requests" in ended.value.details()
        sent.put(None)
        assert unary.result().results[0].HasField("embedding")  # admitted before: answered
    drain.join(60)
    assert drained == [True]
    stopped = _events(caplog, "stopped")[-1]
    assert stopped["drained"] is True and stopped["abandoned"] == 0 and stopped["refused_while_draining"] >= 1


def test_a_call_still_running_when_the_grace_period_ends_gets_unavailable_and_is_counted(
        serve_export_dir, caplog):
    caplog.set_level("INFO", logger="serve")
    gated = GatedServer(serve_export_dir)
    try:
        with grpc.insecure_channel(gated.target) as channel:
            stub = pb_grpc.EncoderServiceStub(channel)
            running = stub.Encode.future(build_request([[1, 2, 3]]), timeout=60)
            assert gated.entered.wait(30)  # held at the gate past the grace period
            drain, drained = gated.shutdown_in_background(grace=0.5)
            with pytest.raises(grpc.RpcError) as caught:
                running.result()
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE  # never CANCELLED
            assert "grace period (0.5 s) ran out" in caught.value.details()
    finally:
        gated.release.set()
    drain.join(60)
    assert drained == [False]
    assert _events(caplog, "drain_timeout")[-1]["abandoned"] == 1
    assert _events(caplog, "stopped")[-1]["abandoned"] == 1


@pytest.mark.skipif(
    "CUDAExecutionProvider" in __import__("onnxruntime").get_available_providers(),
    reason="this host has onnxruntime-gpu with CUDA; the failure path is for CPU-only hosts",
)
def test_device_cuda_on_a_cpu_only_host_fails_at_startup_with_a_clear_message(serve_export_dir, tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "serve", "--device", "cuda", "--port", "0", "--metrics-port", "-1",
         "--export-dir", str(serve_export_dir)],
        cwd=REPO, env=repo_env(), capture_output=True, text=True, timeout=60,
    )
    assert result.returncode != 0
    assert "startup_failed" in result.stderr
    assert "CUDAExecutionProvider" in result.stderr and "onnxruntime-gpu" in result.stderr


def test_a_missing_export_fails_at_startup_naming_the_export_commands(tmp_path):
    """What a user sees when serve-cpu starts before the export job: the host command and the compose one."""
    result = subprocess.run(
        [sys.executable, "-m", "serve", "--port", "0", "--metrics-port", "-1", "--export-dir", str(tmp_path)],
        cwd=REPO, env=repo_env(), capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 1
    assert "startup_failed" in result.stderr and f"{tmp_path / 'metadata.json'} not found" in result.stderr
    assert "`python -m export`" in result.stderr
    assert "`docker-compose --profile export run --rm export`" in result.stderr


def test_a_changed_graph_is_refused_at_startup(serve_export_dir, tmp_path):
    import shutil

    copy = tmp_path / "export"
    shutil.copytree(serve_export_dir, copy)
    with open(copy / "model.onnx", "ab") as handle:
        handle.write(b"\0")
    result = subprocess.run(
        [sys.executable, "-m", "serve", "--port", "0", "--metrics-port", "-1", "--export-dir", str(copy)],
        cwd=REPO, env=repo_env(), capture_output=True, text=True, timeout=60,
    )
    assert result.returncode != 0
    assert "does not match metadata.json" in result.stderr


def _readiness(server, model: str) -> dict[str, bool]:
    """Every surface's answer to "is this replica ready?": gRPC health, KServe v2 gRPC ServerReady and ModelReady,
    KServe v2 REST /v2/health/ready and /v2/models/<model>/ready, and HTTP /health."""
    import urllib.error
    import urllib.request

    import tritonclient.grpc as triton  # the KServe v2 gRPC client users call it with

    def http(path: str) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{server.http_port}{path}", timeout=10) as answer:
                return answer.status == 200
        except urllib.error.HTTPError as error:
            assert error.code == 503, (path, error.code)
            return False

    with grpc.insecure_channel(server.target) as channel:
        check = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
    v2 = triton.InferenceServerClient(server.target)
    try:
        return {"grpc health": check.status == health_pb2.HealthCheckResponse.SERVING,
                "v2 gRPC ServerReady": v2.is_server_ready(client_timeout=10),
                "v2 gRPC ModelReady": v2.is_model_ready(model, client_timeout=10),
                "v2 REST /v2/health/ready": http("/v2/health/ready"),
                "v2 REST model ready": http(f"/v2/models/{model}/ready"),
                "HTTP /health": http("/health")}
    finally:
        v2.close()


def test_every_readiness_surface_turns_not_ready_in_the_drain_delay_while_calls_are_still_answered(
        serve_start, serve_export_dir):
    """--drain-delay-s: on SIGTERM every readiness surface answers not ready (admission's one readiness: gRPC
    health, KServe v2 gRPC and REST, HTTP /health) while calls are still admitted and answered, so a balancer
    ejects the replica before it refuses any."""
    import json
    import signal
    import urllib.request

    server = serve_start(serve_export_dir, "--drain-delay-s", "300")
    with EncoderClient(server.target, retries=0) as client:
        model = client.model_info().name
    assert all(_readiness(server, model).values()), _readiness(server, model)
    server.proc.send_signal(signal.SIGTERM)
    with EncoderClient(server.target, retries=0) as client:
        assert wait_until(lambda: client.health() == "NOT_SERVING", 60)  # the delay began
    assert not any(_readiness(server, model).values()), _readiness(server, model)
    with grpc.insecure_channel(server.target) as channel:  # a channel without client-side health checking
        answer = pb_grpc.EncoderServiceStub(channel).Encode(build_request([[1, 2, 3]]), timeout=30)
        assert answer.results[0].HasField("embedding")  # still admitted
    request = urllib.request.Request(f"http://127.0.0.1:{server.http_port}/v1/embeddings",
                                     data=json.dumps({"input": [[4, 5, 6]]}).encode(),
                                     headers={"content-type": "application/json"}, method="POST")
    with urllib.request.urlopen(request, timeout=30) as answer:
        assert answer.status == 200 and len(json.loads(answer.read())["data"]) == 1
    assert server.proc.poll() is None  # still in its delay
    server.proc.kill()  # its delay would outlast the session's stop (SIGTERM, then a kill after 20 s)
    server.proc.wait(30)
