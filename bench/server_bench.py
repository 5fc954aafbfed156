"""Server benchmark: the real `python -m serve` as a subprocess on 127.0.0.1 (OS-chosen port).

latency: sequential Encode calls over loopback vs session.run in this process on the same inputs.
throughput: N client threads, each sending single-sequence requests back to back.
memory: the server's RSS (psutil) idle, under load, and after 1k vs 20k requests.
Every loop is bounded by a request count or a deadline.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent


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
def _process_with_port_file(command: list[str], port_file: Path, log: Path, start_timeout_s: float):
    """Runs `command` (which writes {"port": N} to `port_file` once listening); yields (process, port,
    deadline); stops it (SIGTERM, then SIGKILL past a deadline) on exit."""
    with open(log, "w") as log_handle:
        process = subprocess.Popen(command, cwd=REPO, stdout=log_handle, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + start_timeout_s
        while not port_file.exists():
            if process.poll() is not None:
                raise RuntimeError(f"server exited with {process.returncode}: {log.read_text()[-2000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"server did not write {port_file} in {start_timeout_s:.0f} s")
            time.sleep(0.05)
        yield process, json.loads(port_file.read_text()), deadline
    finally:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)


@contextmanager
def running_server(export_dir: str, flags: list[str], *, start_timeout_s: float = 120.0):
    """Start `python -m serve` with `flags`, wait until it listens and reports SERVING, stop it on exit."""
    from client import EncoderClient

    workdir = Path(tempfile.mkdtemp(prefix="bench-serve-"))
    port_file, log = workdir / "ports.json", workdir / "server.log"
    command = [sys.executable, "-m", "serve", "--export-dir", str(export_dir), "--host", "127.0.0.1",
               "--port", "0", "--metrics-port", "-1", "--http-port", "-1", "--port-file", str(port_file), "--log-level", "warning",
               *flags]
    with _process_with_port_file(command, port_file, log, start_timeout_s) as (process, ports, deadline):
        port = int(ports["port"])
        handle = ServerHandle(process, port, f"127.0.0.1:{port}", log, flags, frozenset(thread_cpu(process.pid)),
                              ports.get("metrics_port"), ports.get("transport", ""), ports.get("http_port"))
        with EncoderClient(handle.target, timeout=5.0) as client:
            while True:
                try:
                    if client.health() == "SERVING":
                        break
                except Exception:  # noqa: BLE001 - not listening yet
                    pass
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"server never reported SERVING: {log.read_text()[-2000:]}")
                time.sleep(0.05)
        yield handle


@contextmanager
def running_bare_server(export_dir: str, graph: str, threads: int, *, start_timeout_s: float = 120.0):
    """Start bench/bare_server.py (gRPC + session.run, nothing else) on 127.0.0.1; yields its handle."""
    workdir = Path(tempfile.mkdtemp(prefix="bench-bare-"))
    port_file, log = workdir / "port.json", workdir / "server.log"
    flags = ["--export-dir", str(export_dir), "--graph", graph, "--threads", str(threads)]
    command = [sys.executable, "-m", "bench.bare_server", *flags, "--port-file", str(port_file)]
    with _process_with_port_file(command, port_file, log, start_timeout_s) as (process, ports, _deadline):
        port = int(ports["port"])
        yield ServerHandle(process, port, f"127.0.0.1:{port}", log, flags)


def thread_cpu(pid: int) -> dict[int, float]:
    """{thread id: CPU seconds (user + system)} of process `pid`, from /proc (empty where unreadable)."""
    out = {}
    tick = os.sysconf("SC_CLK_TCK")
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / tick
    return out


def thread_name(pid: int, tid: int) -> str:
    """The OS name of thread `tid` of `pid` ("" when it is gone)."""
    try:
        return Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
    except OSError:
        return ""


def split_cpu(before: dict[int, float], after: dict[int, float], startup: frozenset[int],
              model_threads: int) -> tuple[float, float]:
    """Server CPU seconds between two thread_cpu snapshots as (front end, model). Model: the
    `model_threads` start-up threads that used the most CPU (the batcher thread, which calls
    session.run and is one of ONNX Runtime's intra-op threads, and the rest of ORT's pool); front end:
    every other thread (gRPC's polling thread, the handler pool: decode, validate, submit, wait,
    answer). The same split as ../shared/peers/triton/side_by_side.py uses for this server."""
    delta = {tid: cpu - before.get(tid, 0.0) for tid, cpu in after.items()}
    model = sum(sorted((v for tid, v in delta.items() if tid in startup), reverse=True)[:model_threads])
    return sum(delta.values()) - model, model


def ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} ms"


def percentiles(samples_ms: list[float]) -> dict:
    a = np.asarray(samples_ms)
    return {"p50_ms": float(np.percentile(a, 50)), "p90_ms": float(np.percentile(a, 90)),
            "p99_ms": float(np.percentile(a, 99)), "mean_ms": float(a.mean()), "n": int(a.size)}


def token_ids(vocab_size: int, length: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, vocab_size, length, dtype=np.int64)


def paired_latency(targets: dict[str, str], ids: np.ndarray, session, feeds: dict, *, warmup: int,
                   requests: int, block: int = 25) -> dict:
    """Single-sequence Encode calls over loopback to each of `targets` ({name: host:port}; pooled
    embedding only, one channel each) and session.run in this process ("in_process") on the same
    sequence, taking turns in blocks of `block` calls (one untimed call first each time), so all see
    the same machine without running beside another's still-spinning thread pool. The graph computes
    both outputs either way."""
    from contextlib import ExitStack

    from client import EncoderClient, build_request

    request = build_request([ids])
    names = [o.name for o in session.get_outputs()]
    with ExitStack() as stack:
        calls = {}
        for name, target in targets.items():
            client = stack.enter_context(EncoderClient(target, timeout=30.0, retries=0))
            calls[name] = (lambda stub=client.stub: stub.Encode(request, timeout=30.0))
        calls["in_process"] = lambda: session.run(names, feeds)
        out: dict[str, list[float]] = {name: [] for name in calls}
        for _ in range(warmup):
            for call in calls.values():
                call()
        while len(out["in_process"]) < requests:
            for name, call in calls.items():
                call()
                for _ in range(min(block, requests - len(out[name]))):
                    t0 = time.perf_counter()
                    call()
                    out[name].append(1e3 * (time.perf_counter() - t0))
    return {name: percentiles(samples) for name, samples in out.items()}


class RssSampler:
    """Samples a process's RSS every `interval_s` in a thread; `peak` is the largest seen."""

    def __init__(self, pid: int, interval_s: float = 0.05) -> None:
        import psutil

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
            except Exception:  # noqa: BLE001 - the process ended
                return
            self._stop.wait(self.interval_s)

    def __enter__(self) -> "RssSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def concurrent_load(target: str, ids_per_client: list[np.ndarray], *, total_requests: int,
                    deadline_s: float, server: ServerHandle | None = None, model_threads: int = 0) -> dict:
    """len(ids_per_client) threads, each one channel, each sending its single-sequence request
    back to back until `total_requests` were answered in all or `deadline_s` passed. With `server`
    (and `model_threads`, the intra-op thread count): its CPU, split into front end and model per
    request (split_cpu), and the rows per session.run."""
    server_pid = server.pid if server is not None else None
    from client import EncoderClient, build_request

    clients = [EncoderClient(target, timeout=60.0, retries=0) for _ in ids_per_client]
    requests = [build_request([ids]) for ids in ids_per_client]
    for client, request in zip(clients, requests):  # connect every channel before the clock starts
        client.stub.Encode(request, timeout=60.0)
    lock = threading.Lock()
    state = {"sent": 0, "done": 0, "errors": 0, "tokens": 0}
    latencies: list[float] = []
    batch_sizes: list[int] = []
    inference_ms: list[float] = []
    queue_ms: list[float] = []
    stop_at = time.monotonic() + deadline_s

    def worker(client, request) -> None:
        while True:
            with lock:
                if state["sent"] >= total_requests or time.monotonic() > stop_at:
                    return
                state["sent"] += 1
            t0 = time.perf_counter()
            try:
                response = client.stub.Encode(request, timeout=60.0)
            except Exception:  # noqa: BLE001 - counted, the run goes on
                with lock:
                    state["errors"] += 1
                continue
            elapsed = 1e3 * (time.perf_counter() - t0)
            with lock:
                state["done"] += 1
                state["tokens"] += response.metadata.total_tokens
                latencies.append(elapsed)
                batch_sizes.append(response.metadata.batch_size)
                inference_ms.append(response.metadata.timings.inference_ms)
                queue_ms.append(response.metadata.timings.queue_ms)

    import psutil

    threads = [threading.Thread(target=worker, args=pair, daemon=True) for pair in zip(clients, requests)]
    me = psutil.Process()
    process = psutil.Process(server_pid) if server_pid else None
    cpu0 = (sum(me.cpu_times()[:2]), sum(process.cpu_times()[:2]) if process else 0.0)
    threads0 = thread_cpu(server_pid) if server_pid else {}
    t0 = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=deadline_s + 120)
    wall = time.perf_counter() - t0
    cpu1 = (sum(me.cpu_times()[:2]), sum(process.cpu_times()[:2]) if process else 0.0)
    threads1 = thread_cpu(server_pid) if server_pid else {}
    for client in clients:
        client.close()
    done = state["done"]
    front = model = None
    if server is not None and model_threads and done:
        front, model = split_cpu(threads0, threads1, server.startup_threads, model_threads)
    return {"clients": len(clients), "requests": state["done"], "errors": state["errors"], "seconds": wall,
            "throughput_rps": state["done"] / wall if wall > 0 else 0.0,
            "tokens_per_s": state["tokens"] / wall if wall > 0 else 0.0,
            "mean_batch_size": float(np.mean(batch_sizes)) if batch_sizes else 0.0,
            # single-sequence requests: a run of b rows answers b of them, so runs = sum(1 / b)
            "rows_per_run": (len(batch_sizes) / sum(1.0 / b for b in batch_sizes)
                             if batch_sizes and min(batch_sizes) > 0 else None),
            "front_cpu_ms_per_request": 1e3 * front / done if front is not None else None,
            "model_cpu_ms_per_request": 1e3 * model / done if model is not None else None,
            # the server's own timings: mean session.run of the batch a request ran in, queue wait
            "mean_inference_ms": float(np.mean(inference_ms)) if inference_ms else 0.0,
            "mean_queue_ms": float(np.mean(queue_ms)) if queue_ms else 0.0,
            # CPU seconds per wall second: the clients (this process) and the server
            "client_cpu_cores": (cpu1[0] - cpu0[0]) / wall if wall > 0 else 0.0,
            "server_cpu_cores": (cpu1[1] - cpu0[1]) / wall if wall > 0 and process else None,
            "server_cpu_ms_per_request": 1e3 * (cpu1[1] - cpu0[1]) / done if process and done else None,
            "latency": percentiles(latencies) if latencies else None}


def server_flags(graph: str, threads: int, *, batching: bool, max_batch_size: int = 32,
                 queue_delay_ms: float = 0.0, length_split: bool = True) -> list[str]:
    """Flags for one server run; batching off = one sequence per session.run."""
    size = max_batch_size if batching else 1
    return ["--graph", graph, "--intra-op-threads", str(threads), "--max-batch-size", str(size),
            "--max-sequences-per-request", str(min(size, 32)), "--max-queue-delay-ms",
            str(queue_delay_ms if batching else 0.0), "--length-split", str(length_split).lower()]


def rss_mb(value: int) -> float:
    return value / (1 << 20)


def vm_hwm_mb(pid: int) -> float | None:
    """The kernel's peak RSS of the process (Linux VmHWM), when readable."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None

