"""The server as users call it over HTTP: pooled keep-alive clients, idle between calls.

    python -m bench.pooled_clients EXPORT_DIR [--serve-from CHECKOUT ...] [--with-flags "FLAGS" ...] [--rounds 3]
                                   [--calls 200] [--json FILE]

Benchmarks that send back to back on raw sockets (compare.sh, infinity_http) never show what a user's client
meets: a pooled keep-alive connection that sat idle between calls, a body sent whole by a client library,
the library's own cost. Here the clients are the ones users run: the `openai` package
(`client.embeddings.create`, its default base64 encoding, retries off), a `requests.Session` and an
`httpx.Client`, each holding one pooled keep-alive connection to OpenAI's POST /v1/embeddings on 127.0.0.1.

  idle        one client of each kind in turn, `--calls` calls of one short sentence, an idle gap drawn
              uniformly from 20-100 ms (seeded) before each: p50 / p99 of the call as the client sees it
  concurrent  8 threads, a client each (the same three kinds, round robin), back to back for `--seconds`
              (harness.closed_loop): requests/s, p50 / p99

Each target (a checkout given with `--serve-from`, default this one; and this checkout with the server flags of
each `--with-flags`) is measured in every round, in alternating order, on one export (a text export, e.g. `python -m export --minilm`); the table gives each figure's median over the
rounds with its spread, and the ratio of each target to the first. Traffic goes to 127.0.0.1 only and is
bounded in time; nothing here asserts a timing.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

from bench.harness import REPO, closed_loop, percentiles, running_server, sentence

GAP_S = (0.020, 0.100)  # idle before each call of the idle phase
CONCURRENT_CLIENTS = 8
KINDS = ("openai", "requests", "httpx")


def client_call(kind: str, port: int, model: str, text: str):
    """(call, close) of one pooled client of `kind`: call() sends one embeddings request and checks the answer."""
    base = f"http://127.0.0.1:{port}/v1"
    body = {"model": model, "input": [text]}
    if kind == "openai":
        import openai

        client = openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=30.0)

        def call() -> None:
            answer = client.embeddings.create(model=model, input=[text])
            assert len(answer.data) == 1 and len(answer.data[0].embedding) > 0
        return call, client.close
    if kind == "requests":
        import requests

        session = requests.Session()

        def call() -> None:
            answer = session.post(f"{base}/embeddings", json=body, timeout=30.0)
            answer.raise_for_status()
            assert len(answer.json()["data"]) == 1
        return call, session.close
    import httpx

    client = httpx.Client(timeout=30.0)

    def call() -> None:
        answer = client.post(f"{base}/embeddings", json=body)
        answer.raise_for_status()
        assert len(answer.json()["data"]) == 1
    return call, client.close


def idle_phase(port: int, model: str, calls: int, seed: int) -> dict:
    """Per kind: `calls` calls, each after an idle gap, on one client; p50 / p99 in ms."""
    rng, out = random.Random(seed), {}
    for kind in KINDS:
        call, close = client_call(kind, port, model, sentence(10, rng))
        try:
            call()  # connects: the pool's connection is then kept alive across the gaps
            latencies = []
            for _ in range(calls):
                time.sleep(rng.uniform(*GAP_S))  # the idle gap a user's client leaves: the load's shape, by design
                started = time.perf_counter()
                call()
                latencies.append(1e3 * (time.perf_counter() - started))
        finally:
            close()
        out[kind] = percentiles(latencies, (50, 99))
    return out


def concurrent_phase(port: int, model: str, seconds: float, seed: int) -> dict:
    rng = random.Random(seed)
    clients = [client_call(KINDS[i % len(KINDS)], port, model, sentence(10, rng)) for i in range(CONCURRENT_CLIENTS)]
    try:
        load = closed_loop([call for call, _ in clients], seconds=seconds, warmup_s=1.0)
    finally:
        for _, close in clients:
            close()
    return {"requests_per_s": len(load.latencies_ms) / load.seconds, "errors": load.errors,
            **percentiles(load.latencies_ms, (50, 99))}


def measure(export: Path, checkout: Path, flags: list[str], calls: int, seconds: float, seed: int) -> dict:
    model = json.loads((export / "metadata.json").read_text())["name"]
    with running_server(export, ["--http-port", "0", *flags], serve_from=checkout) as server:
        return {"idle": idle_phase(server.http_port, model, calls, seed),
                "concurrent": concurrent_phase(server.http_port, model, seconds, seed)}


def figures(result: dict) -> dict[str, float]:
    """The flat figures of one measurement: idle <kind> p50/p99, concurrent req/s, p50, p99."""
    flat = {f"idle {kind} {point}": value for kind, row in result["idle"].items()
            for point, value in row.items() if point != "n"}
    flat.update({f"concurrent {key}": value for key, value in result["concurrent"].items() if key != "n"})
    return flat


def table(checkouts: list[str], rounds: list[dict]) -> str:
    """Median over the rounds [min-max] per figure and target, and each target's median over the first's."""
    per = {c: [figures(r[c]) for r in rounds] for c in checkouts}
    keys = list(per[checkouts[0]][0])
    lines = [f"{'figure':28s}" + "".join(f"{c[-27:]:>28s}" for c in checkouts)
             + ("   ratio to first" if len(checkouts) > 1 else "")]
    for key in keys:
        medians, cells = [], []
        for c in checkouts:
            values = [f[key] for f in per[c]]
            medians.append(statistics.median(values))
            cells.append(f"{medians[-1]:10.2f} [{min(values):.2f}-{max(values):.2f}]")
        ratios = "  ".join(f"{m / medians[0]:.2f}x" for m in medians[1:]) if medians[0] else ""
        lines.append(f"{key:28s}" + "".join(f"{cell:>28s}" for cell in cells) + f"   {ratios}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.pooled_clients", description=__doc__.split("\n")[0])
    parser.add_argument("export", type=Path, help="an export directory with a tokenizer (texts)")
    parser.add_argument("--serve-from", action="append", default=[],
                        help="a checkout whose server code runs (repeatable; default: this one); the first is the "
                             "baseline of the ratios")
    parser.add_argument("--with-flags", action="append", default=[],
                        help="a target more: this checkout's server with these flags (repeatable), e.g. "
                             "'--intra-op-spin never'")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=200, help="calls per client kind in the idle phase")
    parser.add_argument("--seconds", type=float, default=10.0, help="the concurrent phase's window")
    parser.add_argument("--json", default="")
    args = parser.parse_args(argv)
    targets = {Path(c).resolve().name: (Path(c).resolve(), []) for c in args.serve_from or [str(REPO)]}
    targets.update({f"{REPO.name} {flags}": (REPO, flags.split()) for flags in args.with_flags})
    checkouts = list(targets)  # labels, in the order given
    rounds = []
    for index in range(args.rounds):
        order = checkouts if index % 2 == 0 else checkouts[::-1]
        rounds.append({c: measure(args.export, targets[c][0], targets[c][1], args.calls, args.seconds, seed=index)
                       for c in order})
        print(f"round {index + 1}/{args.rounds} done", flush=True)
    print(table(checkouts, rounds))
    if args.json:
        Path(args.json).write_text(json.dumps({"targets": {c: [str(t[0]), t[1]] for c, t in targets.items()},
                                               "rounds": rounds, "gap_s": GAP_S,
                                               "concurrent_clients": CONCURRENT_CLIENTS}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
