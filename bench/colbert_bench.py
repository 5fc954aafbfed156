"""MaxSim rerank of one query against 32 documents: the project's server (TEI /rerank on a multivector export)
against PyLate in process (ColBERT.encode of the query and of the documents, then rank.rerank: colbert_scores),
issue 43.

    python -m bench.colbert_bench [--requests 10] [--layers 12] [--graph optimized|int8|fp32] [--threads 2]
                                  [--instances 0]

The model: a PyLate ColBERT shaped like answerai-colbert-small-v1 (BERT, hidden 384, 12 heads, `--layers` layers,
Dense 384 -> 96 without bias, query_length 32, document_length 180), random weights, the packaged MiniLM's
tokenizer, made and saved by PyLate 1.6.0 (tests/pylate_reference.py: its sentence-transformers 6 bridge). The
project: `python -m export --from-pretrained` (fp32, optimized) and `python -m serve --graph`. Requests: a query of
5-12 words and 32 documents of 50-170 words (seeded; a word is a token), one client, one request at a time after
two warm-up requests, each request timed on both sides back to back (which side goes first alternates, so the
machine's drift falls on both); PyLate with torch at `--threads` threads, the server's ONNX Runtime at the same;
the server allows 33 sequences per request (32 documents and the query). Reported: p50 / mean latency per request
on each side, the ratio of the p50s and the per-request ratios (median [min, max]), and the largest score
difference.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from bench.harness import (LOOPBACK, WORDS, rerank_requests, running_server, spread, tei_rerank,
                           timed_side_by_side)

VECTOR_DIM = 96


def _model(root: Path, layers: int):
    from transformers import BertConfig, BertModel

    from model.hf_pretrained import minilm_path
    from tests.pylate_reference import colbert_over

    base = root / "bert"
    BertModel(BertConfig(vocab_size=30522, hidden_size=384, num_hidden_layers=layers, num_attention_heads=12,
                         intermediate_size=1536, max_position_embeddings=512)).eval().save_pretrained(base)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        if (minilm_path() / name).is_file():
            shutil.copy(minilm_path() / name, base / name)
    return colbert_over(base, root, vector_dim=VECTOR_DIM, query_length=32, document_length=180)


def _requests(count: int) -> list[tuple[str, list[str]]]:
    return rerank_requests(count, WORDS, (50, 170))


def _rerank(conn: http.client.HTTPConnection, query: str, documents: list[str]) -> np.ndarray:
    return tei_rerank(conn, {"query": query, "texts": documents, "truncate": True}, len(documents))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=10)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--graph", default="optimized")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--instances", type=int, default=0,
                        help="the server's --instances (run slots; 0: its default, one). With as many slots as "
                             "--threads, each slot runs on one CPU and a lone request's runs go at once")
    args = parser.parse_args(argv)

    import torch
    from pylate import rank, scores

    torch.set_num_threads(args.threads)
    work = Path(tempfile.mkdtemp(prefix="colbert-bench-"))
    model, directory = _model(work, args.layers)
    out = subprocess.run([sys.executable, "-m", "export", "--from-pretrained", str(directory), "--out-dir", str(work),
                          "--name", "colbert", "--graphs", ",".join(dict.fromkeys(("fp32", "optimized", args.graph))),
                          "--quiet"], capture_output=True, text=True)
    if out.returncode:
        sys.exit(f"export failed: {out.stderr[-1000:]}")
    requests = _requests(args.requests + 2)

    def pylate(query, documents):  # PyLate's reranking: encode both, rank.rerank (colbert_scores)
        q = model.encode([query], is_query=True)
        d = model.encode(documents, is_query=False, batch_size=32)
        return rank.rerank(documents_ids=[list(range(len(documents)))], queries_embeddings=q,
                           documents_embeddings=[d])[0]

    # 32 documents and the query are 33 rows of one request, over the default max_sequences_per_request
    flags = ["--graph", args.graph, "--http-port", "0", "--max-sequences-per-request", "33", "--max-batch-size", "33"]
    # the server's CPUs: --threads in all (with --instances, each slot's share and a wide session on all of them)
    flags += (["--instances", str(args.instances)] if args.instances else ["--intra-op-threads", str(args.threads)])
    with running_server(work / "colbert", flags) as server:
        conn = http.client.HTTPConnection(LOOPBACK, server.http_port, timeout=600)
        query, documents = requests[0]
        served = _rerank(conn, query, documents)
        q = model.encode([query], is_query=True)
        want = np.asarray([float(scores.colbert_scores(q, [d])[0, 0])
                           for d in model.encode(documents, is_query=False)])
        times, _ = timed_side_by_side({"server": lambda query, documents: _rerank(conn, query, documents),
                                       "pylate": pylate}, requests[:2], requests[2:])
    server_ms, pylate_ms = times["server"], times["pylate"]
    summary = {"graph": args.graph, "layers": args.layers, "threads": args.threads, "instances": args.instances,
               "requests": args.requests,
               "server_p50_ms": statistics.median(server_ms), "server_mean_ms": statistics.fmean(server_ms),
               "pylate_p50_ms": statistics.median(pylate_ms), "pylate_mean_ms": statistics.fmean(pylate_ms),
               "largest_score_difference": float(np.abs(served - want).max()),
               # the documents in the same order as PyLate's scores put them (an int8 graph moves scores a little)
               "same_ranking": bool((np.argsort(-served, kind="stable") == np.argsort(-want, kind="stable")).all()),
               "cpus": os.cpu_count()}
    summary["speedup_p50"] = summary["pylate_p50_ms"] / summary["server_p50_ms"]
    summary["speedup_per_request"] = spread([p / q for p, q in zip(pylate_ms, server_ms)])
    print(json.dumps(summary, indent=1))
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
