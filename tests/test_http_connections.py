"""HTTP under the clients people use (serve/transport/http.py, serve/transport/http_connections.py):
pooled keep-alive clients, bodies sent whole, clients that leave or set a deadline, connections that
never finish their request, too many connections, and the bearer token as HTTP clients write it.
Real server processes on 127.0.0.1 (the gated ones in-process, so the test decides when a batch ends)."""

from __future__ import annotations

import http.client
import json
import resource
import selectors
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

httpx = pytest.importorskip("httpx")
requests = pytest.importorskip("requests")
openai = pytest.importorskip("openai")

from client import EncoderClient  # noqa: E402
from tests.reliability_common import wait_until  # noqa: E402
from tests.test_serve_lifecycle import GatedServer  # noqa: E402

BIG = 40 * 1000 * 1000  # a body well over the default max_request_bytes (16 MiB), sent whole
OLD_KEEP_ALIVE_S = 5.0  # uvicorn's default idle timeout, which closed pooled connections under their clients


@pytest.fixture(scope="module")
def server(serve_start, serve_export_dir):
    return serve_start(serve_export_dir)


def url(server, path: str) -> str:
    return f"http://127.0.0.1:{server.http_port}{path}"


def embeddings_body(server, ids=((1, 2, 3),)) -> bytes:
    return json.dumps({"model": EncoderClient(server.target).model_info().name, "input": [list(x) for x in ids]}).encode()


def requests_total(gated: GatedServer, code: str) -> float:
    return gated.server.metrics.registry.get_sample_value(
        "encoder_requests_total", {"method": "openai.Embeddings", "code": code}) or 0.0


# -- answers leave at once ---------------------------------------------------------------------
def test_every_accepted_connection_has_tcp_nodelay(serve_export_dir):
    """uvicorn writes an answer's head and body apart; without TCP_NODELAY the body waits for the
    client's delayed ACK (40 ms) on every keep-alive request. Read off the server's own sockets."""
    gated = GatedServer(serve_export_dir)
    try:
        port = gated.server.http.port
        with socket.create_connection(("127.0.0.1", port), timeout=10) as client:
            client.sendall(b"GET /v2/health/live HTTP/1.1\r\nhost: x\r\n\r\n")
            assert client.recv(4096).startswith(b"HTTP/1.1 200")
            accepted = [c.transport.get_extra_info("socket") for c in gated.server.http._server.server_state.connections]
            assert accepted, "the server holds no connection"
            assert all(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) for s in accepted)
    finally:
        gated.server.shutdown(5)


# -- keep-alive ---------------------------------------------------------------------------------
def test_pooled_clients_idle_past_the_old_keep_alive_then_send_again_without_error(server):
    """One connection each, idle longer than uvicorn's old 5 s, then reused. http.client shows a
    server-side close as an error (it does not reconnect); the pools must simply not fail."""
    body = embeddings_body(server)
    raw = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=30)
    session = requests.Session()
    pool = httpx.Client(timeout=30)
    oai = openai.OpenAI(base_url=url(server, "/v1"), api_key="unused", max_retries=0)
    name = EncoderClient(server.target).model_info().name

    def raw_call() -> int:
        raw.request("POST", "/v1/embeddings", body=body, headers={"content-type": "application/json"})
        response = raw.getresponse()
        response.read()
        return response.status

    calls = {
        "http.client": raw_call,
        "requests.Session": lambda: session.post(url(server, "/v1/embeddings"), data=body, timeout=30).status_code,
        "httpx.Client": lambda: pool.post(url(server, "/v1/embeddings"), content=body).status_code,
        "openai": lambda: 200 if oai.embeddings.create(model=name, input=[[1, 2, 3]]).data else 0,
    }
    assert {k: call() for k, call in calls.items()} == dict.fromkeys(calls, 200)
    first_port = raw.sock.getsockname()[1]
    time.sleep(OLD_KEEP_ALIVE_S + 1.5)  # the behaviour under test is idleness itself
    assert {k: call() for k, call in calls.items()} == dict.fromkeys(calls, 200)
    assert raw.sock.getsockname()[1] == first_port  # the same connection, still open
    for closeable in (raw, session, pool, oai):
        closeable.close()


def test_the_keep_alive_idle_timeout_is_configurable(serve_start, serve_export_dir):
    server = serve_start(serve_export_dir, "--http-keep-alive-s", "0.5")
    with socket.create_connection(("127.0.0.1", server.http_port), timeout=30) as client:
        client.sendall(b"GET /v2/health/live HTTP/1.1\r\nhost: x\r\n\r\n")
        answer = b""
        while b'"live"' not in answer:
            answer += client.recv(4096)
        client.settimeout(30)
        assert client.recv(4096) == b""  # the server closed the idle connection (within 30 s)


