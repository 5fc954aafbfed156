"""The request path's cost, per protocol and per number of front ends:
`python -m bench.front_end [--rounds 3] [--seconds 15] [--protocols encode,v2,v2-rest,openai-texts]
[--front-ends 0,1,2] [--serve-from OTHER_CHECKOUT]`.

One `python -m serve` (default flags, `--front-ends N` for each N asked) per round and N; in each the same
load goes through each protocol, taking turns: 32 clients, each on its own connection, sending one sequence of
32 tokens back to back (the issue-21 load; `openai-texts`: OpenAI's /v1/embeddings with one text of about that
many tokens, for an export with a tokenizer). Reported per protocol: req/s, p50/p99, rows per session.run,
and the server's CPU per request, every process of it counted (the engine and its front ends), split into the
model (ONNX Runtime's pool threads + the batcher threads' CPU inside session.run, from
`encoder_session_run_cpu_seconds_total`) and the request path (everything else: transports, routing, parsing,
validation, tokenization, batching, the wire between processes, responses). Ratios (Encode / v2) are taken
within a round. `--serve-from` runs another checkout's server (a commit before a change) under the same load.
Traffic goes to 127.0.0.1 only, bounded in time.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
from pathlib import Path

import numpy as np

from bench.harness import (ServerHandle, closed_loop, latency_summary, metric_sum, running_server, scrape_metrics,
                           spread, thread_cpu, thread_name)


OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]  # each client its own TCP connection, as separate hosts
TEXT = "the quick brown fox jumps over the lazy dog and keeps on running through the long grass of the field"


def _callers(protocol: str, target: str, ids: np.ndarray, model: str, http_target: str = ""):
    """A function sending one request of `ids` ([rows, T]) on its own connection; returns rows per run."""
    if protocol == "encode":
        import grpc

        from client import build_request
        from serve.protocols.pb import pb_grpc

        channel = grpc.insecure_channel(target, options=OWN_CONNECTION)
        stub, request = pb_grpc.EncoderServiceStub(channel), build_request(list(ids))

        def call() -> int:
            return stub.Encode(request, timeout=60.0).metadata.batch_size

        return call, channel.close
    if protocol == "openai-texts":
        import http.client

        import orjson

        local = threading.local()
        host, port = http_target.rsplit(":", 1)
        body = orjson.dumps({"model": model, "input": [TEXT] * len(ids)})

        def call() -> int:
            if not hasattr(local, "connection"):
                local.connection = http.client.HTTPConnection(host, int(port), timeout=60.0)
            local.connection.request("POST", "/v1/embeddings", body, {"content-type": "application/json"})
            answer = local.connection.getresponse()
            if answer.status != 200:
                raise RuntimeError(f"HTTP {answer.status}: {answer.read()[:200]!r}")
            answer.read()
            return 0  # the answer does not say its batch

        return call, lambda: None
    if protocol == "v2-rest":
        import tritonclient.http as httpclient

        # tritonclient.http runs on gevent: a client is used only in the thread that made it
        local, clients = threading.local(), []
        inputs = [httpclient.InferInput("input_ids", list(ids.shape), "INT64")]
        inputs[0].set_data_from_numpy(ids.astype(np.int64), binary_data=True)
        outputs = [httpclient.InferRequestedOutput("embeddings", binary_data=True)]

        def call() -> int:
            if not hasattr(local, "client"):
                local.client = httpclient.InferenceServerClient(url=http_target, network_timeout=60.0)
                clients.append(local.client)
            return int(local.client.infer(model, inputs, outputs=outputs).get_response()["parameters"]["batch_size"])

        return call, lambda: None  # each thread's client closes with its thread
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(url=target, channel_args=OWN_CONNECTION)
    inputs = [grpcclient.InferInput("input_ids", list(ids.shape), "INT64")]
    inputs[0].set_data_from_numpy(ids.astype(np.int64))
    outputs = [grpcclient.InferRequestedOutput("embeddings")]

    def call() -> int:
        response = client.infer(model, inputs, outputs=outputs).get_response()
        return response.parameters["batch_size"].int64_param

    return call, client.close


def _process_threads(pid: int) -> dict[tuple[int, int], tuple[float, str]]:
    """{(pid, thread id): (CPU seconds, its name)} of the server's process and its children (front ends)."""
    import psutil

    try:
        processes = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return {}
    out = {}
    for process in processes:
        for tid, seconds in thread_cpu(process.pid).items():
            out[(process.pid, tid)] = (seconds, thread_name(process.pid, tid))
    return out


