"""Replicas behind the load balancer, for real: part of the suite wherever tests/test_docker_smoke.py runs
(a Docker engine, or root with ../shared/tools/local-docker.sh); ~45 s with the CPU image built, ~1 min
more the first time (the LB image's apt install). SMOKE_LB=0 skips it.

docker-compose brings up 3 CPU replicas (`serve-cpu`, scaled) behind HAProxy (`lb`, docker/haproxy.cfg)
under a unique project name, with every published port on 127.0.0.1; the balancer fronts their gRPC
(backend `serve`) and their HTTP (backend `serve_http`). From the host, a bounded number of Encode
calls goes through the balancer on one gRPC channel; every answer is compared with PyTorch, and each
replica's own Prometheus counter (read inside its container) shows that it served requests, the deltas
adding up to exactly what was sent. Then:

* a replica is frozen (`docker pause`: it stays in Docker's DNS, its port still accepts connections,
  but nothing answers), so only the active health checks can take it out: HAProxy's stats page shows
  it DOWN by its gRPC check and by its HTTP check, traffic goes on without a single failed call, and
  its counter does not move; unpaused, one good check brings it back UP in both;
* pooled HTTP clients (threads, each on one keep-alive connection that it never reopens) send
  POST /v1/embeddings through the balancer's HTTP port while a replica is restarted (`docker restart`:
  SIGTERM, drain, exit, start, load): its HTTP check marks it DOWN, not one request fails (every
  answer 200 and equal to PyTorch's), no client connection is closed under a client, the balancer
  retried the requests the draining replica refused, and once back UP the replica serves them again;
* a replica is stopped (`docker stop`: SIGTERM, drain, exit); HAProxy stops routing to it and every
  call still succeeds on the others.

The clients never retry (gRPC: retries=0; HTTP: one attempt per request), so a request sent to an
ejected replica, or a connection closed under a client, would fail the test.
"""

from __future__ import annotations

import csv
import http.client
import io
import json
import os
import random
import socket
import subprocess
import threading
import time
import urllib.request
import uuid

import numpy as np
import pytest

from export.contract import FP32_TOLERANCE
from tests.docker_env import DOCKER, ensure_engine, free_port, run

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(1800),
    pytest.mark.skipif(os.environ.get("SMOKE_LB") == "0", reason="SMOKE_LB=0"),
]

REPLICAS = 3
REQUESTS = 60  # per traffic round; bounded
HTTP_CLIENTS = 3  # pooled HTTP clients, one keep-alive connection each
HTTP_CAP = 6000  # requests per HTTP client at most (at the pace below, over a minute of traffic); bounded
HTTP_PACE_S = 0.01  # between one answer and the next request: steady traffic, the 2 cores left to the replicas
HTTP_WARM = 20  # answers each HTTP client has checked before the restart begins
HTTP_BACK = 20  # requests the restarted replica serves again, through the same connections, before the end
REF_ATOL = FP32_TOLERANCE["limit"]  # the export's fp32 tolerance vs PyTorch
DEADLINE_S = 120  # for any state to be reached (health, ejection, return)


