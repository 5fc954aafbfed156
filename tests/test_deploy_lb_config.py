"""docker/haproxy.cfg without Docker: its hand-written gRPC health check, byte for byte; the HTTP
front end's settings; and, where a haproxy binary is installed, the config's HTTP retry rules and its
refusal of model load/unload run for real.

HAProxy 2.6 has no gRPC health check, so the config speaks grpc.health.v1.Health/Check as raw HTTP/2
bytes (`tcp-check send-binary`) and looks for the SERVING reply's bytes (`tcp-check expect binary`).
These tests send exactly those bytes, read from the config, to a real gRPC server on 127.0.0.1 and
check that the expected bytes come back when it is SERVING and not when it is NOT_SERVING.

The HTTP front end (frontend `http`, backend `serve_http`) is read as written: its port, its health
check, its retry rule, its timeouts against the server's keep-alive. Then its frontend and backend,
with the replicas' DNS names replaced by two stub servers on 127.0.0.1 (one refusing every POST with
503 as a draining replica does, or closing the connection unanswered, one answering), run in a real
HAProxy: every POST of a client on one keep-alive connection comes back 200. On both front ends, a
model load, unload or reload (which would change one replica's models only) is answered by HAProxy
itself and never reaches a replica, while the repository index passes. The balancer itself, with
replicas, runs in tests/test_deploy_lb.py (Docker).
"""

from __future__ import annotations

import contextlib
import http.client
import http.server
import json
import os
import re
import shutil
import socket
import subprocess
import threading
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
    env = {**os.environ, "LB_UPSTREAM": "serve", "LB_UPSTREAM_PORT": "50051", "LB_UPSTREAM_HTTP_PORT": "8000"}
    result = subprocess.run([haproxy, "-c", "-f", str(CONFIG)], env=env, capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stdout + result.stderr


# --- the HTTP front end ---------------------------------------------------------------------------

UNITS = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def _sections() -> dict[str, list[str]]:
    """'frontend http' -> its directive lines (comments and blank lines dropped), for every section."""
    sections: dict[str, list[str]] = {}
    current = None
    for raw in CONFIG.read_text().splitlines():
        line = raw.split("#", 1)[0].rstrip()
        if not line.strip():
            continue
        if not line[0].isspace():
            current = sections.setdefault(line.strip(), [])
        else:
            current.append(line.strip())
    return sections


def _directive(lines: list[str], prefix: str) -> str:
    (hit,) = [line for line in lines if line.startswith(prefix + " ") or line == prefix]
    return hit[len(prefix):].strip()


def _seconds(value: str) -> float:
    number, unit = re.fullmatch(r"(\d+)(ms|s|m|h)?", value).groups()
    return int(number) * UNITS[unit or "ms"]  # HAProxy's default unit is the millisecond


def test_http_frontend_checks_ready_retries_refusals_and_outlasts_the_server_keep_alive():
    from serve.config import ServerConfig

    server_keep_alive = ServerConfig().http_keep_alive_s  # the replicas' idle keep-alive (--http-keep-alive-s)
    sections = _sections()
    front, back, defaults = sections["frontend http"], sections["backend serve_http"], sections["defaults"]
    assert _directive(front, "bind") == ":8081" and _directive(front, "default_backend") == "serve_http"
    # the readiness route answers 200 only when loaded, warm and not draining
    assert "option httpchk" in back
    assert _directive(back, "http-check send").split()[:4] == ["meth", "GET", "uri", "/v2/health/ready"]
    assert _directive(back, "http-check expect") == "status 200"
    assert "check" in _directive(back, "default-server").split()
    assert _directive(back, "server-template").endswith(':${LB_UPSTREAM_HTTP_PORT}"')
    # a drain's 503 (not admitted), a refused connection and a pooled connection the replica closed are
    # replayed elsewhere; nothing that may have run and failed (500, 504) nor an overload (429) is
    retry_on = set(_directive(back, "retry-on").split())
    assert retry_on == {"conn-failure", "empty-response", "503"}, retry_on
    assert int(_directive(back, "retries")) >= 2  # HAProxy 2.6 counts the first attempt among them
    assert "option http-buffer-request" in back  # an L7 retry needs the whole request held
    assert "option redispatch 1" in defaults  # each retry on another replica
    assert _directive(back, "http-reuse") in ("safe", "aggressive", "always")  # keep-alive to the replicas
    # An idle client connection is kept longer than the server keeps its own (75 s), and `timeout
    # client` (which also bounds it in HAProxy 2.6) is no shorter.
    keep_alive = _seconds(_directive(front, "timeout http-keep-alive"))
    assert keep_alive >= server_keep_alive, (keep_alive, server_keep_alive)
    assert _seconds(_directive(defaults, "timeout client")) >= keep_alive
    # Idle connections to a replica are purged (about half every pool-purge-delay) long before the
    # replica's keep-alive would close them.
    purge = re.search(r"pool-purge-delay (\S+)", _directive(back, "default-server")).group(1)
    assert _seconds(purge) * 10 <= server_keep_alive, (purge, server_keep_alive)


class _Stub(http.server.BaseHTTPRequestHandler):
    """A replica as the balancer sees it: /v2/health/ready 200 (still in rotation), POST answered as
    `mode` says: "ok" (200), "draining" (503 + Retry-After, as a draining replica refuses a request it
    did not admit), "close" (reads the request, closes the connection without a byte)."""

    protocol_version = "HTTP/1.1"  # keep-alive
    mode = "ok"
    posts = 0

    def do_GET(self):  # noqa: N802 (http.server's naming)
        self._answer(200, b'{"ready": true}')

    def do_POST(self):  # noqa: N802
        body = self.rfile.read(int(self.headers.get("content-length", 0)))
        type(self).posts += 1
        if self.mode == "ok":
            self._answer(200, body)
        elif self.mode == "draining":
            self._answer(503, b'{"error": "draining"}', [("Retry-After", "1")])
        else:
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)

    def _answer(self, status, body, extra=()):
        self.send_response(status)
        for name, value in [("content-type", "application/json"), ("content-length", str(len(body))), *extra]:
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


