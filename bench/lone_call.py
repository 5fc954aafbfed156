"""One client, one call at a time: a lone call's latency and the server's CPU per call, thread by thread.

    python -m bench.lone_call EXPORT_DIR [--serve-from CHECKOUT ...] [--with-flags "FLAGS" ...] [--rounds 5]
                              [--calls 2000] [--protocol grpc|http] [--flags "FLAGS"] [--rows 1 --length 128]
                              [--json FILE]

Each target (a checkout given with `--serve-from`, default this one; and this checkout with the server flags of
each `--with-flags`; `--flags` go to every target) serves EXPORT_DIR on 127.0.0.1, started anew in every round, the
targets taking turns (the order reversed every other round, harness.turns). One client sends KServe v2 ModelInfer
(`--rows` x `--length` token ids, raw INT64, the pooled embeddings asked for: compare.sh's lone call) over gRPC on
its own channel, or
the same as v2 REST JSON over one keep-alive HTTP connection, back to back: 50 calls untimed, then `--calls`
timed. Reported per target: p50 and p90 over the rounds (median [min-max]), and the server's CPU per call (every
thread of every process of it, front ends included), in all and by thread name (/proc: which hand-offs a call
costs). Where one change's effect on a lone call is a few percent, server starts alone differ by more: take the
pairs of one round, over several rounds (docs/performance.md "The express run's answer, sent where it was made",
"Behind front ends").
"""

from __future__ import annotations

import argparse
import collections
import http.client
import json
import statistics
import time
from pathlib import Path

import numpy as np
import psutil

from bench.harness import REPO, percentiles, running_server, thread_cpu, thread_name, turns

WARMUP_CALLS = 50
MODEL_INFER = "/inference.GRPCInferenceService/ModelInfer"


def server_threads(pid: int) -> dict[tuple[int, int], float]:
    """{(pid, thread id): CPU seconds} of every thread of the server and its children (front ends)."""
    pids = [pid]
    try:
        pids += [child.pid for child in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        pass
    return {(p, tid): seconds for p in pids for tid, seconds in thread_cpu(p).items()}


def grpc_caller(target: str, model: str, ids: np.ndarray):
    import grpc

    from serve.protocols.kserve_v2 import M

    request = M["ModelInferRequest"](model_name=model)
    request.inputs.add(name="input_ids", datatype="INT64", shape=list(ids.shape))
    request.outputs.add(name="embeddings")
    request.raw_input_contents.append(ids.astype("<i8").tobytes())
    payload = request.SerializeToString()
    channel = grpc.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)])
    infer = channel.unary_unary(MODEL_INFER)

    def call() -> None:
        infer(payload, timeout=60.0)

    return call, channel.close


def http_caller(port: int, model: str, ids: np.ndarray):
    import orjson

    body = orjson.dumps({"inputs": [{"name": "input_ids", "shape": list(ids.shape), "datatype": "INT64",
                                     "data": ids.ravel().tolist()}], "outputs": [{"name": "embeddings"}]})
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60.0)
    path = f"/v2/models/{model}/infer"

    def call() -> None:
        connection.request("POST", path, body, {"content-type": "application/json"})
        answer = connection.getresponse()
        answer.read()
        if answer.status != 200:
            raise RuntimeError(f"HTTP {answer.status}")

    return call, connection.close