def _ephemeral_low() -> int:
    """The lowest port the kernel hands out for a bind to port 0 (ip_local_port_range; 32768 where unreadable)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as ports:
            return int(ports.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _free_range(size: int) -> str:
    """`a-b`: `size` consecutive free ports on 127.0.0.1 (compose publishes one per replica from it), below the
    kernel's ephemeral range: a restarted replica binds its port again (docker restart), and a port of that range
    may meanwhile be taken by any bind to port 0 (the other test worker's servers and clients: "address already in
    use", seen beside a CPU hog)."""
    low, pick = _ephemeral_low(), random.Random()
    for _ in range(50):
        start = pick.randrange(10000, max(10001, low - size))
        sockets = []
        try:
            for port in range(start, start + size):
                sock = socket.socket()
                sock.bind(("127.0.0.1", port))
                sockets.append(sock)
            return f"{start}-{start + size - 1}"
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()
    raise RuntimeError("no range of free ports")


class LbProject:
    def __init__(self, compose: str) -> None:
        self.name = f"enclb{uuid.uuid4().hex[:8]}"
        self.compose = compose
        self.lb_port, self.lb_http_port, self.stats_port = free_port(), free_port(), free_port()
        # the volume (the model repository) holds one model, serve-test: what a call naming none gets
        self.env = {"COMPOSE_PROJECT_NAME": self.name, "SERVE_BIND": "127.0.0.1", "ENCODER_DEFAULT_MODEL": "serve-test",
                    "LB_UPSTREAM": "serve-cpu", "LB_PORT": str(self.lb_port),
                    "LB_HTTP_PORT": str(self.lb_http_port), "LB_STATS_PORT": str(self.stats_port),
                    "SERVE_CPU_GRPC_PORT": _free_range(REPLICAS + 1),
                    "SERVE_CPU_METRICS_PORT": _free_range(REPLICAS + 1),
                    "SERVE_CPU_HTTP_PORT": _free_range(REPLICAS + 1),
                    "ENCODER_INTRA_OP_THREADS": "1",  # 3 replicas on 2 cores
                    # no drain delay (compose's default is 3 s): a replica refuses (503) at once on SIGTERM,
                    # the worst case, so the restart test proves the balancer's retries carry it
                    "ENCODER_DRAIN_DELAY_S": "0"}
        self.volume = f"{self.name}_exports"

    def run(self, *args: str, **kwargs):
        return run([self.compose, "-p", self.name, "-f", "docker-compose.yml", "--profile", "cpu", "--profile", "lb",
                    *args], env=self.env, **kwargs)

    def containers(self, service: str) -> list[str]:
        return self.run("ps", "-q", service).stdout.split()

    def down(self) -> None:
        self.run("down", "-v", "--remove-orphans", "-t", "20", check=False)
        run([DOCKER, "volume", "rm", "-f", self.volume], check=False)


def _until(condition, what: str, timeout: float = DEADLINE_S, pause: float = 0.5):
    end = time.monotonic() + timeout
    last = None
    while time.monotonic() < end:
        last = condition()
        if last:
            return last
        time.sleep(pause)
    raise AssertionError(f"{what} not reached within {timeout}s (last: {last!r})")


def _ip(container: str) -> str:
    return run([DOCKER, "inspect", "-f", "{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}",
                container]).stdout.strip()


def _encode_count(container: str, method: str = "Encode") -> float:
    """encoder_requests_total{method=<method>,code="OK"} read inside the replica (its own /metrics);
    HTTP's POST /v1/embeddings counts as method "openai.Embeddings"."""
    code = ("import urllib.request\n"
            "text = urllib.request.urlopen('http://127.0.0.1:9464/metrics', timeout=5).read().decode()\n"
            "print(sum(float(l.split()[-1]) for l in text.splitlines()\n"
            f"          if l.startswith('encoder_requests_total{{') and 'method=\"{method}\"' in l"
            " and 'code=\"OK\"' in l))")
    return float(run([DOCKER, "exec", container, "python", "-c", code], timeout=60).stdout.strip())


def _lb_rows(project: LbProject, backend: str) -> list[dict[str, str]]:
    url = f"http://127.0.0.1:{project.stats_port}/stats;csv"
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode().lstrip("# ")
    rows = [row for row in csv.DictReader(io.StringIO(text)) if row["pxname"] == backend]
    for row in rows:  # "* L7TOUT": the last check's status while the next one runs (HAProxy's management.txt)
        row["check_status"] = row.get("check_status", "").removeprefix("* ")
    return rows


def _lb_servers(project: LbProject, backend: str = "serve") -> dict[str, dict[str, str]]:
    """HAProxy's view of a backend (`serve`: gRPC, `serve_http`: HTTP), keyed by replica address: status
    (UP/DOWN/MAINT), check_status, check_code, counters."""
    return {row["addr"].rsplit(":", 1)[0]: row for row in _lb_rows(project, backend)
            if row["svname"] not in ("BACKEND", "FRONTEND") and row["addr"]}


def _lb_backend(project: LbProject, backend: str) -> dict[str, str]:
    """The backend's own row: wretr (retries), wredis (redispatches), hrsp_5xx, ..."""
    (row,) = [row for row in _lb_rows(project, backend) if row["svname"] == "BACKEND"]
    return row


def _status(project: LbProject, ip: str, backend: str = "serve") -> str:
    try:
        return _lb_servers(project, backend).get(ip, {}).get("status", "absent")
    except OSError as error:
        return f"stats unreachable: {error}"


def _down_row(project: LbProject, ip: str, backend: str) -> dict[str, str] | None:
    try:
        row = _lb_servers(project, backend).get(ip, {})
    except OSError:
        return None
    return row if row.get("status") == "DOWN" else None


BACKENDS = ("serve", "serve_http")


@pytest.fixture(scope="module")
def lb(serve_export_dir):
    compose = ensure_engine()
    project = LbProject(compose)
    started = time.monotonic()
    try:
        project.run("build", "serve-cpu", "lb", timeout=1500)
        run([DOCKER, "volume", "create", "--label", f"com.docker.compose.project={project.name}",
             "--label", "com.docker.compose.volume=exports", project.volume])
        run([DOCKER, "run", "--rm", "--user", "0", "--entrypoint", "sh",
             "-v", f"{project.volume}:/exports", "-v", f"{serve_export_dir}:/src:ro", "onnx-encoder-serve:cpu", "-c",
             "cp -r /src /exports/serve-test && chown -R 10001:10001 /exports/serve-test"])
        project.run("up", "-d", "--no-build", "--scale", f"serve-cpu={REPLICAS}", "serve-cpu", "lb", timeout=600)
        replicas = project.containers("serve-cpu")
        assert len(replicas) == REPLICAS, replicas
        ips = {container: _ip(container) for container in replicas}
        _until(lambda: all(_status(project, ip, backend) == "UP" for ip in ips.values() for backend in BACKENDS),
               f"all {REPLICAS} replicas UP in HAProxy (gRPC and HTTP)")
        print(f"{REPLICAS} replicas UP behind HAProxy {time.monotonic() - started:.0f} s after the build started")
        yield project, ips
    finally:
        if os.environ.get("SMOKE_KEEP") != "1":
            project.down()
        print(f"LB test project up and down in {time.monotonic() - started:.0f} s")


def _traffic(project: LbProject, serve_reference, count: int = REQUESTS) -> None:
    """`count` Encode calls through the balancer on one channel, each checked against PyTorch."""
    from client import EncoderClient

    rng = np.random.default_rng(16)
    with EncoderClient(f"127.0.0.1:{project.lb_port}", retries=0, timeout=30) as client:
        for _ in range(count):
            ids = rng.integers(1, 100, size=int(rng.integers(3, 12))).astype(np.int64)
            out = client.encode([ids], hidden_states=True)
            hidden, pooled = serve_reference(ids)
            assert out.hidden_states[0].shape == hidden.shape and out.hidden_states[0].dtype == np.float32
            np.testing.assert_allclose(out.hidden_states[0], hidden, atol=REF_ATOL, rtol=0)
            np.testing.assert_allclose(out.embeddings[0], pooled, atol=REF_ATOL, rtol=0)


def test_requests_spread_over_every_replica_and_match_pytorch(lb, serve_reference):
    project, ips = lb
    before = {container: _encode_count(container) for container in ips}
    _traffic(project, serve_reference)
    served = {container: _encode_count(container) - before[container] for container in ips}
    print(f"Encode calls served per replica ({REQUESTS} sent): {sorted(served.values())}")
    assert sum(served.values()) == REQUESTS
    assert all(count > 0 for count in served.values()), served


def test_a_hung_replica_is_ejected_by_the_health_check_and_comes_back(lb, serve_reference):
    project, ips = lb
    frozen, ip = next(iter(ips.items()))
    others = [container for container in ips if container != frozen]
    count_before = _encode_count(frozen)
    run([DOCKER, "pause", frozen])
    try:
        for backend in BACKENDS:  # the gRPC check and the HTTP one, each on its own
            row = _until(lambda: _down_row(project, ip, backend), f"the paused replica DOWN in HAProxy ({backend})")
            print(f"paused replica DOWN by its {backend} check: check_status={row.get('check_status')}")
            assert row["check_status"] in ("L4TOUT", "L7TOUT", "L4CON", "L7RSP"), row  # a failed check, not DNS
        before = {container: _encode_count(container) for container in others}
        _traffic(project, serve_reference)
        served = {container: _encode_count(container) - before[container] for container in others}
        assert sum(served.values()) == REQUESTS, served
    finally:
        run([DOCKER, "unpause", frozen], check=False)
    assert _encode_count(frozen) == count_before, "the ejected replica was sent requests"
    _until(lambda: all(_status(project, ip, backend) == "UP" for backend in BACKENDS),
           "the unpaused replica back UP (gRPC and HTTP)")


class PooledClient(threading.Thread):
    """A keep-alive HTTP client as a connection pool holds one: one `http.client.HTTPConnection`, opened
    once, POST /v1/embeddings after POST /v1/embeddings on it until `stop` (at most HTTP_CAP), each
    answer checked against PyTorch. No retry: a failed request is recorded and the next one goes on. It
    records the local port of every connection it used: one, unless something closed it under the client
    (http.client then reconnects on its own, which a pool would see as a dropped connection)."""

    def __init__(self, index: int, port: int, cases: list, stop: threading.Event) -> None:
        super().__init__(name=f"pooled-http-{index}", daemon=True)
        self.index, self.port, self.cases, self.stop = index, port, cases, stop
        self.warm = threading.Event()  # set after HTTP_WARM good answers
        self.ok = 0
        self.errors: list[str] = []
        self.local_ports: set[int] = set()

    def run(self) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            for i in range(HTTP_CAP):
                if self.stop.is_set() or len(self.errors) >= 20:
                    break
                body, expected = self.cases[(i + self.index * 5) % len(self.cases)]
                error = self._one(conn, body, expected)
                if error is None:
                    self.ok += 1
                    if self.ok == HTTP_WARM:
                        self.warm.set()
                else:
                    self.errors.append(f"request {i}: {error}")
                self.stop.wait(HTTP_PACE_S)  # pacing, not ordering: `stop` ends the loop at once
        finally:
            conn.close()
            self.warm.set()  # a client that ended early (errors) must not leave the test waiting

    def _one(self, conn: http.client.HTTPConnection, body: bytes, expected: np.ndarray) -> str | None:
        try:
            conn.request("POST", "/v1/embeddings", body=body, headers={"content-type": "application/json"})
            self.local_ports.add(conn.sock.getsockname()[1])
            response = conn.getresponse()
            payload = response.read()
        except (OSError, http.client.HTTPException) as error:
            conn.close()  # the next request opens a new connection (and the test fails on both counts)
            return repr(error)
        if response.status != 200:
            return f"HTTP {response.status}: {payload[:300]!r}"
        try:
            data = json.loads(payload)["data"]
            got = np.array([item["embedding"] for item in sorted(data, key=lambda item: item["index"])], np.float32)
            assert got.shape == expected.shape, (got.shape, expected.shape)
            np.testing.assert_allclose(got, expected, atol=REF_ATOL, rtol=0)
        except (AssertionError, KeyError, TypeError, ValueError) as error:
            return f"wrong answer: {str(error)[:300]}"
        return None


def _embedding_cases(serve_reference, count: int = 12) -> list[tuple[bytes, np.ndarray]]:
    """(request body, PyTorch's pooled embeddings) for `count` requests of 1 to 3 sequences; every fourth
    body padded to ~12 kB with the ignored `user` field (still within one HAProxy buffer, so replayable)."""
    rng = np.random.default_rng(31)
    cases = []
    for k in range(count):
        inputs = [rng.integers(1, 100, size=int(rng.integers(3, 40))).astype(np.int64) for _ in range(1 + k % 3)]
        request = {"model": "serve-test", "input": [ids.tolist() for ids in inputs]}
        if k % 4 == 3:
            request["user"] = "u" * 12_000
        expected = np.stack([serve_reference(ids)[1] for ids in inputs]).astype(np.float32)
        cases.append((json.dumps(request).encode(), expected))
    return cases


def test_pooled_http_clients_see_no_error_across_a_replica_restart(lb, serve_reference):
    project, ips = lb
    restarted, ip = list(ips.items())[1]  # not the paused one, not the one the last test stops
    cases = _embedding_cases(serve_reference)
    retries_before = int(_lb_backend(project, "serve_http")["wretr"] or 0)
    stop = threading.Event()
    clients = [PooledClient(n, project.lb_http_port, cases, stop) for n in range(HTTP_CLIENTS)]
    for client in clients:
        client.start()
    started = time.monotonic()
    try:
        for client in clients:
            assert client.warm.wait(DEADLINE_S), f"{client.name}: no {HTTP_WARM} answers in {DEADLINE_S} s"
        assert not any(client.errors for client in clients), [client.errors for client in clients]
        # SIGTERM (drain: /v2/health/ready says 503, new requests get 503), exit, start, load
        restart = subprocess.Popen([DOCKER, "restart", "-t", "40", restarted], stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True)
        try:
            row = _until(lambda: _down_row(project, ip, "serve_http"), "the restarting replica DOWN by its HTTP check",
                         pause=0.1)
        finally:
            output, _ = restart.communicate(timeout=180)
        print(f"restarting replica DOWN by its HTTP check: check_status={row.get('check_status')} "
              f"check_code={row.get('check_code')}")
        assert row["check_status"] in ("L7STS", "L4CON", "L4TOUT", "L7TOUT"), row  # 503 (draining), refused, ...
        assert restart.returncode == 0, output
        ips[restarted] = new_ip = _ip(restarted)  # Docker may give it another address
        _until(lambda: all(_status(project, new_ip, backend) == "UP" for backend in BACKENDS),
               "the restarted replica back UP (gRPC and HTTP)")
        back = _until(lambda: (lambda n: n if n >= HTTP_BACK else None)(_encode_count(restarted, "openai.Embeddings")),
                      "the restarted replica serving the pooled clients again")
        ended_early = [client.name for client in clients if not client.is_alive()]  # budget spent, or errors
    finally:
        stop.set()
        for client in clients:
            client.join(timeout=60)
    answered = sum(client.ok for client in clients)
    retries = int(_lb_backend(project, "serve_http")["wretr"] or 0) - retries_before
    print(f"{HTTP_CLIENTS} pooled HTTP clients: {answered} requests answered right in "
          f"{time.monotonic() - started:.1f} s across the restart ({back:.0f} by the restarted replica since), "
          f"balancer retries {retries}, connections per client {[len(client.local_ports) for client in clients]}")
    errors = [f"{client.name}: {error}" for client in clients for error in client.errors]
    assert not errors, errors
    assert not ended_early, f"{ended_early}: sent all {HTTP_CAP} requests before the restarted replica was back"
    assert all(len(client.local_ports) == 1 for client in clients), "a pooled connection was closed under a client"
    # not vacuous: the draining replica refused requests (503) and the balancer replayed them elsewhere
    assert retries > 0, "no request met the draining replica: the restart was not exercised"


def test_a_stopped_replica_leaves_rotation_without_failed_calls(lb, serve_reference):
    project, ips = lb
    stopped, ip = list(ips.items())[-1]
    others = [container for container in ips if container != stopped]
    run([DOCKER, "stop", "-t", "40", stopped], timeout=120)
    _until(lambda: all(_status(project, ip, backend) != "UP" for backend in BACKENDS),
           "the stopped replica out of HAProxy's rotation (gRPC and HTTP)")
    before = {container: _encode_count(container) for container in others}
    _traffic(project, serve_reference)
    served = {container: _encode_count(container) - before[container] for container in others}
    assert sum(served.values()) == REQUESTS and all(count > 0 for count in served.values()), served
