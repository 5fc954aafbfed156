"""Issue 31's soak: `python -m bench.soak [--minutes 10] [--export-dir DIR] [--json out.json]`.

The done-criterion it checks: "A soak (10 minutes, gRPC + HTTP at once, 70 % of capacity, pooled
clients): zero failed requests, RSS growth <= 3 %, p99 of the last minute <= 2x the second minute's".

1. The packaged all-MiniLM-L6-v2 (`python -m export --minilm` -> exports/all-minilm-l6-v2, reused when
   present) served by a real `python -m serve` subprocess on 127.0.0.1 (gRPC + HTTP, metrics off),
   started and stopped by bench.harness.running_server.
2. Capacity: a closed loop (--capacity-seconds, 20 s after 2 s of warm-up) of --capacity-clients
   clients, half over gRPC Encode (`texts`, mean pooling, normalized, truncate), half over HTTP POST
   /v1/embeddings (OpenAI shape, truncate), each HTTP client a keep-alive connection of its own
   (http.client.HTTPConnection kept per thread; one requests.Session thread too where `requests` is
   importable). The request mix: one short sentence, one sentence of 6-240 words, or 2-8 such.
3. The soak: an open loop at --load (0.7) x that rate for --minutes, the same mix, paced by a fixed
   schedule of send times alternating gRPC and HTTP, served by bounded pools of --workers threads per
   protocol (gRPC: one EncoderClient channel per 4 threads, retries off so that every failure shows;
   HTTP: one pooled connection per thread). Latency is counted from the scheduled send time (a request
   that waits for a free client thread waits on the clock), the send-to-answer time is kept beside it.
   Idle clients run beside the schedule: an http.client connection, a requests.Session (where
   importable) and a gRPC channel, each sending a burst of 1-4 requests and then sitting idle 6-20 s,
   longer than uvicorn's default 5 s keep-alive (which once broke pooled connections).
   Every request has a --timeout; every loop ends by the clock and by a count.
4. Every request's outcome and latency, per minute: requests, failures by kind (`http 503`,
   `grpc UNAVAILABLE`, `RemoteDisconnected`, `ConnectionError(ConnectionResetError)`, ...), p50, p99;
   the server's RSS (psutil: its pid and children) at the end of minute 1 and at the end; the verdicts.
   A table on stdout, everything in --json. Exit 0: every verdict that applies passed; 1: one failed;
   2: the run could not be made (export, server start). A run of 1 minute has no minute 2 and no RSS
   interval: those verdicts are "n/a" and do not fail it.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import queue
import random
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import psutil

from bench.harness import (LOOPBACK, MIB, REPO, ServerHandle, closed_loop, cpu_seconds, host_busy_seconds, percentiles,
                           rss_bytes, running_server, sentence)

DEFAULT_EXPORT = "exports/all-minilm-l6-v2"
SHORT = ("The quick brown fox jumps over the lazy dog.", "A first sentence.", "How do I reset my password?",
         "Une deuxième phrase.", "The weather is nice today.", "Where is the nearest train station?")
RSS_LIMIT_PCT = 3.0
P99_FACTOR = 2.0


MIXED = [sentence(random.Random(i).randint(6, 240), random.Random(1000 + i)) for i in range(256)]


def texts_for(rng: random.Random) -> list[str]:
    """One request's texts: a short sentence (45 %), one of 6-240 words (45 %), or 2-8 of them (10 %)."""
    roll = rng.random()
    if roll < 0.45:
        return [rng.choice(SHORT)]
    if roll < 0.9:
        return [rng.choice(MIXED)]
    return [rng.choice(MIXED) for _ in range(rng.randint(2, 8))]


# ------------------------------------------------------------------ outcomes
class HttpStatus(Exception):
    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(f"HTTP {status}: {body[:200]!r}")
        self.status = status


class BadResponse(Exception):
    pass


def failure_kind(error: BaseException) -> str:
    """`grpc CODE`, `http STATUS`, or the exception's type with its root cause's type in brackets."""
    import grpc

    if isinstance(error, grpc.RpcError) and hasattr(error, "code"):
        return f"grpc {error.code().name}"
    if isinstance(error, HttpStatus):
        return f"http {error.status}"
    root, seen = error, 0
    while seen < 6:  # requests wraps urllib3 wraps the socket error: name the innermost
        inner = root.__cause__ or root.__context__ or next(
            (a for a in getattr(root, "args", ()) if isinstance(a, BaseException)), None)
        if inner is None:
            break
        root, seen = inner, seen + 1
    name = type(error).__name__
    return name if root is error or type(root).__name__ == name else f"{name}({type(root).__name__})"


