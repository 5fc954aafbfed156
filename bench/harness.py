"""The benchmarks' shared harness: each piece that more than one script in bench/ needs, held once.

ports, processes  free_port; running_process (a subprocess with its log, ready once it wrote its port file,
                  stopped with SIGTERM and killed past a bound); wait_ready; stop_process
the server        ServerHandle; running_server (`python -m serve` on 127.0.0.1, ready once it answers)
memory            rss_bytes, mib, peak_rss_mib (Linux VmHWM), RssSampler (RSS sampled in a thread, and its peak)
CPU               cpu_seconds, thread_cpu, thread_name, host_busy_seconds
statistics        percentiles, latency_summary, spread
metrics           scrape_metrics (a server's /metrics as {name{labels}: value}), metric_sum
load              closed_loop: N client threads back to back for S seconds or R requests, -> Load
targets           verdicts: measured values judged against (key, description, limit, at least?) rows
inputs            token_ids, sentence: seeded request contents

Which script measures what, against which peer or target, and how to run it: bench/__init__.py.
Every server here listens on 127.0.0.1 and every wait and load is bounded in time.
"""

from __future__ import annotations

import json
import os
import random
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np
import psutil

REPO = Path(__file__).resolve().parent.parent
LOOPBACK = "127.0.0.1"
MIB = 1 << 20


# -- ports and processes ---------------------------------------------------------------------------------------

def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now, for a peer that cannot write a port file (ours can: port 0)."""
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def _log_tail(log: Path | None, chars: int = 2000) -> str:
    try:
        return log.read_text(errors="replace")[-chars:] if log else ""
    except OSError:
        return ""


def wait_ready(probe: Callable[[], bool], process: subprocess.Popen, deadline: float, what: str,
               log: Path | None = None, interval_s: float = 0.05) -> None:
    """Calls `probe` until it returns True (False or an exception: not yet). RuntimeError when `process`
    exits first, TimeoutError past `deadline` (time.monotonic()); both carry the log's tail."""
    while True:
        try:
            if probe():
                return
        except Exception:  # noqa: BLE001 - not listening yet
            pass
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with {process.returncode}: {_log_tail(log)}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} was not ready in time: {_log_tail(log)}")
        time.sleep(interval_s)  # polling another process: there is no event to wait on


def stop_process(process: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGTERM (a server drains on it), then SIGKILL once `grace_s` passed."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


@contextmanager
def running_process(command: list[str], log: Path, *, port_file: Path | None = None,
                    start_timeout_s: float = 120.0, cwd: str | Path = REPO, env: dict | None = None,
                    grace_s: float = 30.0) -> Iterator[tuple[subprocess.Popen, dict, float]]:
    """Runs `command` (stdout and stderr into `log`); with `port_file`, waits until the command wrote it
    (JSON such as {"port": N}). Yields (process, the port file's contents or {}, the start deadline);
    stops the process on exit (stop_process)."""
    with open(log, "w") as log_handle:
        process = subprocess.Popen(command, cwd=cwd, env=env, stdout=log_handle, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + start_timeout_s
        ports: dict = {}
        if port_file is not None:
            wait_ready(port_file.exists, process, deadline, f"{command[:3]} (its port file)", log)
            ports = json.loads(port_file.read_text())
        yield process, ports, deadline
    finally:
        stop_process(process, grace_s)


def tidy(workdir: Path, process: subprocess.Popen) -> None:
    """Removes a stopped server's folder (its port file and log) when it exited 0 (drained on SIGTERM); else keeps
    it and names its log, which tells why. A block that raised never gets here: its folder stays too."""
    if process.returncode == 0:
        shutil.rmtree(workdir, ignore_errors=True)
    else:
        print(f"the server exited with {process.returncode}; its log is kept: {workdir}", file=sys.stderr)


# -- the server ------------------------------------------------------------------------------------------------

@dataclass
class ServerHandle:
    process: subprocess.Popen
    port: int
    target: str
    log: Path
    flags: list[str] = field(default_factory=list)
    # threads alive once it listened, before any call: the batcher and ONNX Runtime's pool among them
    startup_threads: frozenset[int] = frozenset()
    metrics_port: int | None = None
    transport: str = ""
    http_port: int | None = None  # when started with --http-port 0

    @property
    def pid(self) -> int:
        return self.process.pid


@contextmanager
def running_server(export_dir: str | Path | None, flags: Sequence[str] = (), *, source: Sequence[str] = (),
                   ready: Callable[[ServerHandle], bool] | None = None,
                   start_timeout_s: float = 120.0, serve_from: str | Path = REPO) -> Iterator[ServerHandle]:
    """`python -m serve` on 127.0.0.1 serving `export_dir` (or `source`, e.g. ["--model-repository", DIR]):
    main port 0, metrics and HTTP off and log level warning, then `flags` (argparse: a later flag wins, so
    ["--http-port", "0"] turns HTTP on). Ready once `ready(handle)` is true; by default once gRPC health
    reports SERVING. Yields its ServerHandle; stops it on exit (SIGTERM, then SIGKILL). `serve_from`: the
    checkout whose code the server runs (another commit's, to measure a change against it)."""
    workdir = Path(tempfile.mkdtemp(prefix="bench-serve-"))
    port_file, log = workdir / "ports.json", workdir / "server.log"
    command = [sys.executable, "-m", "serve", *(source or ["--export-dir", str(export_dir)]), "--host", LOOPBACK,
               "--port", "0", "--metrics-port", "-1", "--http-port", "-1", "--port-file", str(port_file),
               "--log-level", "warning", *flags]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(serve_from), os.environ.get("PYTHONPATH")]))}
    with running_process(command, log, port_file=port_file, start_timeout_s=start_timeout_s, cwd=serve_from,
                         env=env) as (process, ports, deadline):
        port = int(ports["port"])
        handle = ServerHandle(process, port, f"{LOOPBACK}:{port}", log, list(flags), frozenset(thread_cpu(process.pid)),
                              ports.get("metrics_port"), ports.get("transport", ""), ports.get("http_port"))
        if ready is not None:
            wait_ready(lambda: ready(handle), process, deadline, "the server", log)
        else:
            from client import EncoderClient

            with EncoderClient(handle.target, timeout=5.0) as client:
                wait_ready(lambda: client.health() == "SERVING", process, deadline, "the server", log)
        yield handle
    tidy(workdir, process)


