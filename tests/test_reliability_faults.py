"""Faults: cancellations and deadlines inside a forming batch, a failing inference call, SIGKILL and
restart with the client's retry/backoff, SIGTERM with admitted work, and broken models at start.

(test_serve_lifecycle.py already covers SIGTERM under a closed-loop load: refusals are UNAVAILABLE,
exit 0, drained. Here we add: every request admitted before SIGTERM answers OK and correctly.)
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from export.contract import FP32_TOLERANCE
from client import EncoderClient, build_request, parse_response
from serve.protocols.pb import pb_grpc
from tests.reliability_common import InProcessServer, corrupt_export, count, wait_until
from tests.subprocess_env import REPO, repo_env

ATOL = FP32_TOLERANCE["limit"]
POISON = 99


def _ids(length: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, POISON, length).astype(np.int64)


def _health(target: str) -> int | None:
    try:
        with grpc.insecure_channel(target) as channel:
            return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1).status
    except grpc.RpcError:
        return None


@pytest.fixture(scope="module")
def slow_batch_server(serve_export_dir):
    """In-process server whose batches wait 1 s for company, with the poison-token fault on; one
    session.run per batch (no length split), so a run's batch_size counts exactly the batch's survivors."""
    server = InProcessServer(serve_export_dir, max_queue_delay_ms=1000.0, fault_inject=f"poison_token={POISON}",
                             length_split=False)
    yield server
    assert server.stop()


def test_cancelled_and_expired_requests_leave_their_batch_mates_correct(slow_batch_server, serve_reference):
    with grpc.insecure_channel(slow_batch_server.target) as channel:
        stub = pb_grpc.EncoderServiceStub(channel)
        seqs = {i: _ids(5 + 7 * i, i) for i in range(8)}
        cancel, expire = {1, 4}, {2, 6}
        futures = {i: stub.Encode.future(build_request([seqs[i]], hidden_states=True, pooling="mean"),
                                         timeout=0.3 if i in expire else 30)
                   for i in seqs}
        batcher = slow_batch_server.server.engine().batcher
        assert wait_until(lambda: batcher.queue_depth() == len(seqs), 10)  # all queued, the batch still forming (1 s)
        for i in cancel:
            futures[i].cancel()
        survivors = 0
        for i, future in futures.items():
            if i in cancel:
                with pytest.raises(grpc.FutureCancelledError):
                    future.result()
            elif i in expire:
                with pytest.raises(grpc.RpcError) as caught:
                    future.result()
                assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            else:
                out = parse_response(future.result())
                hidden, mean = serve_reference(seqs[i])
                np.testing.assert_allclose(out.hidden_states[0], hidden, atol=ATOL, rtol=ATOL)
                np.testing.assert_allclose(out.embeddings[0], mean, atol=ATOL, rtol=ATOL)
                # the dropped requests never ran: the batch holds only the survivors
                assert out.metadata.batch_size == len(seqs) - len(cancel) - len(expire)
                survivors += 1
    assert survivors == 4
    count(faults_survived=len(cancel) + len(expire))


def test_a_failing_inference_call_fails_only_its_request_and_the_server_keeps_serving(
        slow_batch_server, serve_reference):
    with grpc.insecure_channel(slow_batch_server.target) as channel:
        stub = pb_grpc.EncoderServiceStub(channel)
        seqs = {i: _ids(3 + 5 * i, 100 + i) for i in range(6)}
        seqs[3] = seqs[3].copy()
        seqs[3][1] = POISON  # the backend fails any batch holding this id (serve/backend/faults.py)
        futures = {i: stub.Encode.future(build_request([s]), timeout=30) for i, s in seqs.items()}
        for i, future in futures.items():
            if i == 3:
                with pytest.raises(grpc.RpcError) as caught:
                    future.result()
                assert caught.value.code() == grpc.StatusCode.INTERNAL
                assert "inference failed" in caught.value.details()
                assert "injected fault" in caught.value.details()
            else:
                out = parse_response(future.result())
                np.testing.assert_allclose(out.embeddings[0], serve_reference(seqs[i])[1], atol=ATOL, rtol=ATOL)
        # alone, too; and then the server still serves
        with pytest.raises(grpc.RpcError) as caught:
            stub.Encode(build_request([[POISON]]), timeout=30)
        assert caught.value.code() == grpc.StatusCode.INTERNAL
    assert _health(slow_batch_server.target) == health_pb2.HealthCheckResponse.SERVING
    with EncoderClient(slow_batch_server.target, retries=0) as client:
        np.testing.assert_allclose(client.encode([seqs[0]]).embeddings[0], serve_reference(seqs[0])[1],
                                   atol=ATOL, rtol=ATOL)
    count(faults_survived=2)


def _start(export_dir: Path, port: int, workdir: Path, *flags: str) -> tuple[subprocess.Popen, Path]:
    port_file, log = workdir / f"ports-{time.monotonic_ns()}.json", workdir / f"log-{time.monotonic_ns()}.txt"
    proc = subprocess.Popen(
        [sys.executable, "-m", "serve", "--export-dir", str(export_dir), "--host", "127.0.0.1",
         "--port", str(port), "--metrics-port", "-1", "--port-file", str(port_file), *flags],
        cwd=REPO, env=repo_env(), stdout=subprocess.DEVNULL, stderr=open(log, "w"),
    )
    assert wait_until(lambda: port_file.exists() or proc.poll() is not None, 60), log.read_text()
    assert proc.poll() is None, log.read_text()
    return proc, port_file


def test_sigkill_and_restart_clients_with_retry_and_backoff_recover(serve_export_dir, serve_reference, tmp_path):
    proc, port_file = _start(serve_export_dir, 0, tmp_path)
    port = json.loads(port_file.read_text())["port"]
    target = f"127.0.0.1:{port}"
    restarted: list[subprocess.Popen] = []
    try:
        assert wait_until(lambda: _health(target) == health_pb2.HealthCheckResponse.SERVING, 60)
        seq = _ids(17, 7)
        expected = serve_reference(seq)[1]
        results, errors = [], []

        def client_loop() -> None:  # clients keep calling across the crash, through the client library
            with EncoderClient(target, timeout=10, retries=80, backoff_s=0.05, max_backoff_s=0.5) as client:
                for _ in range(12):
                    try:
                        results.append(client.encode([seq]).embeddings[0])
                    except grpc.RpcError as error:
                        errors.append(f"{error.code().name}: {error.details()}")
                    time.sleep(0.15)

        threads = [threading.Thread(target=client_loop) for _ in range(3)]
        for t in threads:
            t.start()
        time.sleep(0.4)
        proc.send_signal(signal.SIGKILL)  # no drain, no goodbye
        assert proc.wait(10) == -signal.SIGKILL
        time.sleep(0.3)  # clients now see UNAVAILABLE and back off
        new_proc, _ = _start(serve_export_dir, port, tmp_path)  # same port
        restarted.append(new_proc)
        for t in threads:
            t.join(60)
        assert not errors, errors
        assert len(results) == 36
        for embedding in results:
            np.testing.assert_allclose(embedding, expected, atol=ATOL, rtol=ATOL)
        count(faults_survived=1)
    finally:
        for p in [proc, *restarted]:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                p.wait(30)


def test_every_request_admitted_before_sigterm_is_answered_correctly_and_exit_is_zero(
        serve_start, serve_export_dir, serve_reference):
    server = serve_start(serve_export_dir, "--max-queue-delay-ms", "5000", "--grace-s", "20")
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.EncoderServiceStub(channel)
        seqs = [_ids(4 + 9 * i, 50 + i) for i in range(10)]
        futures = [stub.Encode.future(build_request([s]), timeout=30) for s in seqs]
        # all admitted and queued (the batch waits up to 5 s for company; SIGTERM ends the wait)
        assert wait_until(lambda: "encoder_queue_depth 10.0" in server.metrics(), 20)
        server.proc.send_signal(signal.SIGTERM)
        for seq, future in zip(seqs, futures):
            out = parse_response(future.result())
            np.testing.assert_allclose(out.embeddings[0], serve_reference(seq)[1], atol=ATOL, rtol=ATOL)
        assert server.proc.wait(30) == 0, server.log()
    count(faults_survived=1)


BROKEN = {
    "truncated": "cannot load",
    "garbage": "cannot load",
    "hash_mismatch": "does not match metadata.json",
    "bad_json": "not valid JSON",
    "wrong_config": "probe inference gave shapes",
    "wrong_kind": "graph inputs",
    "missing_graph": "not found",
}


@pytest.mark.parametrize("how", sorted(BROKEN))
def test_every_broken_model_is_refused_by_the_load_path_with_a_clear_error(serve_export_dir, tmp_path, how):
    from serve.config import ServerConfig
    from serve.errors import ServeError
    from serve.assembly.loading import build_engine, default_backend

    broken = corrupt_export(serve_export_dir, tmp_path / "export", how)
    config = ServerConfig(port=0, metrics_port=-1, export_dir=str(broken))
    with pytest.raises(ServeError) as caught:
        build_engine(str(broken), "fp32", config, default_backend)
    assert BROKEN[how] in caught.value.message


@pytest.mark.parametrize("how", ["truncated", "wrong_config", "bad_json"])
def test_a_broken_model_at_start_exits_nonzero_with_a_clear_error_and_never_serves(
        serve_export_dir, tmp_path, how):
    broken = corrupt_export(serve_export_dir, tmp_path / "export", how)
    port_file, log = tmp_path / "ports.json", tmp_path / "log.txt"
    proc = subprocess.Popen(
        [sys.executable, "-m", "serve", "--export-dir", str(broken), "--host", "127.0.0.1", "--port", "0",
         "--metrics-port", "-1", "--port-file", str(port_file)],
        cwd=REPO, env=repo_env(), stdout=subprocess.DEVNULL, stderr=open(log, "w"),
    )
    statuses = set()
    try:
        while proc.poll() is None:  # while it lives, it must never report SERVING
            if port_file.exists():
                statuses.add(_health(f"127.0.0.1:{json.loads(port_file.read_text())['port']}"))
            time.sleep(0.02)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert proc.wait(60) == 1, text
    assert health_pb2.HealthCheckResponse.SERVING not in statuses
    assert "event=startup_failed" in text and BROKEN[how] in text, text
    assert "event=serving" not in text
    count(faults_survived=1)


def test_an_unknown_fault_injection_spec_fails_the_start_cleanly(serve_export_dir):
    from serve.errors import ServeError

    with pytest.raises(ServeError, match="fault_inject: unknown fault 'explode'"):
        InProcessServer(serve_export_dir, fault_inject="explode")