@dataclass
class Record:
    client: str
    protocol: str  # grpc | http
    t_sched: float  # seconds since the phase began: when it was due
    t_send: float  # when it was sent
    t_end: float
    n_texts: int
    failure: str = ""  # "" when it succeeded

    @property
    def latency_ms(self) -> float:  # from the scheduled send time (queueing in the client included)
        return 1e3 * (self.t_end - self.t_sched)

    @property
    def service_ms(self) -> float:  # from the actual send
        return 1e3 * (self.t_end - self.t_send)


# ------------------------------------------------------------------ callers: one pooled client each
class GrpcCaller:
    protocol = "grpc"

    def __init__(self, name: str, client, dim: int) -> None:
        self.name, self.stub, self.dim, self.connections = name, client.stub, dim, 0

    def __call__(self, texts: list[str], timeout: float) -> None:
        from client import build_request

        response = self.stub.Encode(build_request((), texts=texts, truncate=True, pooling="mean", normalize=True),
                                    timeout=timeout)
        if len(response.results) != len(texts) or any(
                len(r.embedding.data) != 4 * self.dim for r in response.results):
            raise BadResponse(f"{len(response.results)} results for {len(texts)} texts")

    def close(self) -> None:
        pass


def check_openai(body: bytes, n: int, dim: int) -> None:
    data = json.loads(body).get("data", [])
    if len(data) != n or any(len(d.get("embedding", ())) != dim for d in data):
        raise BadResponse(f"{len(data)} embeddings for {n} texts")


class HttpConnCaller:
    """http.client.HTTPConnection kept across requests (keep-alive); on an error it is closed and the
    next request opens a new one. `connections` counts the TCP connections it opened."""
    protocol = "http"

    def __init__(self, name: str, port: int, model: str, dim: int) -> None:
        self.name, self.port, self.model, self.dim = name, port, model, dim
        self.conn: http.client.HTTPConnection | None = None
        self.connections = 0

    def __call__(self, texts: list[str], timeout: float) -> None:
        if self.conn is None:
            self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        self.conn.timeout = timeout
        if self.conn.sock is None:  # first use, or the server asked to close the last one
            self.connections += 1
        body = json.dumps({"model": self.model, "input": texts, "truncate": True}).encode()
        try:
            self.conn.request("POST", "/v1/embeddings", body, {"Content-Type": "application/json"})
            response = self.conn.getresponse()
            data = response.read()
        except BaseException:
            self.close()
            raise
        if response.status != 200:
            raise HttpStatus(response.status, data)
        check_openai(data, len(texts), self.dim)

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


class RequestsCaller:
    """A requests.Session (urllib3's connection pool, keep-alive)."""
    protocol = "http"

    def __init__(self, name: str, port: int, model: str, dim: int) -> None:
        import requests

        self.name, self.model, self.dim = name, model, dim
        self.url = f"http://127.0.0.1:{port}/v1/embeddings"
        self.session = requests.Session()
        self.connections = 0  # not visible through requests' API
        self.closed = False

    def __call__(self, texts: list[str], timeout: float) -> None:
        body = json.dumps({"model": self.model, "input": texts, "truncate": True}).encode()
        response = self.session.post(self.url, data=body, headers={"Content-Type": "application/json"},
                                     timeout=timeout)
        if response.status_code != 200:
            raise HttpStatus(response.status_code, response.content)
        check_openai(response.content, len(texts), self.dim)

    def close(self) -> None:
        self.session.close()


def have_requests() -> bool:
    import importlib.util

    return importlib.util.find_spec("requests") is not None