def load(protocol: str, server: ServerHandle, metrics_port: int, model: str, *, clients: int, length: int,
         seconds: float, vocab: int, rows: int = 1) -> dict:
    """`clients` threads back to back for `seconds` (after 2 s of warm-up): req/s, latency, CPU split."""
    rng = np.random.default_rng(0)
    http = f"127.0.0.1:{server.http_port}" if server.http_port else ""
    pairs = [_callers(protocol, server.target, rng.integers(1, vocab, (rows, length)), model, http)
             for _ in range(clients)]

    def snapshot():
        return _process_threads(server.pid), scrape_metrics(metrics_port)

    try:
        measured = closed_loop([call for call, _ in pairs], seconds=seconds, warmup_s=2.0, snapshot=snapshot,
                               grace_s=60.0)
    finally:
        for _, close in pairs:
            close()
    (threads0, scrape0), (threads1, scrape1) = measured.snapshots
    wall, batch_sizes = measured.seconds, [b for b in measured.results if b]
    done = len(measured.results)
    spent = {key: value - threads0.get(key, (0.0, ""))[0] for key, (value, _) in threads1.items()}
    total = sum(spent.values())
    # ONNX Runtime's pool threads: the engine process's unnamed threads but its main one
    pool = sum(cpu for (pid, tid), cpu in spent.items()
               if pid == server.pid and tid != server.pid and threads1[(pid, tid)][1] == "python")
    in_run = (metric_sum(scrape1, "encoder_session_run_cpu_seconds_total")
              - metric_sum(scrape0, "encoder_session_run_cpu_seconds_total"))
    model_cpu = pool + in_run
    front_ends = sum(cpu for (pid, _), cpu in spent.items() if pid != server.pid)
    return {"protocol": protocol, "clients": clients, "rows": rows, "length": length, "requests": done, "seconds": wall,
            "throughput_rps": done / wall, **latency_summary(measured.latencies_ms),
            "rows_per_run": len(batch_sizes) / sum(1.0 / b for b in batch_sizes) if batch_sizes else None,
            "server_cpu_ms_per_request": 1e3 * total / done, "model_cpu_ms_per_request": 1e3 * model_cpu / done,
            "front_cpu_ms_per_request": 1e3 * (total - model_cpu) / done,
            "front_end_processes_cpu_ms_per_request": 1e3 * front_ends / done}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.front_end", description=__doc__.split("\n")[0])
    parser.add_argument("--export-dir", default="exports/default")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--length", type=int, default=32)
    parser.add_argument("--rows", type=int, default=1, help="sequences per request (issue 27: 32 x 128)")
    parser.add_argument("--protocols", default="encode,v2",
                        help="comma-separated, of encode, v2 (KServe v2 gRPC), v2-rest (KServe v2 REST, binary "
                             "tensors), openai-texts (/v1/embeddings with texts: an export with a tokenizer)")
    parser.add_argument("--front-ends", default="0", help="comma-separated counts of front-end processes to run")
    parser.add_argument("--serve-from", default="", help="another checkout whose server to run (default: this one)")
    parser.add_argument("--flags", default="", help="more `python -m serve` flags (default: none)")
    parser.add_argument("--out", default="bench-results/front_end.json")
    args = parser.parse_args(argv)
    from model.export_format import read_metadata

    meta = read_metadata(Path(args.export_dir))
    protocols, counts = args.protocols.split(","), [int(n) for n in args.front_ends.split(",")]
    source = {"serve_from": args.serve_from} if args.serve_from else {}
    rounds = []
    for number in range(args.rounds):
        results = {}
        for count in (counts if number % 2 == 0 else counts[::-1]):
            http = any(p in ("v2-rest", "openai-texts") for p in protocols)
            flags = ["--metrics-port", "0", "--metrics-host", "127.0.0.1", *(["--http-port", "0"] if http else []),
                     "--front-ends", str(count), *args.flags.split()]
            with running_server(args.export_dir, flags, **source) as server:
                for protocol in (protocols if number % 2 == 0 else protocols[::-1]):
                    r = results[f"{protocol}@{count}"] = load(
                        protocol, server, server.metrics_port, meta.name, clients=args.clients, length=args.length,
                        seconds=args.seconds, vocab=meta.config.vocab_size, rows=args.rows)
                    print(f"round {number + 1} {protocol:12s} front ends {count}: {r['throughput_rps']:7.1f} req/s  "
                          f"p50 {r['p50_ms']:6.2f} ms  p99 {r['p99_ms']:6.2f} ms  rows/run "
                          f"{r['rows_per_run'] or 0:.1f}  server CPU {r['server_cpu_ms_per_request']:.3f} ms/req = "
                          f"request path {r['front_cpu_ms_per_request']:.3f} + model {r['model_cpu_ms_per_request']:.3f}",
                          flush=True)
                results[f"transport@{count}"] = server.transport
        for count in counts:  # ratios within the round
            for a, b in (("encode", "v2"), ("v2-rest", "v2")):
                if f"{a}@{count}" in results and f"{b}@{count}" in results:
                    ratio = results[f"{a}@{count}"]["throughput_rps"] / results[f"{b}@{count}"]["throughput_rps"]
                    results[f"{a}_over_{b}@{count}"] = ratio
        rounds.append(results)
    summary = {}
    for key in sorted({k for r in rounds for k in r if "_over_" in k}):
        ratio = spread([r[key] for r in rounds if key in r])
        summary[f"{key}_median"], summary[f"{key}_range"] = ratio["median"], [ratio["min"], ratio["max"]]
    for protocol in protocols:
        for count in counts:
            for key in ("throughput_rps", "front_cpu_ms_per_request", "server_cpu_ms_per_request", "p50_ms"):
                summary[f"{protocol}@{count}_{key}_median"] = spread([r[f"{protocol}@{count}"][key]
                                                                       for r in rounds])["median"]
    print(json.dumps(summary, indent=2))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"rounds": rounds, "summary": summary, "cpus": os.cpu_count(),
                               "serve_from": args.serve_from or "this checkout"}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
