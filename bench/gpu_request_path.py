"""The request path on a GPU host (issue 40): does the server keep the GPU busy? One command, under 8 minutes:

    python -m bench.gpu_request_path [--front-ends 0,8] [--protocols grpc,http] [--seconds 30] [--clients 256]
                                     [--serve-flags "--instances 2"] [--out FILE]

1. A BERT-base-shaped model (12 layers, 768 wide, 12 heads, random weights; bert-base-uncased's vocabulary
   through the packaged all-MiniLM-L6-v2 tokenizer, which is its own) is written as a Hugging Face directory
   and exported with its tokenizer, fp16 graph included (`python -m export --from-pretrained`), once.
2. The same fp16 graph in process: ONNX Runtime alone, at the run shapes the server ran (its mean rows per
   run, the texts' token count) and with as many runs at once as the server's run slots (`--instances`,
   serve/assembly/repository.py run_slots: two by default on CUDA), tokens/s; and at full runs
   (`--max-batch-size` rows), what the device gives when every run is full.
3. The server (`--device cuda --graph fp16`, each `--front-ends N` asked for) under `--clients` closed-loop
   clients sending one 50-token text each, back to back, for `--seconds`, over gRPC (Encode with texts) and
   over HTTP (OpenAI's /v1/embeddings): the clients run in 8 processes of their own, each client on its own
   connection. Reported: the server's tokens/s against in-process tokens/s (goal: >= 0.7), p50/p99, rows per
   session.run, the server's CPU per request (every process of it), and the GPU's busy fraction
   (nvidia-smi's utilization, sampled every 200 ms). Before the load, one client alone for `--lone-seconds` (one
   call at a time): a lone call's p50/p99, and how many ran as express runs (serve/core/express.py).

`--device cpu --quick` runs the same steps on a tiny model in under a minute (a check of the script, not a
measure). Traffic goes to 127.0.0.1 only, bounded in time. The figures go to docs/performance.md.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

from bench.harness import (REPO, closed_loop, cpu_seconds, latency_summary, metric_sum, running_server,
                           scrape_metrics, sentence)
from serve.config import ServerConfig, front_end_count

BERT_BASE = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072)
TINY = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
PROCESSES = 8  # client processes: one Python process cannot send for 256 clients without being the limit


def text_of(tokens: int, seed: int) -> str:
    """A text of about `tokens` word-piece tokens, special tokens included (harness.sentence: a word each, and
    its full stop)."""
    return sentence(max(1, tokens - 3), random.Random(seed))


def make_export(workdir: Path, shape: dict, device: str) -> Path:
    """The BERT-shaped random-init checkpoint with the packaged MiniLM tokenizer, exported (once)."""
    export = workdir / "exports" / "bert-shaped"
    if (export / "metadata.json").is_file():
        return export
    import torch
    from transformers import BertConfig, BertModel

    from model.hf_pretrained import minilm_path

    checkpoint = workdir / "bert-shaped"
    torch.manual_seed(0)
    config = BertConfig(vocab_size=30522, max_position_embeddings=512, **shape)
    BertModel(config).save_pretrained(checkpoint)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        source = minilm_path() / name
        if source.is_file():
            shutil.copy(source, checkpoint / name)
    graphs = "fp32,fp16" if device == "cuda" else "fp32,optimized"
    subprocess.run([sys.executable, "-m", "export", "--from-pretrained", str(checkpoint), "--graphs", graphs,
                    "--out-dir", str(export.parent), "--name", export.name, "--quiet"], cwd=REPO, check=True)
    return export


class InProcess:
    """ONNX Runtime alone on the served graph, the backend built once for `streams` runs at once (the server's
    run slots): tokens/s at (rows, length) with `streams` threads each running back to back on the one session,
    as the server's batcher workers do, each shape measured once. Only the pooled output is fetched, as the
    server's runs for embeddings do (hidden states stay on the device)."""

    def __init__(self, export: Path, device: str, streams: int = 1) -> None:
        from serve.backend.export_dir import load_export
        from serve.backend.session import OnnxRuntimeBackend

        graph = "fp16" if device == "cuda" else "optimized"
        self.streams = streams
        self.backend = OnnxRuntimeBackend(load_export(export, graph), device=device, instances=streams)
        self.measured: dict[tuple[int, int], float] = {}

    def tokens_per_s(self, rows: int, length: int, seconds: float) -> float:
        if (rows, length) not in self.measured:
            from serve.backend.session import dummy_batch

            batch = dummy_batch(self.backend.export.config, rows, length)
            for _ in range(5):
                self.backend.encode(batch, hidden=False)
            runs = [0] * self.streams
            go, stop = threading.Event(), threading.Event()

            def stream(index: int) -> None:
                go.wait()
                while not stop.is_set():
                    self.backend.encode(batch, hidden=False)
                    runs[index] += 1

            threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(self.streams)]
            for thread in threads:
                thread.start()
            started = time.perf_counter()
            go.set()
            stop.wait(seconds)  # the measuring window: every stream runs until it ends
            stop.set()
            for thread in threads:
                thread.join()
            self.measured[rows, length] = sum(runs) * rows * length / (time.perf_counter() - started)
        return self.measured[rows, length]


