"""Server lifecycle: readiness after warm-up, draining on SIGTERM, failing fast on a missing GPU."""

from __future__ import annotations

import subprocess
import sys
import threading

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from serve.app import create_server, default_backend
from serve.client import EncoderClient
from serve.config import ServerConfig
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

    config = ServerConfig(port=0, metrics_port=-1, export_dir=str(serve_export_dir))
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
    server = serve_start(serve_export_dir, "--max-queue-delay-ms", "5", "--grace-s", "20")
    codes: list[tuple[str, str]] = []
    ok = threading.Semaphore(0)
    lock = threading.Lock()
    stop = threading.Event()

    def load(seed: int) -> None:
        rng = np.random.default_rng(seed)
        with EncoderClient(server.target, retries=0, timeout=30) as client:
            while not stop.is_set():
                seqs = [rng.integers(0, 100, rng.integers(1, 100)) for _ in range(4)]
                try:
                    out = client.encode(seqs, hidden_states=True)
                    assert out.embeddings.shape == (4, 32)
                    result = ("OK", "")
                    ok.release()
                except grpc.RpcError as error:
                    result = (error.code().name, error.details() or "")
                    stop.set()  # after the first refusal, stop sending
                with lock:
                    codes.append(result)

    threads = [threading.Thread(target=load, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for _ in range(30):  # well under way
        assert ok.acquire(timeout=30)
    exit_code = server.terminate(timeout=60)
    stop.set()
    for t in threads:
        t.join(30)

    assert exit_code == 0, server.log()
    refused = [(code, details) for code, details in codes if code != "OK"]
    assert all(code == "UNAVAILABLE" for code, _ in refused), refused
    # A refusal happens at admission; no request that was admitted was dropped unanswered.
    assert not any("stopped before" in details for _, details in refused), refused
    log = server.log()
    assert "event=draining" in log and "drained=True" in log


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
