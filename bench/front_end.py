"""The front end's cost, per protocol: `python -m bench.front_end [--rounds 3] [--seconds 15]`.

One `python -m serve` with default flags (the main port, whichever transport it picks) per round;
in each round the same load goes through Encode and through KServe v2 ModelInfer, taking turns:
32 clients, each on its own channel, sending one sequence of 32 tokens back to back (the issue-21
load), then one client sending (1, 128) sequentially (latency). Reported per protocol: req/s, p50/p99,
rows per session.run, and the server's CPU per request split into the model (ONNX Runtime's pool
threads + the batcher threads' CPU inside session.run, from `encoder_session_run_cpu_seconds_total`)
and the front end (everything else: transport, routing, parsing, validation, batching, responses).
Ratios (Encode / v2) are taken within a round. Traffic goes to 127.0.0.1 only, bounded in time.
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


def _callers(protocol: str, target: str, ids: np.ndarray, model: str, http_target: str = ""):
    """A function sending one request of `ids` ([rows, T]) on its own channel (or HTTP connection);
    returns rows per run."""
    if protocol == "encode":
        from client import EncoderClient, build_request

        client = EncoderClient(target, timeout=60.0, retries=0)
        request = build_request(list(ids))

        def call() -> int:
            return client.stub.Encode(request, timeout=60.0).metadata.batch_size

        return call, client.close
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

    client = grpcclient.InferenceServerClient(url=target)
    inputs = [grpcclient.InferInput("input_ids", list(ids.shape), "INT64")]
    inputs[0].set_data_from_numpy(ids.astype(np.int64))
    outputs = [grpcclient.InferRequestedOutput("embeddings")]

    def call() -> int:
        response = client.infer(model, inputs, outputs=outputs).get_response()
        return response.parameters["batch_size"].int64_param

    return call, client.close


def load(protocol: str, server: ServerHandle, metrics_port: int, model: str, *, clients: int, length: int,
         seconds: float, vocab: int, rows: int = 1) -> dict:
    """`clients` threads back to back for `seconds` (after 2 s of warm-up): req/s, latency, CPU split."""
    rng = np.random.default_rng(0)
    http = f"127.0.0.1:{server.http_port}" if server.http_port else ""
    pairs = [_callers(protocol, server.target, rng.integers(1, vocab, (rows, length)), model, http)
             for _ in range(clients)]

    def snapshot():
        return thread_cpu(server.pid), scrape_metrics(metrics_port)

    try:
        measured = closed_loop([call for call, _ in pairs], seconds=seconds, warmup_s=2.0, snapshot=snapshot,
                               grace_s=60.0)
    finally:
        for _, close in pairs:
            close()
    (threads0, scrape0), (threads1, scrape1) = measured.snapshots
    wall, batch_sizes = measured.seconds, measured.results
    done = len(batch_sizes)
    total = sum(threads1.get(t, 0.0) - threads0.get(t, 0.0) for t in threads1)
    pool = sum(threads1[t] - threads0.get(t, 0.0) for t in threads1 if thread_name(server.pid, t) == "python"
               and t != server.pid)  # ONNX Runtime's pool threads: the only unnamed ones but main
    in_run = (metric_sum(scrape1, "encoder_session_run_cpu_seconds_total")
              - metric_sum(scrape0, "encoder_session_run_cpu_seconds_total"))
    model_cpu = pool + in_run
    return {"protocol": protocol, "clients": clients, "rows": rows, "length": length, "requests": done, "seconds": wall,
            "throughput_rps": done / wall, **latency_summary(measured.latencies_ms),
            "rows_per_run": len(batch_sizes) / sum(1.0 / b for b in batch_sizes) if batch_sizes else None,
            "server_cpu_ms_per_request": 1e3 * total / done, "model_cpu_ms_per_request": 1e3 * model_cpu / done,
            "front_cpu_ms_per_request": 1e3 * (total - model_cpu) / done}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.front_end", description=__doc__.split("\n")[0])
    parser.add_argument("--export-dir", default="exports/default")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--length", type=int, default=32)
    parser.add_argument("--rows", type=int, default=1, help="sequences per request (issue 27: 32 x 128)")
    parser.add_argument("--protocols", default="encode,v2",
                        help="comma-separated, of encode, v2 (KServe v2 gRPC), v2-rest (KServe v2 REST, binary tensors)")
    parser.add_argument("--flags", default="", help="more `python -m serve` flags (default: none)")
    parser.add_argument("--out", default="bench-results/front_end.json")
    args = parser.parse_args(argv)
    from model.export_format import read_metadata

    meta = read_metadata(Path(args.export_dir))
    rounds = []
    for number in range(args.rounds):
        protocols = args.protocols.split(",")
        port_file_flags = ["--metrics-port", "0", "--metrics-host", "127.0.0.1",
                           *(["--http-port", "0"] if "v2-rest" in protocols else []), *args.flags.split()]
        with running_server(args.export_dir, port_file_flags) as server:
            metrics_port = server.metrics_port
            order = protocols if number % 2 == 0 else protocols[::-1]
            results = {}
            for protocol in order:
                results[protocol] = load(protocol, server, metrics_port, meta.name, clients=args.clients,
                                         length=args.length, seconds=args.seconds, vocab=meta.config.vocab_size,
                                         rows=args.rows)
                r = results[protocol]
                print(f"round {number + 1} {protocol:6s} {r['throughput_rps']:7.1f} req/s  p50 {r['p50_ms']:6.2f} ms  "
                      f"p99 {r['p99_ms']:6.2f} ms  rows/run {r['rows_per_run']:.1f}  server CPU "
                      f"{r['server_cpu_ms_per_request']:.3f} ms/req = front end {r['front_cpu_ms_per_request']:.3f} "
                      f"+ model {r['model_cpu_ms_per_request']:.3f}", flush=True)
            results["transport"] = server.transport
            for a, b in (("encode", "v2"), ("v2-rest", "v2")):  # ratios within the round
                if a in results and b in results:
                    results[f"{a}_over_{b}"] = results[a]["throughput_rps"] / results[b]["throughput_rps"]
                    print(f"round {number + 1} {a}/{b} throughput {results[f'{a}_over_{b}']:.3f} "
                          f"(transport {server.transport})", flush=True)
            rounds.append(results)
    summary = {}
    for key in ("encode_over_v2", "v2-rest_over_v2"):
        ratios = [r[key] for r in rounds if key in r]
        if ratios:
            ratio = spread(ratios)
            summary[f"{key}_median"], summary[f"{key}_range"] = ratio["median"], [ratio["min"], ratio["max"]]
    for protocol in protocols:
        for key in ("throughput_rps", "front_cpu_ms_per_request", "server_cpu_ms_per_request", "p50_ms"):
            summary[f"{protocol}_{key}_median"] = spread([r[protocol][key] for r in rounds])["median"]
    print(json.dumps(summary, indent=2))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"rounds": rounds, "summary": summary, "cpus": os.cpu_count()}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