def measure(export: Path, checkout: Path, flags: list[str], protocol: str, calls: int, ids: np.ndarray) -> dict:
    model = json.loads((export / "metadata.json").read_text())["name"]
    extra = ["--http-port", "0"] if protocol == "http" else []
    with running_server(export, [*extra, *flags], serve_from=checkout) as server:
        call, close = grpc_caller(server.target, model, ids) if protocol == "grpc" else \
            http_caller(server.http_port, model, ids)
        try:
            for _ in range(WARMUP_CALLS):
                call()
            before = server_threads(server.pid)
            latencies = []
            for _ in range(calls):
                started = time.perf_counter()
                call()
                latencies.append(1e3 * (time.perf_counter() - started))
            after = server_threads(server.pid)
        finally:
            close()
        by_name: dict[str, float] = collections.Counter()
        for key, seconds in after.items():
            by_name[thread_name(*key) or "(gone)"] += seconds - before.get(key, 0.0)
    per_call = {name: 1e6 * seconds / calls for name, seconds in by_name.items()}
    return {**percentiles(latencies, (50, 90)), "cpu_us_per_call": sum(per_call.values()),
            "threads_us_per_call": dict(sorted(per_call.items(), key=lambda item: -item[1]))}


def table(targets: list[str], rounds: list[dict]) -> str:
    """Median [min-max] over the rounds of p50, p90 and CPU per call, then the median CPU per call of each thread
    name that took 10 µs or more per call somewhere."""
    def cell(values: list[float], digits: int) -> str:
        return f"{statistics.median(values):.{digits}f} [{min(values):.{digits}f}-{max(values):.{digits}f}]"

    lines = [f"{'':26s}" + "".join(f"{t[-30:]:>32s}" for t in targets)]
    for key, label, digits in (("p50_ms", "p50 ms", 3), ("p90_ms", "p90 ms", 3),
                               ("cpu_us_per_call", "server CPU µs per call", 0)):
        lines.append(f"{label:26s}" + "".join(f"{cell([r[t][key] for r in rounds], digits):>32s}" for t in targets))
    names = sorted({name for r in rounds for t in targets for name, us in r[t]["threads_us_per_call"].items()
                    if us >= 10}, key=lambda name: -max(r[t]["threads_us_per_call"].get(name, 0.0)
                                                         for r in rounds for t in targets))
    for name in names:
        lines.append(f"  {name[:24]:24s}" + "".join(
            f"{statistics.median(r[t]['threads_us_per_call'].get(name, 0.0) for r in rounds):>32.0f}"
            for t in targets))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.lone_call", description=__doc__.split("\n")[0])
    parser.add_argument("export", type=Path, help="an export directory (token ids are sent)")
    parser.add_argument("--serve-from", action="append", default=[],
                        help="a checkout whose server code runs (repeatable; default: this one)")
    parser.add_argument("--with-flags", action="append", default=[],
                        help="a target more: this checkout's server with these flags (repeatable), e.g. "
                             "'--express-run-ms 0' or '--front-ends 1'")
    parser.add_argument("--flags", default="", help="more server flags for every target, e.g. '--front-ends 1'")
    parser.add_argument("--protocol", choices=("grpc", "http"), default="grpc")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--json", default="")
    args = parser.parse_args(argv)
    common = args.flags.split()
    targets = {Path(c).resolve().name: (Path(c).resolve(), common) for c in args.serve_from or [str(REPO)]}
    targets.update({f"{REPO.name} {flags}": (REPO, [*common, *flags.split()]) for flags in args.with_flags})
    labels = list(targets)
    vocab = json.loads((args.export / "metadata.json").read_text())["config"]["vocab_size"]
    ids = np.random.default_rng(0).integers(1, vocab, (args.rows, args.length))
    rounds = []
    for index in range(args.rounds):
        result = {}
        for label in turns(labels, index):
            result[label] = measure(args.export, *targets[label], args.protocol, args.calls, ids)
            print(f"round {index + 1} {label}: p50 {result[label]['p50_ms']:.3f} ms, "
                  f"{result[label]['cpu_us_per_call']:.0f} µs of server CPU per call", flush=True)
        rounds.append(result)
    print(table(labels, rounds))
    if args.json:
        Path(args.json).write_text(json.dumps({"targets": {t: [str(c), f] for t, (c, f) in targets.items()},
                                               "protocol": args.protocol, "rows": args.rows, "length": args.length,
                                               "calls": args.calls, "rounds": rounds}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
