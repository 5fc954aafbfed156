"""Server benchmark: the real `python -m serve` as a subprocess on 127.0.0.1 (bench.harness.running_server).

latency: sequential Encode calls over loopback vs session.run in this process on the same inputs.
throughput: N client threads, each sending single-sequence requests back to back (bench.harness.closed_loop).
memory: the server's RSS (bench.harness.RssSampler) idle, under load, and after 1k vs 20k requests.
Every loop is bounded by a request count or a deadline.
"""

from __future__ import annotations

import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from bench.harness import (LOOPBACK, ServerHandle, closed_loop, cpu_seconds, latency_summary, running_process,
                           thread_cpu, tidy)


@contextmanager
def running_bare_server(export_dir: str, graph: str, threads: int, *, start_timeout_s: float = 120.0):
    """Start bench/bare_server.py (gRPC + session.run, nothing else) on 127.0.0.1; yields its handle."""
    workdir = Path(tempfile.mkdtemp(prefix="bench-bare-"))
    port_file, log = workdir / "port.json", workdir / "server.log"
    flags = ["--export-dir", str(export_dir), "--graph", graph, "--threads", str(threads)]
    command = [sys.executable, "-m", "bench.bare_server", *flags, "--port-file", str(port_file)]
    with running_process(command, log, port_file=port_file, start_timeout_s=start_timeout_s) as (process, ports, _):
        port = int(ports["port"])
        yield ServerHandle(process, port, f"{LOOPBACK}:{port}", log, flags)
    tidy(workdir, process)


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
    return {name: latency_summary(samples) for name, samples in out.items()}


def concurrent_load(target: str, ids_per_client: list[np.ndarray], *, total_requests: int,
                    deadline_s: float, server: ServerHandle | None = None, model_threads: int = 0) -> dict:
    """len(ids_per_client) threads, each one channel, each sending its single-sequence request
    back to back until `total_requests` were answered in all or `deadline_s` passed. With `server`
    (and `model_threads`, the intra-op thread count): its CPU, split into front end and model per
    request (split_cpu), and the rows per session.run."""
    from client import EncoderClient, build_request

    clients = [EncoderClient(target, timeout=60.0, retries=0) for _ in ids_per_client]

    def caller(client, request):
        def call():
            metadata = client.stub.Encode(request, timeout=60.0).metadata
            return (metadata.total_tokens, metadata.batch_size, metadata.timings.inference_ms,
                    metadata.timings.queue_ms)
        return call

    def snapshot():
        return (cpu_seconds(), cpu_seconds(server.pid) if server else 0.0,
                thread_cpu(server.pid) if server else {})

    try:
        load = closed_loop([caller(client, build_request([ids])) for client, ids in zip(clients, ids_per_client)],
                           seconds=deadline_s, requests=total_requests, snapshot=snapshot)
    finally:
        for client in clients:
            client.close()
    (me0, server0, threads0), (me1, server1, threads1) = load.snapshots
    wall, done = load.seconds, len(load.results)
    tokens, batch_sizes, inference_ms, queue_ms = zip(*load.results) if done else ((), (), (), ())
    front = model = None
    if server is not None and model_threads and done:
        front, model = split_cpu(threads0, threads1, server.startup_threads, model_threads)
    return {"clients": len(clients), "requests": done, "errors": load.errors, "seconds": wall,
            "throughput_rps": done / wall if wall > 0 else 0.0,
            "tokens_per_s": sum(tokens) / wall if wall > 0 else 0.0,
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
            "client_cpu_cores": (me1 - me0) / wall if wall > 0 else 0.0,
            "server_cpu_cores": (server1 - server0) / wall if wall > 0 and server else None,
            "server_cpu_ms_per_request": 1e3 * (server1 - server0) / done if server and done else None,
            "latency": latency_summary(load.latencies_ms) if done else None}


def server_flags(graph: str, threads: int, *, batching: bool, max_batch_size: int = 32,
                 queue_delay_ms: float = 0.0, length_split: bool = True) -> list[str]:
    """Flags for one server run; batching off = one sequence per session.run. One process (`--front-ends 0`) on
    every device, as every earlier row was taken: the front ends a CUDA server starts by default are
    bench.gpu_request_path's to measure."""
    size = max_batch_size if batching else 1
    return ["--front-ends", "0", "--graph", graph, "--intra-op-threads", str(threads), "--max-batch-size", str(size),
            "--max-sequences-per-request", str(min(size, 32)), "--max-queue-delay-ms",
            str(queue_delay_ms if batching else 0.0), "--length-split", str(length_split).lower()]