class _StubServer(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):
        pass  # HAProxy resets its check connections once it has the status line; nothing to report


def _stub(mode: str):
    handler = type(f"Stub_{mode}", (_Stub,), {"mode": mode, "posts": 0})
    server = _StubServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, handler


FRONT_ENDS = {"http": ("frontend http", "backend serve_http", ":8081"),
              "grpc": ("frontend grpc", "backend serve", ":8080")}


def _one_front_end_config(port: int, servers: list[tuple[str, int]], front_end: str = "http") -> str:
    """The config's global, defaults and one front end with its backend (`http`: frontend http and
    backend serve_http; `grpc`: frontend grpc and backend serve), as written, but bound to
    127.0.0.1:<port> and with static servers instead of the DNS-filled slots."""
    frontend, backend, bind = FRONT_ENDS[front_end]
    text = CONFIG.read_text()
    keep = []
    for block in re.split(r"\n(?=\S)", text):
        head = block.split("\n", 1)[0].strip()
        if head in ("global", "defaults", frontend, backend):
            keep.append(block)
    config = "\n".join(keep) + "\n"
    config = config.replace(f"bind {bind}", f"bind 127.0.0.1:{port}")
    config = re.sub(r" resolvers docker init-addr none resolve-prefer ipv4", "", config)
    template = re.search(r"^\s*server-template .*$", config, re.M).group(0)
    static = "\n".join(f"    server {name} 127.0.0.1:{server_port}" for name, server_port in servers)
    return config.replace(template, static)


@contextlib.contextmanager
def _haproxy(tmp_path, servers: list[tuple[str, int]], front_end: str = "http"):
    """One front end of the config in a real HAProxy over `servers`; yields its port once it listens."""
    haproxy = shutil.which("haproxy")
    if haproxy is None:
        pytest.skip("no haproxy binary here (apt-get install haproxy); tests/test_deploy_lb.py runs it in Docker")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = tmp_path / "haproxy.cfg"
    cfg.write_text(_one_front_end_config(port, servers, front_end))
    log = (tmp_path / "haproxy.log").open("w")
    process = subprocess.Popen([haproxy, "-db", "-f", str(cfg)], stdout=log, stderr=subprocess.STDOUT)
    try:
        end = time.monotonic() + 10
        while True:  # bounded: until HAProxy listens
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert process.poll() is None and time.monotonic() < end, (tmp_path / "haproxy.log").read_text()
                time.sleep(0.05)
        yield port
    finally:
        process.terminate()
        process.wait(timeout=10)
        log.close()


