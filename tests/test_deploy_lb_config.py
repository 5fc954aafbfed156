"""docker/haproxy.cfg without Docker: its hand-written gRPC health check, byte for byte.

HAProxy 2.6 has no gRPC health check, so the config speaks grpc.health.v1.Health/Check as raw HTTP/2
bytes (`tcp-check send-binary`) and looks for the SERVING reply's bytes (`tcp-check expect binary`).
These tests send exactly those bytes, read from the config, to a real gRPC server on 127.0.0.1 and
check that the expected bytes come back when it is SERVING and not when it is NOT_SERVING. The
balancer itself, with replicas, runs in tests/test_deploy_lb.py (opt-in, Docker).
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import time
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "docker" / "haproxy.cfg"
NOT_SERVING_FRAME = bytes.fromhex("00000000020802")  # gRPC frame of HealthCheckResponse{status: NOT_SERVING}


def _check_bytes() -> tuple[bytes, bytes]:
    """(what the check sends, what it expects), as the config writes them."""
    text = CONFIG.read_text()
    sent = b"".join(bytes.fromhex(h) for h in re.findall(r"^\s*tcp-check send-binary ([0-9a-f]+)$", text, re.M))
    (expected,) = re.findall(r"^\s*tcp-check expect binary ([0-9a-f]+)$", text, re.M)
    return sent, bytes.fromhex(expected)


@pytest.fixture
def health_server():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield servicer, port
    finally:
        server.stop(0)


def _replay(port: int, request: bytes, stop_at: tuple[bytes, ...], timeout: float = 5.0) -> bytes:
    """Sends the check's bytes as HAProxy does and reads until one of stop_at arrives (bounded)."""
    received = b""
    end = time.monotonic() + timeout
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(request)
        while time.monotonic() < end and not any(marker in received for marker in stop_at):
            sock.settimeout(max(0.01, end - time.monotonic()))
            try:
                chunk = sock.recv(65536)
            except socket.timeout:
                break
            if not chunk:
                break
            received += chunk
    return received


def test_check_bytes_find_serving_on_a_serving_grpc_server(health_server):
    servicer, port = health_server
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    request, expected = _check_bytes()
    reply = _replay(port, request, (expected, NOT_SERVING_FRAME))
    assert expected in reply, reply.hex()


def test_check_bytes_do_not_find_serving_while_not_serving(health_server):
    servicer, port = health_server
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)  # loading, warming up or draining
    request, expected = _check_bytes()
    reply = _replay(port, request, (expected, NOT_SERVING_FRAME))
    assert NOT_SERVING_FRAME in reply and expected not in reply, reply.hex()


def test_haproxy_accepts_the_config():
    haproxy = shutil.which("haproxy")
    if haproxy is None:
        pytest.skip("no haproxy binary here (apt-get install haproxy); the LB image checks it in its build")
    env = {**os.environ, "LB_UPSTREAM": "serve", "LB_UPSTREAM_PORT": "50051"}
    result = subprocess.run([haproxy, "-c", "-f", str(CONFIG)], env=env, capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stdout + result.stderr
