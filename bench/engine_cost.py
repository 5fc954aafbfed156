"""The engine process's own CPU per request, and the rate one engine can take: `python -m bench.engine_cost`.

With front ends (`--front-ends N`) every request crosses one engine process: its receiving thread, the batcher
and the outbox run in one interpreter, and on a GPU host, where the model costs the host little, that
interpreter is the server's limit (docs/performance.md "The request path on a GPU host"). This measures it
alone: the real engine side (serve/assembly/front_ends.py EngineService, admission, the batcher, the runner,
the wire of serve/core/ipc.py) in this process, fed by `--front-ends` processes that each run the real
front-end link (serve/core/remote.py EngineLink) and keep `--outstanding` requests of `--rows` x `--length`
token ids in flight, as a front end full of clients would, with no transport or protocol in front of them.
The model is a backend answering zeros of the export's shape (bench/core_cost.py NullBackend), after
`--run-ms` + `--row-ms` x rows of sleep with the GIL released, standing in for a device's run (0: the
engine's own ceiling). Reported per round: requests/s, rows per run, and the engine's CPU per request by
thread. `PYTHONPATH=OTHER_CHECKOUT` runs another tree's engine and link (a commit before a change).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from bench.core_cost import NullBackend
from bench.harness import thread_cpu, thread_name

ENGINE_THREADS = ("engine-service", "engine-outbox", "batcher-0", "batcher-1", "batcher-finish")


class DeviceLikeBackend(NullBackend):
    """Zeros of the right shape after a sleep (no GIL held) of `run_s` + `row_s` per row, one run at a time (one
    device: runs started together queue for it)."""

    run_s = row_s = 0.0
    runs = rows = 0
    device = threading.Lock()

    def encode(self, batch, *args, **kwargs):
        n = len(batch.get("input_ids", batch.get("inputs_embeds")))
        if self.run_s or self.row_s:
            with self.device:
                time.sleep(self.run_s + self.row_s * n)
        DeviceLikeBackend.runs += 1
        DeviceLikeBackend.rows += n
        return super().encode(batch, *args, **kwargs)


def _front_end(folder: str, index: int, outstanding: int, rows: int, length: int, stop, out) -> None:
    """One front end's link keeping `outstanding` requests in flight until `stop` is set; sends how many were
    answered, and how many failed."""
    from serve.backend.feeds import Rows
    from serve.core.remote import EngineLink, RemoteTicket
    from serve.core.requests import MaskChoice, Work

    link = EngineLink(folder, index)
    link.start()
    ids = np.random.default_rng(index).integers(5, 100, (rows, length)).astype(np.int64)
    lengths = np.full(rows, length, np.int64)
    answered, failed, lock, done = [0], [0], threading.Lock(), threading.Event()

    def send() -> None:
        ticket = RemoteTicket(Work(ids, MaskChoice(), False, "mean", True, False), Rows(ids, lengths), None)
        ticket.add_done_callback(finished)
        link.send_work(ticket, "default")

    def finished(ticket) -> None:
        with lock:
            if ticket._error is None:
                answered[0] += 1
            else:
                failed[0] += 1
        if not stop.is_set():
            send()
        elif link.in_flight() == 0:
            done.set()

    for _ in range(outstanding):
        send()
    stop.wait()
    done.wait(60)
    out.put((index, answered[0], failed[0]))
    link.stop()


def measure(export_dir: str, front_ends: int, outstanding: int, rows: int, length: int, seconds: float,
            run_ms: float, row_ms: float, instances: int = 1) -> dict:
    from serve.assembly.front_ends import EngineService
    from serve.assembly.loading import build_engine
    from serve.config import ServerConfig
    from serve.core.admission import Admission

    DeviceLikeBackend.run_s, DeviceLikeBackend.row_s = run_ms / 1e3, row_ms / 1e3
    DeviceLikeBackend.runs = DeviceLikeBackend.rows = 0
    config = ServerConfig(export_dir=export_dir, warmup=False, http_port=-1, length_split=False, instances=instances)
    engine, _ = build_engine(export_dir, "auto", config, DeviceLikeBackend)
    admission = Admission("default")
    admission.loading()
    admission.serving({"default": engine})
    folder = tempfile.mkdtemp(prefix="engine-cost-")
    service = EngineService(folder, front_ends, admission, {}, {})
    service.start()
    context = multiprocessing.get_context("spawn")
    out, stop = context.Queue(), context.Event()
    warm = 1.5
    workers = [context.Process(target=_front_end, args=(folder, i, outstanding, rows, length, stop, out))
               for i in range(front_ends)]
    try:
        for worker in workers:
            worker.start()
        waiting = time.monotonic() + 120
        while DeviceLikeBackend.runs == 0:  # the front ends' imports take a while: time from their first request
            if time.monotonic() > waiting or not any(worker.is_alive() for worker in workers):
                raise RuntimeError("no front end sent a request within 120 s")
            time.sleep(0.05)
        time.sleep(warm)
        pid = os.getpid()
        before, runs0, rows0, started = thread_cpu(pid), DeviceLikeBackend.runs, DeviceLikeBackend.rows, time.monotonic()
        time.sleep(seconds)
        after, runs1, rows1, wall = thread_cpu(pid), DeviceLikeBackend.runs, DeviceLikeBackend.rows, time.monotonic() - started
        names = {tid: thread_name(pid, tid) for tid in after}  # while they run
        stop.set()
        results = [out.get(timeout=120) for _ in workers]
    finally:
        stop.set()
        for worker in workers:
            worker.join(timeout=30)
        service.stop()
        engine.batcher.stop(0)
        shutil.rmtree(folder, ignore_errors=True)  # the engine's sockets
    requests = (rows1 - rows0) / rows
    by_thread: dict[str, float] = {}
    for tid, cpu in after.items():
        name = names[tid]
        if name in ENGINE_THREADS:
            by_thread[name] = by_thread.get(name, 0.0) + (cpu - before.get(tid, 0.0)) / max(requests, 1) * 1e6
    return {"requests_per_s": requests / wall, "rows_per_run": (rows1 - rows0) / max(runs1 - runs0, 1),
            "engine_cpu_us_per_request": sum(by_thread.values()), "by_thread_us": by_thread,
            "device_busy": (runs1 - runs0) * run_ms / 1e3 / wall + (rows1 - rows0) * row_ms / 1e3 / wall,
            "failed": sum(r[2] for r in results)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.engine_cost", description=__doc__.split("\n")[0])
    parser.add_argument("--export-dir", default="exports/default")
    parser.add_argument("--front-ends", type=int, default=2)
    parser.add_argument("--outstanding", type=int, default=32, help="requests in flight per front end")
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--length", type=int, default=50)
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--run-ms", type=float, default=0.0, help="a run's fixed device time (0: none)")
    parser.add_argument("--row-ms", type=float, default=0.0, help="device time per row of a run")
    parser.add_argument("--instances", type=int, default=1, help="the server's run slots (--instances)")
    parser.add_argument("--out", default="bench-results/engine_cost.json")
    args = parser.parse_args(argv)
    rounds = []
    for number in range(args.rounds):
        result = measure(args.export_dir, args.front_ends, args.outstanding, args.rows, args.length, args.seconds,
                         args.run_ms, args.row_ms, args.instances)
        rounds.append(result)
        threads = ", ".join(f"{name} {us:.1f}" for name, us in sorted(result["by_thread_us"].items()))
        print(f"round {number + 1}: {result['requests_per_s']:.0f} req/s, {result['rows_per_run']:.1f} rows per run, "
              f"device busy {result['device_busy']:.2f}, engine CPU {result['engine_cpu_us_per_request']:.1f} us per "
              f"request ({threads}), failed {result['failed']}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "rounds": rounds}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
