"""Reranking throughput: the project's server against infinity-emb's /rerank and sentence-transformers'
CrossEncoder.predict in process, on the same cross-encoder checkpoint (issue "Every encoder task").

    python -m bench.rerank_bench [--rounds 3] [--requests 2] [--peer /tmp/peer_infinity] [--engines optimum,torch]

The checkpoint: shaped like cross-encoder/ms-marco-MiniLM-L-6-v2 (BertForSequenceClassification, 6 layers, hidden
384, 12 heads, one logit), random weights, the packaged MiniLM's tokenizer; saved with save_pretrained.
The project: `python -m export --from-pretrained` (graphs fp32, optimized) and `python -m serve`; infinity: its v2
server on the same directory (the optimum engine on an `optimum-cli export onnx --task text-classification` of it,
and its torch engine), set up by ../shared/peers/infinity/setup.sh. Both are called by the same client code:
HTTP POST /rerank in infinity's body shape ({model, query, documents}), one keep-alive connection per client thread.

Load: 8 clients in a closed loop, each request one query and 32 documents of 50-300 tokens (seeded), --requests
timed requests per client per server per round after one warm-up each, servers alternating; then one client
with five such requests in a row (p50). Reported:
pairs/s per server, the ratios within each round (median and range), p50, and CrossEncoder.predict's pairs/s
in this process at batch 32 on the same pairs. Scores of the two servers are compared first (largest difference).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

WORDS = ("time person year way day thing man world life hand part child eye woman place work week case point "
         "government company number group problem fact river light sound music garden window paper story "
         "question answer reason idea market system program student country family money water night").split()
SHAPE = dict(vocab_size=30522, hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536,
             max_position_embeddings=512, num_labels=1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def _wait(port: int, model: str, proc: subprocess.Popen, what: str, timeout: float = 600) -> None:
    end = time.time() + timeout
    while time.time() < end:
        if proc.poll() is not None:
            sys.exit(f"{what} exited with {proc.returncode}")
        try:
            _rerank(http.client.HTTPConnection("127.0.0.1", port, timeout=60), model, "q", ["a document"])
            return
        except Exception:
            time.sleep(1)
    sys.exit(f"{what} never answered")


def _load(port: int, model: str, requests, clients: int, per_client: int) -> dict:
    """`clients` threads, each sending `per_client` requests in a row after one warm-up request (a closed
    loop): pairs/s over the wall time from the first timed request's start to the last one's end, and the
    p50 of the timed requests."""
    latencies, lock, errors, spans = [], threading.Lock(), [0], []
    ready = threading.Barrier(clients)

    def worker(k: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        for n in range(per_client + 1):
            if n == 1:
                ready.wait()  # every client warmed up: the timed requests start together
            query, documents = requests[(k + n * clients) % len(requests)]
            started = time.time()
            try:
                _rerank(conn, model, query, documents)
            except (ConnectionError, http.client.HTTPException):
                # a keep-alive connection the server closed while this client waited (uvicorn's default
                # keep-alive is 5 s): counted, and the request sent again on a new connection, timed from there
                with lock:
                    errors[0] += 1
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
                started = time.time()
                _rerank(conn, model, query, documents)
            if n:
                with lock:
                    latencies.append(time.time() - started)
                    spans.append((started, time.time()))

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(clients)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    latencies.sort()
    wall = max(end for _, end in spans) - min(start for start, _ in spans) if spans else float("inf")
    return {"pairs_per_s": len(latencies) * 32 / wall,
            "p50_ms": 1e3 * latencies[len(latencies) // 2] if latencies else None, "reconnects": errors[0]}


def _ms(result: dict) -> str:
    return "none finished in the window" if result["p50_ms"] is None else f"{result['p50_ms']:.0f} ms"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=2, help="timed requests per client per round")
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
    procs: list[subprocess.Popen] = []

    def stop_all() -> None:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()

    signal.signal(signal.SIGTERM, lambda *_: (stop_all(), sys.exit(1)))
    servers: dict[str, tuple[int, str]] = {}
    try:
        port = _free_port()
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "serve", "--export-dir", os.path.join(work, "reranker"), "--graph", args.graph,
             "--host", "127.0.0.1", "--port", str(_free_port()), "--http-port", str(port), "--metrics-port", "-1"],
            stdout=open(os.path.join(work, "serve.log"), "w"), stderr=subprocess.STDOUT))
        _wait(port, "reranker", procs[-1], "the project")
        servers["project"] = (port, "reranker")
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
            port = _free_port()
            procs.append(subprocess.Popen(
                [os.path.join(args.peer, "venv/bin/infinity_emb"), "v2", "--model-id", ".", "--served-model-name",
                 "reranker", "--engine", engine, "--device", "cpu", "--batch-size", "32", "--host", "127.0.0.1",
                 "--port", str(port)], cwd=model_dir, env=env,
                stdout=open(os.path.join(work, f"infinity-{engine}.log"), "w"), stderr=subprocess.STDOUT))
            _wait(port, "reranker", procs[-1], f"infinity ({engine})")
            servers[f"infinity-{engine}"] = (port, "reranker")

        # the same scores from every server first
        query, documents = requests[0]
        reference = np.asarray(_rerank(http.client.HTTPConnection("127.0.0.1", servers["project"][0], timeout=300),
                                       "reranker", query, documents))
        agreement = {name: float(np.abs(np.asarray(_rerank(http.client.HTTPConnection("127.0.0.1", p, timeout=300),
                                                                   m, query, documents)) - reference).max())
                     for name, (p, m) in servers.items() if name != "project"}
        print(f"largest score difference to the project: {agreement}", flush=True)

        rounds = []
        for number in range(args.rounds):
            order = list(servers) if number % 2 == 0 else list(reversed(servers))
            rounds.append({name: _load(*servers[name], requests, args.clients, args.requests) for name in order})
            print(f"round {number + 1}: " + "; ".join(f"{n} {r['pairs_per_s']:.0f} pairs/s (p50 {_ms(r)}, "
                                                       f"reconnects {r['reconnects']})" for n, r in rounds[-1].items()),
                  flush=True)
        single = {name: _load(*servers[name], requests, 1, 5) for name in servers}
        print("one client: " + "; ".join(f"{n} p50 {_ms(r)}" for n, r in single.items()), flush=True)
    finally:
        stop_all()

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
        summary[f"project/{name}"] = {"median": float(np.median(ratios)), "min": min(ratios), "max": max(ratios)}
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
