"""Replicas behind the load balancer, for real: part of the suite wherever tests/test_docker_smoke.py runs
(a Docker engine, or root with ../shared/tools/local-docker.sh); ~45 s with the CPU image built, ~1 min
more the first time (the LB image's apt install). SMOKE_LB=0 skips it.

docker-compose brings up 3 CPU replicas (`serve-cpu`, scaled) behind HAProxy (`lb`, docker/haproxy.cfg)
under a unique project name, with every published port on 127.0.0.1. From the host, a bounded number
of Encode calls goes through the balancer on one gRPC channel; every answer is compared with PyTorch,
and each replica's own Prometheus counter (read inside its container) shows that it served requests,
the deltas adding up to exactly what was sent. Then:

* a replica is frozen (`docker pause`: it stays in Docker's DNS, its port still accepts connections,
  but nothing answers), so only the active gRPC health check can take it out: HAProxy's stats page
  shows it DOWN by its check, traffic goes on without a single failed call, and its counter does not
  move; unpaused, one good check brings it back UP;
* a replica is stopped (`docker stop`: SIGTERM, drain, exit); HAProxy stops routing to it and every
  call still succeeds on the others.

The clients never retry (retries=0), so a request sent to an ejected replica would fail the test.
"""

from __future__ import annotations

import csv
import io
import os
import socket
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
REF_ATOL = FP32_TOLERANCE["limit"]  # the export's fp32 tolerance vs PyTorch
DEADLINE_S = 120  # for any state to be reached (health, ejection, return)


def _free_range(size: int) -> str:
    """`a-b`: `size` consecutive free ports on 127.0.0.1 (compose publishes one per replica from it)."""
    for _ in range(50):
        start = free_port()
        if start + size > 65535:
            continue
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
        self.lb_port, self.stats_port = free_port(), free_port()
        self.env = {"COMPOSE_PROJECT_NAME": self.name, "SERVE_BIND": "127.0.0.1", "ENCODER_MODEL": "serve-test",
                    "LB_UPSTREAM": "serve-cpu", "LB_PORT": str(self.lb_port), "LB_STATS_PORT": str(self.stats_port),
                    "SERVE_CPU_GRPC_PORT": _free_range(REPLICAS + 1),
                    "SERVE_CPU_METRICS_PORT": _free_range(REPLICAS + 1),
                    "SERVE_CPU_HTTP_PORT": _free_range(REPLICAS + 1),
                    "ENCODER_INTRA_OP_THREADS": "1"}  # 3 replicas on 2 cores
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


def _encode_count(container: str) -> float:
    """encoder_requests_total{method="Encode",code="OK"} read inside the replica (its own /metrics)."""
    code = ("import urllib.request\n"
            "text = urllib.request.urlopen('http://127.0.0.1:9464/metrics', timeout=5).read().decode()\n"
            "print(sum(float(l.split()[-1]) for l in text.splitlines()\n"
            "          if l.startswith('encoder_requests_total{') and 'method=\"Encode\"' in l and 'code=\"OK\"' in l))")
    return float(run([DOCKER, "exec", container, "python", "-c", code], timeout=60).stdout.strip())


def _lb_servers(project: LbProject) -> dict[str, dict[str, str]]:
    """HAProxy's view of backend `serve`, keyed by replica address: status (UP/DOWN/MAINT), check_status."""
    url = f"http://127.0.0.1:{project.stats_port}/stats;csv"
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode().lstrip("# ")
    rows = csv.DictReader(io.StringIO(text))
    return {row["addr"].rsplit(":", 1)[0]: row for row in rows
            if row["pxname"] == "serve" and row["svname"] not in ("BACKEND", "FRONTEND") and row["addr"]}


def _status(project: LbProject, ip: str) -> str:
    try:
        return _lb_servers(project).get(ip, {}).get("status", "absent")
    except OSError as error:
        return f"stats unreachable: {error}"


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
        _until(lambda: all(_status(project, ip) == "UP" for ip in ips.values()),
               f"all {REPLICAS} replicas UP in HAProxy")
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
        row = _until(lambda: (lambda r: r if r.get("status") == "DOWN" else None)(_lb_servers(project).get(ip, {})),
                     "the paused replica DOWN in HAProxy")
        print(f"paused replica DOWN by its check: check_status={row.get('check_status')}")
        assert row["check_status"] in ("L4TOUT", "L7TOUT", "L4CON", "L7RSP"), row  # a failed check, not DNS
        before = {container: _encode_count(container) for container in others}
        _traffic(project, serve_reference)
        served = {container: _encode_count(container) - before[container] for container in others}
        assert sum(served.values()) == REQUESTS, served
    finally:
        run([DOCKER, "unpause", frozen], check=False)
    assert _encode_count(frozen) == count_before, "the ejected replica was sent requests"
    _until(lambda: _status(project, ip) == "UP", "the unpaused replica back UP")


def test_a_stopped_replica_leaves_rotation_without_failed_calls(lb, serve_reference):
    project, ips = lb
    stopped, ip = list(ips.items())[-1]
    others = [container for container in ips if container != stopped]
    run([DOCKER, "stop", "-t", "40", stopped], timeout=120)
    _until(lambda: _status(project, ip) != "UP", "the stopped replica out of HAProxy's rotation")
    before = {container: _encode_count(container) for container in others}
    _traffic(project, serve_reference)
    served = {container: _encode_count(container) - before[container] for container in others}
    assert sum(served.values()) == REQUESTS and all(count > 0 for count in served.values()), served
