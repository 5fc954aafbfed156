"""An LLM reranker (Qwen3-Reranker's recipe: P("yes") at the last token under the model card's prompt): one query
against 32 documents, the project's server against the model card's transformers recipe in process (issue 43).

    python -m bench.llm_rerank_bench [--shape tiny|mid] [--vocab N] [--requests 15] [--instances 0]

The checkpoints: random Qwen3ForCausalLM (tests/hf_references.py save_qwen3_reranker: its byte-level BPE
tokenizer, max length 1024), `tiny` the tests' (2 layers x 64) and `mid` 4 layers x 512 (8 heads, 4 key/value
heads, head_dim 64, intermediate 1536); `--vocab` sets the model's vocabulary (default the tokenizer's ~400 ids;
151669 is Qwen3's, whose lm_head the recipe projects at every position, tied to the embeddings as in
Qwen3-Reranker-0.6B). The project: `python -m export --from-pretrained --reranker-template qwen3` (graphs
fp32, optimized) and `python -m serve --graph optimized`, called over HTTP (TEI's /rerank, one keep-alive
connection); the recipe: tests/hf_references.py CardRecipe (AutoModelForCausalLM, its default attention, fp32,
left padding, format_instruction/process_inputs/compute_logits as the card has them) at torch.set_num_threads(--threads).

Each request: one query of 5-12 words and 32 documents of 50-300 words (seeded). After one warm-up each, every
request is timed on both sides back to back (which side goes first alternates), so a neighbour's load on a
shared host falls on both alike; reported: each side's median latency, the median and range of the per-request
ratio recipe / server, the ratio of CPU seconds spent (the server process's against this process's during the
recipe), and the largest score difference on one request.
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
import time

import numpy as np

from bench.harness import LOOPBACK, rerank_requests, running_server, spread, tei_rerank, timed_side_by_side

SHAPES = {
    "tiny": {},
    "mid": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
                num_key_value_heads=4, head_dim=64),
}
MAX_LENGTH = 1024


def _requests(count: int, seed: int = 7) -> list[tuple[str, list[str]]]:
    from tests.hf_references import WORDS

    return rerank_requests(count, WORDS, (50, 300), seed)


def _rerank(conn: http.client.HTTPConnection, query: str, documents: list[str]) -> np.ndarray:
    return tei_rerank(conn, {"model": "reranker", "query": query, "texts": documents}, len(documents))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=tuple(SHAPES), default="tiny")
    parser.add_argument("--vocab", type=int, default=0, help="the model's vocabulary (0: the tokenizer's)")
    parser.add_argument("--requests", type=int, default=15, help="timed requests (each on both sides)")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--instances", type=int, default=0,
                        help="the server's --instances (run slots; 0: its default, one). With one slot per CPU, "
                             "a lone request's runs go several at once (docs/serving.md \"Instances\")")
    parser.add_argument("--json", default="")
    args = parser.parse_args(argv)

    import torch

    from tests.hf_references import CardRecipe, save_qwen3_reranker

    torch.set_num_threads(args.threads)
    work = tempfile.mkdtemp(prefix="llm-rerank-bench-")
    checkpoint = os.path.join(work, "checkpoint")
    vocab = {"vocab_size": args.vocab, "tie_word_embeddings": True} if args.vocab else {}
    save_qwen3_reranker(checkpoint, max_length=MAX_LENGTH, **SHAPES[args.shape], **vocab)
    started = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "export", "--from-pretrained", checkpoint, "--out-dir", work,
                          "--name", "reranker", "--graphs", "fp32,optimized", "--reranker-template", "qwen3",
                          "--quiet"], capture_output=True, text=True)
    if out.returncode:
        sys.exit(f"export failed: {out.stderr[-1500:]}")
    print(f"export: {time.perf_counter() - started:.0f} s", flush=True)
    recipe = CardRecipe(checkpoint, max_length=MAX_LENGTH)
    requests = _requests(16)
    flags = ["--graph", "optimized", "--http-port", "0"]
    flags += ["--instances", str(args.instances)] if args.instances else []
    with running_server(os.path.join(work, "reranker"), flags, start_timeout_s=600.0) as server:
        conn = http.client.HTTPConnection(LOOPBACK, server.http_port, timeout=600)
        query, documents = requests[0]
        difference = float(np.abs(_rerank(conn, query, documents) - recipe.scores(query, documents)).max())
        tokens = [len(recipe.process_inputs([recipe.format_instruction(None, query, d)])["input_ids"][0])
                  for d in documents]
        print(f"one request: 32 rows of {min(tokens)}-{max(tokens)} tokens; largest score difference "
              f"{difference:.2e}", flush=True)
        times, cpu = timed_side_by_side(
            {"server": lambda q, d: _rerank(conn, q, d), "recipe": recipe.scores}, [requests[1]],
            [requests[(2 + i) % len(requests)] for i in range(args.requests)],
            cpu_pids={"server": server.process.pid, "recipe": None},
            after=lambda i, times: print(f"request {i + 1}: server {times['server'][-1]:.0f} ms, recipe "
                                         f"{times['recipe'][-1]:.0f} ms", flush=True))
    ratios = [r / s for r, s in zip(times["recipe"], times["server"])]
    summary = {"shape": args.shape, "vocab": args.vocab or recipe.model.config.vocab_size, "threads": args.threads,
               "instances": args.instances,
               "server_ms": statistics.median(times["server"]), "recipe_ms": statistics.median(times["recipe"]),
               "speedup": spread(ratios), "cpu_speedup": cpu["recipe"] / cpu["server"],
               "largest_score_difference": difference}
    print(json.dumps(summary), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"summary": summary, "times_ms": times}, f, indent=2)
    shutil.rmtree(work, ignore_errors=True)  # the checkpoint and its export


if __name__ == "__main__":
    main()