class Pool:
    """`n` callers per protocol: gRPC threads share one EncoderClient channel per 4; each HTTP thread
    has its own connection, one of them a requests.Session where `requests` is importable."""

    def __init__(self, target: str, http_port: int, model: str, dim: int, n: int, prefix: str) -> None:
        from client import EncoderClient

        self.clients = [EncoderClient(target, timeout=None, retries=0) for _ in range(max(1, (n + 3) // 4))]
        self.grpc = [GrpcCaller(f"{prefix}grpc", self.clients[i // 4], dim) for i in range(n)]
        self.http: list = [HttpConnCaller(f"{prefix}http.client", http_port, model, dim) for _ in range(n)]
        if have_requests() and n > 1:
            self.http[-1] = RequestsCaller(f"{prefix}requests", http_port, model, dim)

    def close(self) -> None:
        for caller in self.http:
            caller.close()
        for client in self.clients:
            client.close()


def call(caller, texts: list[str], timeout: float, t_sched: float, t0: float) -> Record:
    t_send = time.monotonic()
    failure = ""
    try:
        caller(texts, timeout)
    except Exception as error:  # noqa: BLE001 - every failure is a record, the run goes on
        failure = failure_kind(error)
    return Record(caller.name, caller.protocol, t_sched, t_send - t0, time.monotonic() - t0, len(texts), failure)


# ------------------------------------------------------------------ the server
def ensure_export(export_dir: str, say) -> Path:
    path = Path(export_dir)
    if not path.is_absolute():
        path = REPO / path
    if (path / "metadata.json").is_file():
        return path
    if Path(export_dir) != Path(DEFAULT_EXPORT) and path != REPO / DEFAULT_EXPORT:
        raise SystemExit(f"--export-dir {export_dir}: no metadata.json there")
    say(f"exporting the packaged MiniLM to {path} (python -m export --minilm)")
    result = subprocess.run([sys.executable, "-m", "export", "--minilm", "--out-dir", str(path.parent), "--quiet"],
                            cwd=REPO, capture_output=True, text=True, timeout=1800)
    if result.returncode or not (path / "metadata.json").is_file():
        raise SystemExit(f"export failed ({result.returncode}): {(result.stderr or result.stdout)[-600:]}")
    return path


def http_ready(server: ServerHandle) -> bool:
    """The server's readiness here (a running_server probe): /v2/health/ready answers 200 over HTTP."""
    conn = http.client.HTTPConnection(LOOPBACK, server.http_port, timeout=5)
    try:
        conn.request("GET", "/v2/health/ready")
        response = conn.getresponse()
        response.read()
        return response.status == 200
    finally:
        conn.close()


def served_model(port: int) -> tuple[str, int]:
    """(the served model's name, the embedding width), asked over HTTP."""
    conn = http.client.HTTPConnection(LOOPBACK, port, timeout=60)
    try:
        conn.request("GET", "/v1/models")
        model = json.loads(conn.getresponse().read())["data"][0]["id"]
        conn.request("POST", "/v1/embeddings", json.dumps({"model": model, "input": [SHORT[0]]}).encode(),
                     {"Content-Type": "application/json"})
        return model, len(json.loads(conn.getresponse().read())["data"][0]["embedding"])
    finally:
        conn.close()


# ------------------------------------------------------------------ the two phases
def capacity(pool: Pool, seconds: float, timeout: float, seed: int, say) -> dict:
    """Closed loop (bench.harness.closed_loop): every caller of `pool` sends back to back; 2 s warm-up, then
    `seconds` counted."""
    callers = pool.grpc + pool.http
    t0 = time.monotonic()

    def sender(i: int):
        rng = random.Random(seed * 1000 + i)
        return lambda: call(callers[i], texts_for(rng), timeout, time.monotonic() - t0, t0)

    counted = closed_loop([sender(i) for i in range(len(callers))], seconds=seconds, warmup_s=2.0,
                          grace_s=timeout + 10).results  # answered in the window
    ok = [r for r in counted if not r.failure]
    rps = len(ok) / seconds
    result = {"seconds": seconds, "clients": len(callers), "grpc_clients": len(pool.grpc),
              "http_clients": len(pool.http), "requests": len(counted), "ok": len(ok), "rps": rps,
              "texts_per_s": sum(r.n_texts for r in ok) / seconds,
              "rps_by_protocol": {p: sum(1 for r in ok if r.protocol == p) / seconds for p in ("grpc", "http")},
              "failures": dict(Counter(r.failure for r in counted if r.failure)),
              **percentiles([r.latency_ms for r in ok], (50, 99))}
    say(f"capacity: {rps:.1f} req/s ({result['texts_per_s']:.1f} texts/s) over {seconds:.0f} s, "
        f"{len(callers)} closed-loop clients, p50 {fmt(result['p50_ms'])} p99 {fmt(result['p99_ms'])}, "
        f"failures {sum(result['failures'].values())}")
    return result


def fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} ms"


@dataclass
class Soak:
    pool: Pool
    idle: list
    rate: float
    seconds: float
    minute_s: float
    timeout: float
    seed: int
    server_pid: int
    say: object
    records: list = field(default_factory=list)  # one list per thread
    rss: list = field(default_factory=list)  # (t, bytes)
    cpu: list = field(default_factory=list)  # (t, machine busy s, server s, this process s)
    dispatch_lag_ms: list = field(default_factory=list)

    def run(self) -> None:
        stop = threading.Event()
        self.t0 = t0 = time.monotonic() + 0.5
        n = int(self.rate * self.seconds)
        # the schedule: evenly spaced, alternating protocols (half the requests each)
        queues = {"grpc": queue.Queue(), "http": queue.Queue()}
        hard_end = self.seconds + self.timeout + 30  # no thread outlives this (seconds since t0)

        def dispatcher() -> None:
            lag = self.dispatch_lag_ms
            for i in range(n):
                due = i / self.rate
                wait = t0 + due - time.monotonic()
                if wait > 0 and stop.wait(wait):
                    break
                lag.append(1e3 * (time.monotonic() - t0 - due))
                queues["grpc" if i % 2 == 0 else "http"].put((due, i))
            for q, callers in ((queues["grpc"], self.pool.grpc), (queues["http"], self.pool.http)):
                for _ in callers:
                    q.put(None)

        def worker(caller, q: queue.Queue, out: list, k: int) -> None:
            rng = random.Random(self.seed * 1000 + k)
            while time.monotonic() - t0 < hard_end:
                try:
                    item = q.get(timeout=1.0)
                except queue.Empty:
                    continue
                if item is None:
                    return
                due, _ = item
                if time.monotonic() - t0 - due > self.timeout:  # waited out its deadline in the client
                    now = time.monotonic() - t0
                    out.append(Record(caller.name, caller.protocol, due, now, now, 0, "expired in client queue"))
                    continue
                out.append(call(caller, texts_for(rng), self.timeout, due, t0))

        def idle_worker(caller, out: list, k: int) -> None:
            rng = random.Random(self.seed * 7919 + k)
            for _ in range(10_000):
                if stop.wait(max(0.0, t0 - time.monotonic())) or time.monotonic() - t0 >= self.seconds:
                    return
                for _ in range(rng.randint(1, 4)):
                    now = time.monotonic() - t0
                    out.append(call(caller, texts_for(rng), self.timeout, now, t0))
                remaining = self.seconds - (time.monotonic() - t0)
                if stop.wait(min(rng.uniform(6.0, 20.0), max(remaining, 0.0))):
                    return

        def sampler() -> None:
            """The server's RSS and the CPU seconds of the server, this process and the whole machine,
            every 2 s and at each minute's end (the RSS verdict's start is the sample at minute 1's end)."""
            stop.wait(max(0.0, t0 - time.monotonic()))
            for _ in range(1_000_000):
                now = time.monotonic() - t0
                try:
                    self.rss.append((now, rss_bytes(self.server_pid, children=True)))
                    self.cpu.append((now, host_busy_seconds(), cpu_seconds(self.server_pid, children=True),
                                     cpu_seconds()))
                except Exception:  # noqa: BLE001 - the server is gone; the failures say so
                    return
                if now >= self.seconds or stop.is_set():
                    return
                boundary = min((np.floor(now / self.minute_s + 1e-6) + 1) * self.minute_s, self.seconds)
                stop.wait(min(2.0, max(boundary - now, 0.01)))

        threads = [threading.Thread(target=dispatcher, daemon=True, name="dispatch"),
                   threading.Thread(target=sampler, daemon=True, name="sampler")]
        for k, caller in enumerate(self.pool.grpc + self.pool.http):
            out: list[Record] = []
            self.records.append(out)
            threads.append(threading.Thread(target=worker, args=(caller, queues[caller.protocol], out, k),
                                            daemon=True, name=f"{caller.name}-{k}"))
        for k, caller in enumerate(self.idle):
            out = []
            self.records.append(out)
            threads.append(threading.Thread(target=idle_worker, args=(caller, out, 500 + k), daemon=True,
                                            name=f"idle-{k}"))
        for t in threads:
            t.start()
        try:
            minutes = int(np.ceil(self.seconds / self.minute_s))
            for m in range(1, minutes + 1):  # progress, one line a minute
                end = t0 + min(m * self.minute_s, self.seconds)
                while time.monotonic() < end:
                    time.sleep(min(1.0, max(end - time.monotonic(), 0.01)))
                row = minute_row(self.all_records(), m - 1, self.minute_s, self.seconds)
                self.say(f"minute {m}: {row['requests']} requests, {row['failures']} failed, p50 {fmt(row['p50_ms'])}, "
                         f"p99 {fmt(row['p99_ms'])} (still in flight not counted yet)")
            for t in threads:
                t.join(timeout=max(0.1, t0 + hard_end - time.monotonic()))
        finally:
            stop.set()
        try:
            self.rss_end = rss_bytes(self.server_pid, children=True)
        except Exception:  # noqa: BLE001 - the server is gone
            self.rss_end = None
        self.t_end = time.monotonic() - t0
        self.stuck_threads = sum(t.is_alive() for t in threads)

    def all_records(self) -> list[Record]:
        return [r for rs in self.records for r in list(rs)]


def minute_row(records: list[Record], m: int, minute_s: float, seconds: float) -> dict:
    length = max(min(minute_s, seconds - m * minute_s), 1e-9)  # the last one may be partial
    inside = [r for r in records if m * minute_s <= r.t_sched < (m + 1) * minute_s]
    ok = [r for r in inside if not r.failure]
    kinds = Counter(f"{r.protocol}: {r.failure}" for r in inside if r.failure)
    return {"minute": m + 1, "requests": len(inside), "ok": len(ok), "failures": len(inside) - len(ok),
            "failures_by_kind": dict(kinds), "rps": len(inside) / length,
            **percentiles([r.latency_ms for r in ok], (50, 99)),
            "p99_service_ms": percentiles([r.service_ms for r in ok], (99,))["p99_ms"]}


def minute_cpu(samples: list, m: int, minute_s: float) -> dict:
    """CPU cores used in minute m (0-based) by the server, this process and everything else on the
    machine (the other engineer's builds and tests count here), from the sampler's snapshots."""
    def at(t: float):
        return next((x for x in samples if x[0] >= t - 0.05), samples[-1] if samples else None)

    return cores_between(at(m * minute_s), at((m + 1) * minute_s))


def cores_between(a, b) -> dict:
    """Cores used between two (t, machine busy s, server s, this process s) snapshots."""
    if a is None or b is None or b[0] - a[0] < 0.5:
        return {"server_cores": None, "client_cores": None, "other_cores": None}
    span = b[0] - a[0]
    server, client, machine = (b[2] - a[2]) / span, (b[3] - a[3]) / span, (b[1] - a[1]) / span
    return {"server_cores": server, "client_cores": client, "other_cores": max(machine - server - client, 0.0)}


def client_rows(records: list[Record], callers: list) -> dict:
    rows = {}
    for name in dict.fromkeys(c.name for c in callers):
        mine = [r for r in records if r.client == name]
        ok = [r for r in mine if not r.failure]
        rows[name] = {"threads": sum(1 for c in callers if c.name == name), "requests": len(mine),
                      "failures": len(mine) - len(ok), "failures_by_kind": dict(Counter(r.failure for r in mine
                                                                                        if r.failure)),
                      "connections_opened": (sum(c.connections for c in callers if c.name == name)
                                             if all(isinstance(c, HttpConnCaller) for c in callers
                                                    if c.name == name) else None),
                      **percentiles([r.latency_ms for r in ok], (50, 99))}
    return rows


# ------------------------------------------------------------------ report
def verdicts(rows: list[dict], total_failures: int, rss_m1: int | None, rss_end: int | None) -> dict:
    out = {"zero_failures": {"pass": total_failures == 0, "value": total_failures,
                             "rule": "no failed request (HTTP status, gRPC code, exception) in the soak"}}
    if rss_m1 and rss_end is None:
        out["rss_growth"] = {"pass": False, "value": None, "rule": "the server was gone at the end"}
    elif rss_m1:
        growth = 100.0 * (rss_end - rss_m1) / rss_m1
        out["rss_growth"] = {"pass": growth <= RSS_LIMIT_PCT, "value": growth,
                             "rule": f"server RSS growth from the end of minute 1 to the end <= {RSS_LIMIT_PCT} %"}
    else:
        out["rss_growth"] = {"pass": None, "value": None, "rule": "n/a: the run is not longer than one minute"}
    if len(rows) >= 2 and rows[1]["p99_ms"] and rows[-1]["p99_ms"]:
        ratio = rows[-1]["p99_ms"] / rows[1]["p99_ms"]
        out["p99_last_vs_minute2"] = {"pass": ratio <= P99_FACTOR, "value": ratio,
                                      "rule": f"p99 of the last minute <= {P99_FACTOR}x p99 of minute 2"
                                              + (" (the last minute is minute 2)" if len(rows) == 2 else "")}
    else:
        out["p99_last_vs_minute2"] = {"pass": None, "value": None, "rule": "n/a: fewer than two minutes"}
    return out


def table(report: dict) -> str:
    cap, lines = report["capacity"], []
    measured = ("not measured (--rate)" if cap.get("skipped") else
                f"{cap['rps']:.1f} req/s ({cap['clients']} closed-loop clients, {cap['seconds']:.0f} s)")
    lines.append(f"server: {report['server']['transport']} transport, export {report['config']['export_dir']}; "
                 f"capacity {measured}; "
                 f"soak at {'' if cap.get('skipped') else format(report['config']['load'], '.0%') + ' = '}"
                 f"{report['target_rps']:.1f} req/s scheduled for "
                 f"{report['config']['minutes']:g} min")
    if cap.get("server_cores") is not None:
        lines.append(f"capacity phase: p50 {fmt(cap['p50_ms'])}, p99 {fmt(cap['p99_ms'])}, failures "
                     f"{sum(cap['failures'].values())}; CPU cores: server {cap['server_cores']:.2f}, other processes "
                     f"{cap['other_cores']:.2f}")
    lines.append(f"{'minute':>6} {'requests':>8} {'req/s':>7} {'failed':>6} {'p50':>10} {'p99':>10} "
                 f"{'p99 send':>10} {'cpu srv/oth':>11}  failures by kind")
    for row in report["minutes"]:
        kinds = ", ".join(f"{k} x{v}" for k, v in sorted(row["failures_by_kind"].items())) or "-"
        cpu = ("-" if row["server_cores"] is None else f"{row['server_cores']:.2f}/{row['other_cores']:.2f}")
        lines.append(f"{row['minute']:>6} {row['requests']:>8} {row['rps']:>7.1f} {row['failures']:>6} "
                     f"{fmt(row['p50_ms']):>10} {fmt(row['p99_ms']):>10} {fmt(row['p99_service_ms']):>10} "
                     f"{cpu:>11}  {kinds}")
    lines.append("(p50/p99 from the scheduled send time; 'p99 send' from the actual send; cpu: cores used by the "
                 "server / by other processes on this machine)")
    lines.append(f"{'client':>22} {'threads':>7} {'requests':>8} {'failed':>6} {'p99':>10} {'conns':>6}")
    for name, row in report["clients"].items():
        conns = "-" if row["connections_opened"] is None else str(row["connections_opened"])
        lines.append(f"{name:>22} {row['threads']:>7} {row['requests']:>8} {row['failures']:>6} "
                     f"{fmt(row['p99_ms']):>10} {conns:>6}")
    lines.append("idle clients (idle-*): bursts of 1-4 requests, then 6-20 s idle on the same pooled connection "
                 "(> uvicorn's default 5 s keep-alive)")
    rss = report["rss"]
    m1 = "-" if rss["minute1_mib"] is None else f"{rss['minute1_mib']:.1f} MiB"
    growth = "-" if rss["growth_pct"] is None else f"{rss['growth_pct']:+.2f} %"
    end = "gone" if rss["end_mib"] is None else f"{rss['end_mib']:.1f} MiB"
    lines.append(f"server RSS: start of soak {rss['start_mib']:.1f} MiB, end of minute 1 {m1}, end {end}, "
                 f"peak {rss['peak_mib']:.1f} MiB; growth since minute 1 {growth}")
    lines.append(f"dispatch lag p99 {fmt(report['dispatch_lag_p99_ms'])}; CPU cores: server "
                 f"{report['cpu']['server_cores']:.2f}, this client {report['cpu']['client_cores']:.2f}")
    for name, v in report["verdicts"].items():
        state = "n/a " if v["pass"] is None else "PASS" if v["pass"] else "FAIL"
        value = "" if v["value"] is None else (f" ({v['value']:.3g})" if isinstance(v["value"], float)
                                               else f" ({v['value']})")
        lines.append(f"{state} {name}{value}: {v['rule']}")
    lines.append("soak " + ("PASSED" if report["passed"] else "FAILED"))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--export-dir", default=DEFAULT_EXPORT,
                        help=f"default {DEFAULT_EXPORT} (python -m export --minilm writes it when missing)")
    parser.add_argument("--json", default="", help="write the report here")
    parser.add_argument("--load", type=float, default=0.7, help="the soak's rate as a fraction of capacity")
    parser.add_argument("--capacity-seconds", type=float, default=20.0)
    parser.add_argument("--capacity-clients", type=int, default=16, help="closed-loop clients, half per protocol")
    parser.add_argument("--rate", type=float, default=0.0, help="skip the capacity phase: soak at this req/s")
    parser.add_argument("--workers", type=int, default=16, help="soak client threads per protocol")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds each request may take")
    parser.add_argument("--minute-seconds", type=float, default=60.0,
                        help="length of a report 'minute' (60; shorter only to check the harness quickly)")
    parser.add_argument("--server-flags", default="", help="extra `python -m serve` flags, one string")
    parser.add_argument("--seed", type=int, default=31)
    args = parser.parse_args(argv)
    say = lambda msg: print(f"[soak {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)  # noqa: E731
    if args.minutes <= 0 or args.workers < 1 or not 0 < args.load <= 1 or args.minute_seconds <= 0:
        parser.error("--minutes, --workers, --minute-seconds must be positive and --load in (0, 1]")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(3))  # unwinds: the server is stopped on the way out

    try:
        export_dir = ensure_export(args.export_dir, say)
    except SystemExit as error:
        say(str(error))
        return 2
    # running_server passes --http-port -1 first; this comes after it and wins (argparse: the last one)
    flags = ["--http-port", "0", *shlex.split(args.server_flags)]
    seconds = args.minutes * 60.0
    try:
        with running_server(str(export_dir), flags, start_timeout_s=300.0, ready=http_ready) as server:
            http_port = server.http_port
            say(f"server pid {server.pid} on 127.0.0.1:{server.port} (gRPC, {server.transport}) and :{http_port} "
                f"(HTTP); log {server.log}")
            model, dim = served_model(http_port)
            if args.rate > 0:
                cap = {"seconds": 0.0, "clients": 0, "rps": args.rate / args.load, "skipped": True,
                       "failures": {}, "p50_ms": None, "p99_ms": None}
            else:
                half = max(1, args.capacity_clients // 2)
                cap_pool = Pool(server.target, http_port, model, dim, half, "cap-")
                before = (time.monotonic(), host_busy_seconds(), cpu_seconds(server.pid, children=True), cpu_seconds())
                try:
                    cap = capacity(cap_pool, args.capacity_seconds, args.timeout, args.seed, say)
                finally:
                    cap_pool.close()
                after = (time.monotonic(), host_busy_seconds(), cpu_seconds(server.pid, children=True), cpu_seconds())
                cap.update(cores_between(before, after))
                time.sleep(2.0)
            rate = args.rate if args.rate > 0 else args.load * cap["rps"]
            if rate <= 0:
                say("capacity measured as 0 req/s: nothing answered")
                return 2
            pool = Pool(server.target, http_port, model, dim, args.workers, "")
            from client import EncoderClient

            idle_grpc_client = EncoderClient(server.target, timeout=None, retries=0)
            idle = [HttpConnCaller("idle-http.client", http_port, model, dim),
                    GrpcCaller("idle-grpc", idle_grpc_client, dim)]
            if have_requests():
                idle.insert(1, RequestsCaller("idle-requests", http_port, model, dim))
            say(f"soak: {rate:.1f} req/s ({args.load:.0%} of {cap['rps']:.1f}) for {args.minutes:g} min, "
                f"{args.workers} threads per protocol, {len(idle)} idle clients "
                f"({', '.join(c.name for c in idle)}){'' if have_requests() else '; requests not importable'}")
            rss_start = rss_bytes(server.pid, children=True)
            cpu0 = (cpu_seconds(server.pid, children=True), cpu_seconds(), time.monotonic())
            soak = Soak(pool, idle, rate, seconds, args.minute_seconds, args.timeout, args.seed, server.pid, say)
            try:
                soak.run()
            finally:
                pool.close()
                for caller in idle:
                    caller.close()
                idle_grpc_client.close()
            try:
                cpu1 = (cpu_seconds(server.pid, children=True), cpu_seconds(), time.monotonic())
            except psutil.Error:  # the server is gone
                cpu1 = (cpu0[0], cpu_seconds(), time.monotonic())
            server_alive = server.process.poll() is None
    except (RuntimeError, TimeoutError) as error:
        say(f"could not run: {error}")
        return 2
    exit_code = server.process.returncode

    records = soak.all_records()
    n_minutes = int(np.ceil(seconds / args.minute_seconds - 1e-9))
    rows = [{**minute_row(records, m, args.minute_seconds, seconds), **minute_cpu(soak.cpu, m, args.minute_seconds)}
            for m in range(n_minutes)]
    after = [r for r in records if r.t_sched >= n_minutes * args.minute_seconds]  # none expected
    total_failures = sum(1 for r in records if r.failure)
    rss_m1 = next((b for t, b in soak.rss if t >= args.minute_seconds), None) if seconds > args.minute_seconds else None
    report = {
        "config": {"minutes": args.minutes, "load": args.load, "workers_per_protocol": args.workers,
                   "timeout_s": args.timeout, "minute_seconds": args.minute_seconds, "seed": args.seed,
                   "export_dir": str(export_dir), "server_flags": flags, "requests_importable": have_requests(),
                   "cpus": os.cpu_count()},
        "server": {"pid": server.pid, "transport": server.transport, "log": str(server.log),
                   "alive_at_end_of_load": server_alive, "exit_code": exit_code, "model": model, "dim": dim},
        "capacity": cap, "target_rps": rate, "scheduled_requests": int(rate * seconds),
        "minutes": rows, "records_after_last_minute": len(after),
        "clients": client_rows(records, pool.grpc + pool.http + idle),
        "idle_clients": {"names": [c.name for c in idle], "burst": "1-4 requests back to back",
                         "idle_s": [6.0, 20.0],
                         "why": "longer than uvicorn's default 5 s keep-alive, which broke pooled connections"},
        "rss": {"start_mib": rss_start / MIB, "minute1_mib": rss_m1 / MIB if rss_m1 else None,
                "end_mib": soak.rss_end / MIB if soak.rss_end else None,
                "peak_mib": max([b for _, b in soak.rss] + [soak.rss_end or 0]) / MIB,
                "growth_pct": 100.0 * (soak.rss_end - rss_m1) / rss_m1 if rss_m1 and soak.rss_end else None,
                "samples_mib": [[round(t, 1), round(b / MIB, 2)] for t, b in soak.rss]},
        "dispatch_lag_p99_ms": percentiles(soak.dispatch_lag_ms, (99,))["p99_ms"],
        "cpu": {"server_cores": (cpu1[0] - cpu0[0]) / (cpu1[2] - cpu0[2]),
                "client_cores": (cpu1[1] - cpu0[1]) / (cpu1[2] - cpu0[2])},
        "threads_still_running": soak.stuck_threads,
        "total": {"requests": len(records), "failures": total_failures,
                  "failures_by_kind": dict(Counter(f"{r.protocol}: {r.failure}" for r in records if r.failure))},
    }
    report["verdicts"] = verdicts(rows, total_failures, rss_m1, soak.rss_end)
    report["passed"] = all(v["pass"] is not False for v in report["verdicts"].values())
    print(table(report))
    if soak.stuck_threads:
        say(f"{soak.stuck_threads} client threads did not finish by the deadline")
    if exit_code not in (0, None):
        say(f"the server exited with {exit_code}; log {server.log}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1))
        say(f"wrote {args.json}")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
