"""Reranking throughput: the project's server against infinity-emb's /rerank and sentence-transformers'
CrossEncoder.predict in process, on the same cross-encoder checkpoint (issue "Every encoder task").

    python -m bench.rerank_bench [--rounds 3] [--requests 2] [--peer /tmp/peer_infinity] [--engines optimum,torch]

The checkpoint: shaped like cross-encoder/ms-marco-MiniLM-L-6-v2 (BertForSequenceClassification, 6 layers, hidden
384, 12 heads, one logit), random weights, the packaged MiniLM's tokenizer; saved with save_pretrained.
The project: `python -m export --from-pretrained` (graphs fp32, optimized) and `python -m serve`; infinity: its v2
server on the same directory (the optimum engine on an `optimum-cli export onnx --task text-classification` of it,
and its torch engine), set up by ../shared/peers/infinity/setup.sh. Both are called by the same client code:
HTTP POST /rerank in infinity's body shape ({model, query, documents}), one keep-alive connection per client thread.

Load: 8 clients in a closed loop (bench.harness.closed_loop), each request one query and 32 documents of 50-300
tokens (seeded), clients x --requests timed requests per server per round (shared: a faster client sends more)
after one warm-up request each, servers alternating; then one client with five such requests in a row (p50).
Reported: pairs/s per server, the ratios within each round (median and range), p50, and CrossEncoder.predict's
pairs/s in this process at batch 32 on the same pairs. Scores of the two servers are compared first (largest
difference).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import numpy as np

from bench.harness import (LOOPBACK, WORDS, closed_loop, free_port, percentiles, running_process, running_server,
                           spread, turns, wait_ready)

SHAPE = dict(vocab_size=30522, hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536,
             max_position_embeddings=512, num_labels=1)


def _checkpoint(directory: str) -> str:
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    from model.hf_pretrained import minilm_path

    torch.manual_seed(0)
    BertForSequenceClassification(BertConfig(**SHAPE)).eval().save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        if (minilm_path() / name).is_file():
            shutil.copy(minilm_path() / name, os.path.join(directory, name))
    return directory


def _requests(rng: random.Random, count: int) -> list[tuple[str, list[str]]]:
    """(query, 32 documents of 50-300 words) per request; a word here is one token."""
    def text(n):
        return " ".join(rng.choice(WORDS) for _ in range(n))
    return [(text(rng.randint(5, 12)), [text(rng.randint(50, 300)) for _ in range(32)]) for _ in range(count)]


def _rerank(conn: http.client.HTTPConnection, model: str, query: str, documents: list[str]) -> list[float]:
    conn.request("POST", "/rerank", json.dumps({"model": model, "query": query, "documents": documents,
                                                "raw_scores": False}).encode(), {"Content-Type": "application/json"})
    response = conn.getresponse()
    body = response.read()
    if response.status != 200:
        raise RuntimeError(f"HTTP {response.status}: {body[:300]!r}")
    results = json.loads(body)["results"]
    scores = [0.0] * len(documents)
    for r in results:
        scores[r["index"]] = r["relevance_score"]
    return scores


def _answers(port: int) -> bool:
    """A readiness probe: the server at `port` answers one rerank."""
    _rerank(http.client.HTTPConnection(LOOPBACK, port, timeout=60), "reranker", "q", ["a document"])
    return True


def _load(port: int, model: str, requests, clients: int, per_client: int) -> dict:
    """`clients` threads in a closed loop, each after one warm-up request, until `clients * per_client` timed
    requests were answered: pairs/s over the timed window, and the p50 of the timed requests."""
    reconnects = [0] * clients  # each client thread counts its own

    def client(k: int):
        conn, sent = [http.client.HTTPConnection(LOOPBACK, port, timeout=600)], [0]

        def call() -> None:
            query, documents = requests[(k + sent[0] * clients) % len(requests)]
            sent[0] += 1
            try:
                _rerank(conn[0], model, query, documents)
            except (ConnectionError, http.client.HTTPException):
                # a keep-alive connection the server closed while this client waited (uvicorn's default
                # keep-alive is 5 s): counted, and the request sent again on a new connection
                reconnects[k] += 1
                conn[0] = http.client.HTTPConnection(LOOPBACK, port, timeout=600)
                _rerank(conn[0], model, query, documents)

        return call

    # the count ends the load; the clock only bounds it (a request of 32 long documents takes about a second)
    load = closed_loop([client(k) for k in range(clients)], seconds=1800.0, requests=clients * per_client)
    return {"pairs_per_s": len(load.latencies_ms) * 32 / load.seconds if load.latencies_ms else 0.0,
            "p50_ms": percentiles(load.latencies_ms, (50,))["p50_ms"], "reconnects": sum(reconnects),
            "errors": load.errors}


def _ms(result: dict) -> str:
    return "none finished in the window" if result["p50_ms"] is None else f"{result['p50_ms']:.0f} ms"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=2,
                        help="timed requests per client per round (on average: the clients share the count)")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--peer", default=os.environ.get("PEER", "/tmp/peer_infinity"))
    parser.add_argument("--engines", default="optimum,torch", help="infinity engines to run (optimum, torch)")
    parser.add_argument("--graph", default="optimized", help="the project's graph (--graph of python -m serve)")
    parser.add_argument("--json", default="")
    args = parser.parse_args(argv)

    work = tempfile.mkdtemp(prefix="rerank-bench-")
    checkpoint = _checkpoint(os.path.join(work, "cross-encoder"))
    out = subprocess.run([sys.executable, "-m", "export", "--from-pretrained", checkpoint, "--out-dir", work,
                          "--name", "reranker", "--graphs", "fp32,optimized", "--quiet"], capture_output=True, text=True)
    if out.returncode:
        sys.exit(f"export failed: {out.stderr[-1000:]}")
    rng = random.Random(7)
    requests = _requests(rng, 64)
    # a SIGTERM unwinds: every server is stopped on the way out
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    servers: dict[str, tuple[int, str]] = {}
    with ExitStack() as stack:
        try:
            project = stack.enter_context(running_server(
                os.path.join(work, "reranker"), ["--graph", args.graph, "--http-port", "0"],
                ready=lambda server: _answers(server.http_port), start_timeout_s=600.0))
        except (RuntimeError, TimeoutError) as error:
            sys.exit(f"the project: {error}")
        servers["project"] = (project.http_port, "reranker")
        env = dict(os.environ, DO_NOT_TRACK="1", HF_HUB_OFFLINE="1", INFINITY_ANONYMOUS_USAGE_STATS="0")
        for engine in [e for e in args.engines.split(",") if e]:
            model_dir = checkpoint
            if engine == "optimum":
                model_dir = os.path.join(work, "cross-encoder-onnx")
                export = subprocess.run([os.path.join(args.peer, "venv/bin/optimum-cli"), "export", "onnx", "--model",
                                         checkpoint, "--task", "text-classification", "--opset", "17", model_dir],
                                        capture_output=True, text=True, env=env)
                if export.returncode:
                    print(f"infinity optimum: optimum-cli export failed: {export.stderr[-300:]}", flush=True)
                    continue
            port, log = free_port(), Path(work) / f"infinity-{engine}.log"
            process, _, deadline = stack.enter_context(running_process(
                [os.path.join(args.peer, "venv/bin/infinity_emb"), "v2", "--model-id", ".", "--served-model-name",
                 "reranker", "--engine", engine, "--device", "cpu", "--batch-size", "32", "--host", LOOPBACK,
                 "--port", str(port)], log, cwd=model_dir, env=env, start_timeout_s=600.0))
            try:
                wait_ready(lambda: _answers(port), process, deadline, f"infinity ({engine})", log, interval_s=1.0)
            except (RuntimeError, TimeoutError) as error:
                sys.exit(str(error))
            servers[f"infinity-{engine}"] = (port, "reranker")

        # the same scores from every server first
        query, documents = requests[0]
        reference = np.asarray(_rerank(http.client.HTTPConnection(LOOPBACK, servers["project"][0], timeout=300),
                                       "reranker", query, documents))
        agreement = {name: float(np.abs(np.asarray(_rerank(http.client.HTTPConnection(LOOPBACK, p, timeout=300),
                                                                   m, query, documents)) - reference).max())
                     for name, (p, m) in servers.items() if name != "project"}
        print(f"largest score difference to the project: {agreement}", flush=True)

        rounds = []
        for number in range(args.rounds):
            rounds.append({name: _load(*servers[name], requests, args.clients, args.requests)
                           for name in turns(servers, number)})
            print(f"round {number + 1}: " + "; ".join(f"{n} {r['pairs_per_s']:.0f} pairs/s (p50 {_ms(r)}, "
                                                       f"reconnects {r['reconnects']})" for n, r in rounds[-1].items()),
                  flush=True)
        single = {name: _load(*servers[name], requests, 1, 5) for name in servers}
        print("one client: " + "; ".join(f"{n} p50 {_ms(r)}" for n, r in single.items()), flush=True)

    from sentence_transformers import CrossEncoder

    model = CrossEncoder(checkpoint, device="cpu")
    pairs = [(q, d) for q, docs in requests[:8] for d in docs]
    model.predict(pairs[:32], batch_size=32)
    started = time.perf_counter()
    model.predict(pairs, batch_size=32)
    in_process = len(pairs) / (time.perf_counter() - started)
    summary = {}
    for name in servers:
        if name == "project":
            continue
        ratios = [r["project"]["pairs_per_s"] / max(r[name]["pairs_per_s"], 1e-9) for r in rounds]
        summary[f"project/{name}"] = spread(ratios)
    project = float(np.median([r["project"]["pairs_per_s"] for r in rounds]))
    summary["project/cross-encoder-in-process"] = project / in_process
    print(f"CrossEncoder.predict in process, batch 32: {in_process:.0f} pairs/s")
    for key, value in summary.items():
        print(f"{key}: " + (f"{value['median']:.2f}x [{value['min']:.2f}-{value['max']:.2f}]" if isinstance(value, dict)
                            else f"{value:.2f}x"))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"rounds": rounds, "single": single, "in_process_pairs_per_s": in_process,
                       "agreement": agreement, "summary": summary}, handle, indent=1)


if __name__ == "__main__":
    main()