# -- refusals that reach the client ---------------------------------------------------------------
def _urllib_big(server) -> tuple[int, dict]:
    request = urllib.request.Request(url(server, "/v1/embeddings"), data=b"x" * BIG, method="POST",
                                     headers={"content-type": "application/json"})
    try:
        urllib.request.urlopen(request, timeout=60)
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())
    return 200, {}


@pytest.mark.parametrize("client", ["urllib", "requests", "httpx"])
def test_a_40_mb_body_sent_whole_gets_its_413_with_a_json_body(server, client):
    """These clients send the whole body without waiting for `100 Continue`: the server reads and
    drops it, so the client reads the 413 instead of a reset."""
    if client == "urllib":
        status, answer = _urllib_big(server)
    elif client == "requests":
        response = requests.post(url(server, "/v1/embeddings"), data=b"x" * BIG, timeout=60)
        status, answer = response.status_code, response.json()
    else:
        response = httpx.post(url(server, "/v1/embeddings"), content=b"x" * BIG, timeout=60)
        status, answer = response.status_code, response.json()
    assert status == 413
    assert f"{BIG} bytes exceed max_request_bytes=16777216" in answer["error"]["message"]


def test_a_refused_body_leaves_the_pooled_connection_usable(server):
    with requests.Session() as session:
        assert session.post(url(server, "/v1/embeddings"), data=b"x" * BIG, timeout=60).status_code == 413
        assert session.post(url(server, "/v1/embeddings"), data=embeddings_body(server), timeout=30).status_code == 200


def test_a_wrong_path_with_a_large_body_gets_its_404(server):
    response = requests.post(url(server, "/v1/nothing"), data=b"x" * (4 * 1024 * 1024), timeout=60)
    assert response.status_code == 404 and "no such endpoint" in response.json()["error"]["message"]