def server_run_shape(device: str, serve_flags: tuple[str, ...]) -> tuple[int, int]:
    """(run slots, rows per run at most) the server takes with these flags and the environment it inherits: its
    own parser and rules (serve/config.py load_config, serve/assembly/repository.py run_slots; one --export-dir)."""
    from serve.assembly.repository import run_slots
    from serve.config import load_config

    config = load_config(["--device", device, *serve_flags])
    return run_slots(config, None), config.max_batch_size


def _caller(protocol: str, target: str, http_target: str, model: str, tokens: int, seed: int):
    """One client on its own connection: a function that sends one text of `tokens` tokens and waits for the answer
    (gRPC Encode with texts, or OpenAI's /v1/embeddings)."""
    text = text_of(tokens, seed)
    if protocol == "grpc":
        import grpc

        from client import build_request
        from serve.protocols.pb import pb_grpc

        channel = grpc.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)])
        stub, request = pb_grpc.EncoderServiceStub(channel), build_request((), texts=[text])
        request.model = model

        def encode() -> None:  # nothing kept: closed_loop holds what a call returns
            stub.Encode(request, timeout=60.0)

        return encode
    import http.client

    import orjson

    host, port = http_target.rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=60.0)
    body = orjson.dumps({"model": model, "input": [text]})

    def call() -> None:
        connection.request("POST", "/v1/embeddings", body, {"content-type": "application/json"})
        answer = connection.getresponse()
        answer.read()
        if answer.status != 200:
            raise RuntimeError(f"HTTP {answer.status}")

    return call


def _client_process(protocol: str, target: str, http_target: str, model: str, clients: int, tokens: int, seconds: float,
                    window_at: float, out) -> None:
    """One client process: `clients` closed-loop threads (harness.closed_loop), each its own connection, counted
    from wall-clock time `window_at` (the window every process and the server's CPU reading share) for
    `seconds`."""
    calls = [_caller(protocol, target, http_target, model, tokens, i) for i in range(clients)]
    load = closed_loop(calls, seconds=seconds, warmup_s=max(0.1, window_at - time.time()))
    out.put((load.latencies_ms, load.errors))


class GpuBusy:
    """nvidia-smi's GPU utilization sampled every 200 ms while it runs (None without nvidia-smi)."""

    def __init__(self) -> None:
        self.samples: list[float] = []
        self._process = None

    def __enter__(self) -> "GpuBusy":
        if shutil.which("nvidia-smi"):
            self._process = subprocess.Popen(["nvidia-smi", "--query-gpu=utilization.gpu",
                                              "--format=csv,noheader,nounits", "-lms", "200"],
                                             stdout=subprocess.PIPE, text=True)
            threading.Thread(target=self._read, daemon=True).start()
        return self

    def _read(self) -> None:
        for line in self._process.stdout:
            try:
                self.samples.append(float(line.strip()) / 100.0)
            except ValueError:
                pass

    def __exit__(self, *exc) -> None:
        if self._process is not None:
            self._process.terminate()
            self._process.wait(10)

    @property
    def fraction(self) -> float | None:
        return float(np.mean(self.samples)) if self.samples else None