@pytest.mark.parametrize("failing", ["draining", "close"])
def test_haproxy_replays_refused_and_unanswered_posts_on_another_replica(tmp_path, failing):
    bad, bad_handler = _stub(failing)
    good, good_handler = _stub("ok")
    # bad first: round robin sends it the first request
    try:
        with _haproxy(tmp_path, [("bad", bad.server_address[1]), ("good", good.server_address[1])]) as port:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)  # one pooled connection, no retry
            local_ports = set()
            for i in range(10):
                body = f'{{"request": {i}}}'.encode()
                conn.request("POST", "/v1/embeddings", body=body, headers={"content-type": "application/json"})
                local_ports.add(conn.sock.getsockname()[1])
                response = conn.getresponse()
                answer = (response.status, response.read())
                assert answer == (200, body), f"request {i}: {answer}"
            conn.close()
        assert len(local_ports) == 1, local_ports  # HAProxy never closed the client's connection
        assert good_handler.posts == 10 and bad_handler.posts >= 1, (good_handler.posts, bad_handler.posts)
    finally:
        bad.shutdown()
        good.shutdown()


# --- model repository control -----------------------------------------------------------------------

def test_http_frontend_refuses_model_load_and_unload_which_would_reach_one_replica():
    front = _sections()["frontend http"]
    (deny,) = [line for line in front if line.startswith("http-request deny")]
    assert "deny_status 403" in deny and deny.endswith("if { path_beg /v2/repository/models/ }"), deny


def test_haproxy_answers_grpc_load_unload_and_reload_itself_and_passes_the_rest(tmp_path, health_server):
    """Through the gRPC front end: the calls that change one replica's models get FAILED_PRECONDITION
    from HAProxy (a trailers-only reply grpcio reads as a status), everything else reaches the replica
    (here a health-only gRPC server: SERVING for health, UNIMPLEMENTED for the index calls it lacks)."""
    servicer, replica_port = health_server
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    refused = ("/inference.GRPCInferenceService/RepositoryModelLoad", "/inference.GRPCInferenceService/RepositoryModelUnload",
               "/encoder.v1.AdminService/LoadModel", "/encoder.v1.AdminService/UnloadModel",
               "/encoder.v1.AdminService/ReloadModel")
    passed = ("/inference.GRPCInferenceService/RepositoryIndex", "/encoder.v1.AdminService/ListModels",
              "/inference.GRPCInferenceService/ModelInfer")
    with _haproxy(tmp_path, [("replica", replica_port)], "grpc") as port, \
            grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        health_stub = health_pb2_grpc.HealthStub(channel)
        assert health_stub.Check(health_pb2.HealthCheckRequest(), timeout=10).status == \
            health_pb2.HealthCheckResponse.SERVING
        for method in refused + passed:
            with pytest.raises(grpc.RpcError) as error:
                channel.unary_unary(method)(b"", timeout=10)
            code, details = error.value.code(), error.value.details()
            if method in refused:
                assert code == grpc.StatusCode.FAILED_PRECONDITION and "each replica" in details, (method, code, details)
            else:
                assert code == grpc.StatusCode.UNIMPLEMENTED, (method, code, details)  # the replica's answer


def test_haproxy_answers_load_and_unload_itself_and_passes_the_repository_index(tmp_path):
    replica, handler = _stub("ok")
    try:
        with _haproxy(tmp_path, [("replica", replica.server_address[1])]) as port:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            for path in ("/v2/repository/models/all-minilm-l6-v2/load", "/v2/repository/models/default/unload"):
                conn.request("POST", path, body=b"{}", headers={"content-type": "application/json"})
                response = conn.getresponse()
                body = json.loads(response.read())
                assert response.status == 403 and "each replica" in body["error"], (path, response.status, body)
            assert handler.posts == 0  # refused at the balancer: no replica saw it
            conn.request("POST", "/v2/repository/index", body=b"{}", headers={"content-type": "application/json"})
            response = conn.getresponse()
            assert (response.status, response.read()) == (200, b"{}")
            conn.close()
        assert handler.posts == 1
    finally:
        replica.shutdown()