# -- memory ----------------------------------------------------------------------------------------------------

def rss_bytes(pid: int, *, children: bool = False) -> int:
    """Resident set size of process `pid` (psutil), with its children's when `children`."""
    process = psutil.Process(pid)
    total = process.memory_info().rss
    for child in process.children(recursive=True) if children else ():
        try:
            total += child.memory_info().rss
        except psutil.Error:
            pass
    return total


def mib(n_bytes: float) -> float:
    return n_bytes / MIB


def peak_rss_mib(pid: int | None = None) -> float | None:
    """The kernel's peak RSS of process `pid` (None: this one) in MiB: Linux VmHWM, which exec resets
    (ru_maxrss, the fallback for this process, is inherited by a child). None where unreadable."""
    try:
        for line in Path(f"/proc/{pid or 'self'}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 if pid is None else None


class RssSampler:
    """Samples a process's RSS every `interval_s` in a thread; `peak` is the largest seen."""

    def __init__(self, pid: int, interval_s: float = 0.05) -> None:
        self.process = psutil.Process(pid)
        self.interval_s, self.peak = interval_s, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def now(self) -> int:
        rss = self.process.memory_info().rss
        self.peak = max(self.peak, rss)
        return rss

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.now()
            except psutil.Error:  # the process ended
                return
            self._stop.wait(self.interval_s)

    def __enter__(self) -> "RssSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


# -- CPU -------------------------------------------------------------------------------------------------------

def cpu_seconds(pid: int | None = None, *, children: bool = False) -> float:
    """User + system CPU seconds of process `pid` (None: this one); with `children`, its children's too: the
    live ones (recursive: a server's front ends) and those it has waited for (one replaced mid-run)."""
    process = psutil.Process(pid)
    times = process.cpu_times()
    total = times.user + times.system
    if children:
        total += times.children_user + times.children_system
        for child in process.children(recursive=True):
            try:
                child_times = child.cpu_times()
            except psutil.Error:  # gone since it was listed: its time is in the waited-for figure
                continue
            total += child_times.user + child_times.system
    return total


def thread_cpu(pid: int) -> dict[int, float]:
    """{thread id: CPU seconds (user + system)} of process `pid` (empty once it is gone)."""
    try:
        return {t.id: t.user_time + t.system_time for t in psutil.Process(pid).threads()}
    except psutil.Error:
        return {}


def thread_name(pid: int, tid: int) -> str:
    """The OS name of thread `tid` of `pid` ("" when it is gone); psutil does not read thread names."""
    try:
        return Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
    except OSError:
        return ""


def host_busy_seconds() -> float:
    """CPU seconds the whole host spent busy, over all CPUs (idle, I/O wait and guests excluded)."""
    t = psutil.cpu_times()
    return sum(t) - t.idle - getattr(t, "iowait", 0.0) - getattr(t, "guest", 0.0) - getattr(t, "guest_nice", 0.0)


# -- statistics ------------------------------------------------------------------------------------------------

def percentiles(samples_ms: Sequence[float], points: Sequence[int] = (50, 90, 99)) -> dict:
    """{"p50_ms": ..., ...} at `points` (numpy's linear interpolation); None each when there are no samples."""
    if not len(samples_ms):
        return {f"p{p}_ms": None for p in points}
    values = np.percentile(np.asarray(samples_ms, dtype=float), points)
    return {f"p{p}_ms": float(v) for p, v in zip(points, values)}


def latency_summary(samples_ms: Sequence[float]) -> dict:
    """p50, p90, p99, mean and count of latencies in ms (the servers' latency rows)."""
    return {**percentiles(samples_ms), "mean_ms": float(np.mean(samples_ms)) if len(samples_ms) else None,
            "n": len(samples_ms)}


def turns(names, number: int) -> list:
    """The order the sides take turn `number` in: as given, then reversed, alternating, so that a neighbour's load
    or the machine's speed drifting falls on every side alike."""
    names = list(names)
    return names if number % 2 == 0 else names[::-1]


def timed_side_by_side(sides: dict[str, Callable], warmup: Sequence[tuple], timed: Sequence[tuple], *,
                       cpu_pids: dict[str, int | None] | None = None,
                       after: Callable[[int, dict], None] | None = None) -> tuple[dict, dict]:
    """({side: milliseconds per request of `timed`}, {side: CPU seconds in all}): each of `warmup` on every side
    first, then every request of `timed` (each the arguments of a call) on every side back to back, in `turns`.
    CPU is counted for the sides of `cpu_pids` ({side: its process, None: this one}). `after(i, times)` runs after
    each timed request (progress)."""
    for args in warmup:
        for call in sides.values():
            call(*args)
    times: dict[str, list[float]] = {name: [] for name in sides}
    cpu = {name: 0.0 for name in cpu_pids or {}}
    for i, args in enumerate(timed):
        for name in turns(sides, i):
            counted = name in cpu
            cpu_before = cpu_seconds(cpu_pids[name]) if counted else 0.0
            started = time.perf_counter()
            sides[name](*args)
            times[name].append((time.perf_counter() - started) * 1e3)
            if counted:
                cpu[name] += cpu_seconds(cpu_pids[name]) - cpu_before
        if after is not None:
            after(i, times)
    return times, cpu


def spread(values: Sequence[float]) -> dict:
    """{"median", "min", "max"} of per-round figures (ratios are taken within a round, then summarised)."""
    return {"median": float(np.median(values)), "min": float(min(values)), "max": float(max(values))}


# -- metrics ---------------------------------------------------------------------------------------------------

def scrape_metrics(port: int | None, host: str = LOOPBACK) -> dict[str, float]:
    """{metric line's name and labels: value} of a server's Prometheus /metrics (empty when it has none)."""
    if port is None:
        return {}
    import urllib.request

    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            try:
                out[key] = float(value)
            except ValueError:
                continue
    return out


def metric_sum(scrape: dict[str, float], name: str) -> float:
    """`name` summed over its label sets (0.0 when absent)."""
    return sum(v for k, v in scrape.items() if k == name or k.startswith(name + "{"))


# -- load ------------------------------------------------------------------------------------------------------

@dataclass
class Load:
    """What closed_loop measured."""

    seconds: float  # the measured window's wall time
    latencies_ms: list[float]  # calls that finished inside the window, in the order they finished
    results: list  # what those calls returned, in the same order
    errors: int  # calls that raised, warm-up included
    client_errors: list[int]  # the same per function of `calls`, in its order
    snapshots: tuple = (None, None)  # snapshot() at the window's start and at its end


def _join_until(threads: list[threading.Thread], end: float) -> None:
    """Until every thread ended or time.monotonic() passed `end`."""
    for thread in threads:
        thread.join(timeout=max(0.0, end - time.monotonic()))


def closed_loop(calls: Sequence[Callable[[], object]], *, seconds: float, requests: int | None = None,
                warmup_s: float = 0.0, snapshot: Callable[[], object] | None = None, error_pause_s: float = 0.0,
                grace_s: float = 120.0) -> Load:
    """One client thread per function of `calls`, each calling it back to back. Each is called once first,
    here, before any thread starts (it connects its channel, and a broken request fails loudly). The first
    `warmup_s` seconds are not counted; the window then lasts `seconds`, or ends sooner once `requests`
    calls were sent (failed ones included) and answered. A call that raises is counted in `errors`, and its
    thread waits `error_pause_s` before the next. Threads still in a call at the end get `grace_s` more."""
    for call in calls:
        call()
    lock = threading.Lock()
    go, stop, in_window = threading.Event(), threading.Event(), threading.Event()
    state = {"sent": 0}
    errors = [0] * len(calls)
    latencies: list[float] = []
    results: list = []

    def worker(index: int, call) -> None:
        go.wait()
        while not stop.is_set():
            if requests is not None:
                with lock:
                    if state["sent"] >= requests:
                        return
                    state["sent"] += 1
            started = time.perf_counter()
            try:
                result = call()
            except Exception:  # noqa: BLE001 - counted; the load goes on
                with lock:
                    errors[index] += 1
                stop.wait(error_pause_s)
                continue
            elapsed = 1e3 * (time.perf_counter() - started)
            if in_window.is_set():
                with lock:
                    latencies.append(elapsed)
                    results.append(result)

    threads = [threading.Thread(target=worker, args=pair, daemon=True) for pair in enumerate(calls)]
    for thread in threads:
        thread.start()
    if warmup_s > 0:
        go.set()
        _join_until(threads, time.monotonic() + warmup_s)  # a benchmark's warm-up: a duration by design
    before = snapshot() if snapshot else None
    started = time.perf_counter()
    in_window.set()
    go.set()  # without a warm-up, the threads start here: every call they make is in the window
    _join_until(threads, time.monotonic() + seconds)
    in_window.clear()
    wall = time.perf_counter() - started
    after = snapshot() if snapshot else None
    stop.set()
    _join_until(threads, time.monotonic() + grace_s)
    with lock:
        return Load(wall, list(latencies), list(results), sum(errors), list(errors), (before, after))


# -- targets ---------------------------------------------------------------------------------------------------

def verdicts(targets, values: dict) -> list[dict]:
    """Each target of `targets` ((key, description, limit, at least?) tuples) judged on values[key]:
    met True/False, or None where the value was not measured."""
    out = []
    for key, text, limit, at_least in targets:
        value = values.get(key)
        met = None if value is None else (value >= limit if at_least else value <= limit)
        out.append({"target": key, "description": text, "limit": limit,
                    "direction": ">=" if at_least else "<=", "value": value, "met": met})
    return out


# -- inputs ----------------------------------------------------------------------------------------------------

WORDS = ("time person year way day thing man world life hand part child eye woman place work week case point "
         "government company number group problem fact river light sound music garden window paper story "
         "question answer reason idea market system program student country family money water night").split()


def token_ids(vocab_size: int, length: int, seed: int) -> np.ndarray:
    """`length` random token ids in [1, vocab_size), seeded."""
    return np.random.default_rng(seed).integers(1, vocab_size, length, dtype=np.int64)


def sentence(n_words: int, rng: random.Random) -> str:
    """A capitalised sentence of `n_words` common English words (about one token each)."""
    return " ".join(rng.choice(WORDS) for _ in range(n_words)).capitalize() + "."


def rerank_requests(count: int, words: Sequence[str], document_words: tuple[int, int], seed: int = 7,
                    documents: int = 32) -> list[tuple[str, list[str]]]:
    """`count` (query, documents) pairs of random `words`: a query of 5-12 words, `documents` documents of
    `document_words` (least, most) words each."""
    rng = random.Random(seed)

    def text(n):
        return " ".join(rng.choice(words) for _ in range(n))
    return [(text(rng.randint(5, 12)), [text(rng.randint(*document_words)) for _ in range(documents)])
            for _ in range(count)]


def tei_rerank(conn, body: dict, documents: int) -> np.ndarray:
    """POST /rerank (TEI's shape) with `body` on an http.client connection: the scores in document order
    (RuntimeError with the status and the body's start on anything but 200)."""
    conn.request("POST", "/rerank", json.dumps(body).encode(), {"Content-Type": "application/json"})
    response = conn.getresponse()
    answer = response.read()
    if response.status != 200:
        raise RuntimeError(f"HTTP {response.status}: {answer[:300]!r}")
    scores = np.zeros(documents)
    for item in json.loads(answer):
        scores[item["index"]] = item["score"]
    return scores