def server_load(export: Path, device: str, front_ends: int, protocol: str, clients: int, tokens: int,
                seconds: float, serve_flags: tuple[str, ...] = (), lone_seconds: float = 0.0) -> dict:
    flags = ["--device", device, "--graph", "fp16" if device == "cuda" else "optimized", "--metrics-port", "0",
             "--metrics-host", "127.0.0.1", "--http-port", "0", "--max-queue-size", str(4 * clients),
             "--front-ends", str(front_ends), *serve_flags]
    with running_server(export, flags) as server:
        # first one client alone, one call at a time: a lone call's latency, and how many ran as express runs
        # (serve/core/express.py: on the thread that read them, also behind front ends)
        express0 = metric_sum(scrape_metrics(server.metrics_port), "encoder_express_runs_total")
        lone = closed_loop([_caller(protocol, server.target, f"127.0.0.1:{server.http_port}", "", tokens, 0)],
                           seconds=lone_seconds, warmup_s=0.5) if lone_seconds else None
        express = metric_sum(scrape_metrics(server.metrics_port), "encoder_express_runs_total") - express0
        queue = multiprocessing.get_context("spawn").Queue()
        per = [clients // PROCESSES + (1 if i < clients % PROCESSES else 0) for i in range(PROCESSES)]
        window_at = time.time() + 5.0  # every client process started, connected and warm (2 s of load) by then
        workers = [multiprocessing.get_context("spawn").Process(
            target=_client_process, args=(protocol, server.target, f"127.0.0.1:{server.http_port}", "", n, tokens,
                                          seconds, window_at, queue)) for n in per if n]
        for worker in workers:
            worker.start()
        while time.time() < window_at:  # a measuring window by design, shared with the client processes
            time.sleep(0.05)
        cpu0 = cpu_seconds(server.pid, children=True)  # every process of the server, its front ends included
        scrape0 = scrape_metrics(server.metrics_port)
        with GpuBusy() as busy:
            time.sleep(seconds)
        cpu1 = cpu_seconds(server.pid, children=True)
        scrape1 = scrape_metrics(server.metrics_port)
        results = [queue.get(timeout=120) for _ in workers]
        for worker in workers:
            worker.join(60)

    def delta(name: str) -> float:
        return metric_sum(scrape1, name) - metric_sum(scrape0, name)

    requests = delta("encoder_sequences_total")
    runs = delta("encoder_batch_size_count")
    latencies = [lat for lats, _ in results for lat in lats]
    return {"front_ends": front_ends, "protocol": protocol, "serve_flags": " ".join(serve_flags), "clients": clients,
            "seconds": seconds,
            "requests_per_s": requests / seconds, "tokens_per_s": requests * tokens / seconds,
            "rows_per_run": requests / runs if runs else None, **latency_summary(latencies),
            "errors": sum(e for _, e in results), "gpu_busy": busy.fraction,
            "server_cpu_ms_per_request": 1e3 * (cpu1 - cpu0) / max(requests, 1),
            **({"lone_calls": len(lone.latencies_ms), "lone_express_runs": express,
                **{f"lone_{k}": v for k, v in latency_summary(lone.latencies_ms).items()}} if lone else {})}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_request_path", description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--front-ends", default="", help="comma-separated (default: 0 and the server's "
                        "default with --device cuda, serve/config.py front_end_count)")
    parser.add_argument("--protocols", default="grpc,http", help="comma-separated: grpc (Encode with texts), http "
                        "(OpenAI /v1/embeddings)")
    parser.add_argument("--serve-flags", default="", help="more `python -m serve` flags for every server, e.g. "
                        "\"--instances 2 --max-batch-size 64\"")
    parser.add_argument("--clients", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=50, help="tokens per text, special tokens included")
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--lone-seconds", type=float, default=3.0, help="one client alone first, one call at a "
                        "time, for this long (0: skipped): a lone call's latency")
    parser.add_argument("--workdir", default="bench-results/gpu-request-path")
    parser.add_argument("--quick", action="store_true", help="a tiny model, 16 clients, 4 s: checks the script")
    parser.add_argument("--out", default="bench-results/gpu_request_path.json")
    args = parser.parse_args(argv)
    if args.quick:
        args.clients, args.seconds, args.lone_seconds = min(args.clients, 16), min(args.seconds, 4.0), \
            min(args.lone_seconds, 2.0)
    counts = [int(n) for n in args.front_ends.split(",")] if args.front_ends else \
        [0, front_end_count(ServerConfig(device="cuda"))]  # one process, and the server's default on a GPU
    workdir = Path(args.workdir) / ("quick" if args.quick else "bert-base")
    workdir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    export = make_export(workdir, TINY if args.quick else BERT_BASE, args.device)
    print(f"export {export} ready after {time.monotonic() - started:.0f} s", flush=True)
    rows = []
    serve_flags = tuple(args.serve_flags.split())
    for count in counts:
        for protocol in args.protocols.split(","):
            r = server_load(export, args.device, count, protocol, args.clients, args.tokens, args.seconds, serve_flags,
                            args.lone_seconds)
            rows.append(r)
            if "lone_p50_ms" in r:
                print(f"front ends {count} {protocol:4s} {args.serve_flags}: one client alone, p50 "
                      f"{r['lone_p50_ms']:.2f} ms  p99 {r['lone_p99_ms']:.2f} ms  ({r['lone_calls']} calls, "
                      f"{r['lone_express_runs']:.0f} express runs, its warm-up included)", flush=True)
            print(f"front ends {count} {protocol:4s} {args.serve_flags}: {r['tokens_per_s']:9.0f} tokens/s  {r['requests_per_s']:7.0f} "
                  f"req/s  p50 {r['p50_ms'] or 0:7.2f} ms  p99 {r['p99_ms'] or 0:7.2f} ms  rows/run "
                  f"{r['rows_per_run'] or 0:5.1f}  GPU busy {r['gpu_busy'] if r['gpu_busy'] is not None else 'n/a'}  "
                  f"server CPU {r['server_cpu_ms_per_request']:.3f} ms/req  errors {r['errors']}", flush=True)
    streams, full = server_run_shape(args.device, serve_flags)
    in_process = InProcess(export, args.device, streams)
    window = min(10.0, args.seconds / 3)
    for r in rows:  # in process at the shape the server ran (its rows per run, the texts' tokens, its run slots)
        shape_rows = max(1, round(r["rows_per_run"] or 1))
        r["in_process_tokens_per_s"] = in_process.tokens_per_s(shape_rows, args.tokens, window)
        r["in_process_streams"] = streams
        r["server_over_in_process"] = r["tokens_per_s"] / r["in_process_tokens_per_s"]
        # and against full runs (--max-batch-size rows): what the device gives when every run is full
        r["in_process_full_runs_tokens_per_s"] = in_process.tokens_per_s(full, args.tokens, window)
        r["server_over_full_runs"] = r["tokens_per_s"] / r["in_process_full_runs_tokens_per_s"]
        print(f"front ends {r['front_ends']} {r['protocol']:4s}: server / in process "
              f"{r['server_over_in_process']:.2f} (in process {r['in_process_tokens_per_s']:.0f} tokens/s at "
              f"{shape_rows} x {args.tokens}, {streams} at once); / full runs {r['server_over_full_runs']:.2f} "
              f"({r['in_process_full_runs_tokens_per_s']:.0f} tokens/s at {full} x {args.tokens})", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": args.device, "quick": args.quick, "cpus": os.cpu_count(), "rows": rows,
                               "seconds_total": time.monotonic() - started}, indent=2))
    print(f"wrote {out} after {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