# -- impatience ------------------------------------------------------------------------------------
def test_a_disconnected_clients_queued_request_is_cancelled_and_never_run(serve_export_dir):
    gated = GatedServer(serve_export_dir)
    port = gated.server.http.port
    body = embeddings_body(type("S", (), {"target": gated.target})())
    try:
        first = {}
        running = threading.Thread(target=lambda: first.update(
            status=requests.post(f"http://127.0.0.1:{port}/v1/embeddings", data=body, timeout=60).status_code))
        running.start()
        assert gated.entered.wait(30)  # a batch runs, held at the gate
        engine = gated.server.engine()
        leaving = socket.create_connection(("127.0.0.1", port), timeout=30)
        leaving.sendall(b"POST /v1/embeddings HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                        b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        assert wait_until(lambda: engine.batcher.queue_depth() == 1, 30)
        leaving.close()
        assert wait_until(lambda: all(t.cancelled for t in list(engine.batcher._queue)), 30)
        gated.release.set()
        running.join(30)
        assert first == {"status": 200}
        assert wait_until(lambda: requests_total(gated, "CANCELLED") == 1, 30)
        assert requests_total(gated, "OK") == 1
        assert gated.server.metrics.registry.get_sample_value("encoder_sequences_total") == 1  # never ran
    finally:
        gated.release.set()
        gated.server.shutdown(5)


def test_an_expired_http_deadline_is_answered_504(serve_export_dir):
    gated = GatedServer(serve_export_dir)
    port = gated.server.http.port
    body = embeddings_body(type("S", (), {"target": gated.target})())
    try:
        running = threading.Thread(target=lambda: requests.post(f"http://127.0.0.1:{port}/v1/embeddings",
                                                                data=body, timeout=60))
        running.start()
        assert gated.entered.wait(30)
        response = requests.post(f"http://127.0.0.1:{port}/v1/embeddings", data=body, timeout=60,
                                 headers={"X-Request-Timeout": "0.3"})
        assert response.status_code == 504
        assert "x-request-timeout" in response.json()["error"]["message"]
        gated.release.set()
        running.join(30)
        assert wait_until(lambda: requests_total(gated, "DEADLINE_EXCEEDED") == 1, 30)
        assert gated.server.metrics.registry.get_sample_value("encoder_sequences_total") == 1  # dropped, not run
    finally:
        gated.release.set()
        gated.server.shutdown(5)


@pytest.mark.parametrize("value", ["soon", "0", "-1", "nan", "inf"])
def test_a_malformed_deadline_header_is_refused_naming_it(server, value):
    response = requests.post(url(server, "/v1/embeddings"), data=embeddings_body(server), timeout=30,
                             headers={"X-Request-Timeout": value})
    assert response.status_code == 400
    assert "x-request-timeout: expected a number of seconds > 0" in response.json()["error"]["message"]


def test_a_request_with_a_deadline_that_holds_is_answered(server):
    response = requests.post(url(server, "/v1/embeddings"), data=embeddings_body(server), timeout=30,
                             headers={"X-Request-Timeout": "30"})
    assert response.status_code == 200 and response.json()["data"]


# -- connections that cannot hold the server hostage ------------------------------------------------
def _open_files_for(n: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < n:
        if hard != resource.RLIM_INFINITY and hard < n:
            pytest.skip(f"this host allows {hard} open files; the test needs {n}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (n, hard))


def test_half_requests_are_closed_at_the_header_timeout_while_a_normal_request_is_served(serve_start,
                                                                                          serve_export_dir):
    flood = 1000
    _open_files_for(flood + 512)
    server = serve_start(serve_export_dir, "--http-header-timeout-s", "2")
    sockets = []
    try:
        for _ in range(flood):
            s = socket.create_connection(("127.0.0.1", server.http_port), timeout=30)
            s.sendall(b"POST /v1/embeddings HT")  # half a request line, then nothing
            sockets.append(s)
        answer = requests.post(url(server, "/v1/embeddings"), data=embeddings_body(server), timeout=60)
        assert answer.status_code == 200 and answer.json()["data"]
        open_ = set(sockets)
        with selectors.DefaultSelector() as selector:
            for s in sockets:
                s.setblocking(False)
                selector.register(s, selectors.EVENT_READ)
            end = time.monotonic() + 120  # a bound on the test, far past the 2 s timeout on a busy machine
            while open_ and time.monotonic() < end:
                for key, _ in selector.select(timeout=1):
                    try:
                        data = key.fileobj.recv(4096)
                    except ConnectionResetError:
                        data = b""
                    assert data == b"", "a half request was answered instead of closed"
                    selector.unregister(key.fileobj)
                    open_.discard(key.fileobj)
        assert not open_, f"{len(open_)} of {flood} half requests still open"
        assert requests.get(url(server, "/v2/health/ready"), timeout=30).status_code == 200
    finally:
        for s in sockets:
            s.close()


def test_connections_past_the_cap_get_503_at_once_and_a_freed_place_serves_again(serve_start, serve_export_dir):
    server = serve_start(serve_export_dir, "--http-max-connections", "3")
    held = [socket.create_connection(("127.0.0.1", server.http_port), timeout=30) for _ in range(3)]
    try:
        for s in held:  # each is being served (a whole request answered) before the next one comes
            s.sendall(b"GET /v2/health/live HTTP/1.1\r\nhost: x\r\n\r\n")
            assert s.recv(4096).startswith(b"HTTP/1.1 200")
        response = requests.post(url(server, "/v1/embeddings"), data=embeddings_body(server), timeout=30)
        assert response.status_code == 503
        assert response.headers["retry-after"] == "1"
        assert "http_max_connections=3" in response.json()["error"]["message"]
        held.pop().close()

        def served() -> bool:
            return requests.post(url(server, "/v1/embeddings"), data=embeddings_body(server),
                                 timeout=30).status_code == 200

        assert wait_until(served, 30)
    finally:
        for s in held:
            s.close()


# -- the bearer token as HTTP clients send it ---------------------------------------------------------
@pytest.fixture(scope="module")
def token_server(serve_start, serve_export_dir):
    return serve_start(serve_export_dir, "--auth-token", "s3cret")


@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER"])
def test_the_bearer_scheme_is_matched_in_any_case(token_server, scheme):
    response = requests.get(url(token_server, "/v1/models"), headers={"authorization": f"{scheme} s3cret"},
                            timeout=30)
    assert response.status_code == 200


ROUTES = [("POST", "/v1/embeddings"), ("GET", "/v1/models"), ("GET", "/v2"), ("GET", "/v2/models/serve-test"),
          ("POST", "/v2/models/serve-test/infer"), ("POST", "/v1/nothing")]


@pytest.mark.parametrize("method,path", ROUTES)
@pytest.mark.parametrize("authorization,challenge", [(None, "Bearer"),
                                                     ("Bearer wrong", 'Bearer error="invalid_token"'),
                                                     ("Bearer s3cre", 'Bearer error="invalid_token"'),
                                                     ("Basic czNjcmV0", 'Bearer error="invalid_token"')])
def test_a_missing_or_wrong_token_is_401_with_www_authenticate_on_every_route(token_server, method, path,
                                                                              authorization, challenge):
    headers = {} if authorization is None else {"authorization": authorization}
    response = requests.request(method, url(token_server, path), data=b"{}" if method == "POST" else None,
                                headers=headers, timeout=30)
    assert response.status_code == 401
    assert response.headers["www-authenticate"] == challenge
    assert "send the header 'Authorization: Bearer <token>'" in response.text


def test_grpc_takes_the_lower_case_scheme_by_the_same_rule(token_server):
    import grpc

    from serve.protocols.pb import pb, pb_grpc

    with grpc.insecure_channel(token_server.target) as channel:
        info = pb_grpc.EncoderServiceStub(channel).GetModelInfo
        assert info(pb.GetModelInfoRequest(), metadata=(("authorization", "bearer s3cret"),), timeout=30).name
        with pytest.raises(grpc.RpcError) as caught:
            info(pb.GetModelInfoRequest(), metadata=(("authorization", "bearer wrong"),), timeout=30)
    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "send metadata 'authorization: Bearer <token>'" in caught.value.details()
