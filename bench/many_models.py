"""Many models on one host (issue 27): `python -m bench.many_models [--rounds 3] [--seconds 8] [--quick]`.

Two models, each with its own load, served two ways:
  two_processes  one `python -m serve --export-dir E` per export (default flags otherwise): what users do today
  one_server     one `python -m serve --model-repository DIR`, DIR holding both exports as folders named by
                 model; KServe `model_name` (the folder's name) routes
The models: the default encoder (`input_ids` INT64 [1, 32], random ids) and MiniLM (`texts` BYTES [1], a
short sentence); output `embeddings`. One client for every target: KServe v2 gRPC through tritonclient.grpc,
each client thread on its own InferenceServerClient, requests back to back.

Per target and round (its servers started fresh, the targets taking turns first):
  alone    32 clients on one model, the other model idle; then the same for the other model
  both     16 clients on each model at once
  share    rate_both_A / rate_alone_A + rate_both_B / rate_alone_B: 1.0 when sharing the host costs nothing
  latency  one client sending single requests sequentially to the quiet model, idle and then while 32 clients
           flood the other model; the ratio flooded p50 / idle p50, both ways round
Ratios are taken within a round; the summary is their median over rounds. The bench's own client threads run
on the same cores as the servers (as in bench/front_end.py), the same for every target. Other jobs on the
host are kept out (HostGate): each phase waits for a quiet host and runs again, a bounded number of times,
when other processes took more than --max-other-cpu cores meanwhile; every phase records that figure.
Traffic goes to 127.0.0.1 only; every phase is bounded by a duration.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.harness import (REPO, ServerHandle, closed_loop, cpu_seconds, host_busy_seconds, latency_summary,
                           metric_sum, running_server, scrape_metrics, token_ids)

TARGETS = ("two_processes", "one_server")
FLOOD_CLIENTS = 32  # per model alone, and the flood in the latency phases; half of it per model in "both"
IDS_LENGTH = 32
SENTENCES = (  # short texts for MiniLM, one per client (rotating)
    "A man is playing a guitar.",
    "The cat sat on the mat.",
    "How do I reset my password?",
    "Rain is expected later this afternoon.",
    "She bought fresh bread at the market.",
    "The train to Berlin leaves at noon.",
    "Embeddings map sentences to vectors.",
    "Our office is closed on public holidays.",
)
START_TIMEOUT_S = 180.0


@dataclass(frozen=True)
class Workload:
    """One model and the requests its clients send."""

    name: str  # KServe model_name: the export's name and its folder's name in the repository
    export_dir: Path
    input: str  # "input_ids" (INT64 [1, IDS_LENGTH]) or "texts" (BYTES [1])
    vocab_size: int = 0

    def request(self, seed: int):
        """tritonclient InferInput list for client number `seed`."""
        import tritonclient.grpc as grpcclient

        if self.input == "texts":
            tensor = grpcclient.InferInput("texts", [1], "BYTES")
            tensor.set_data_from_numpy(np.array([SENTENCES[seed % len(SENTENCES)].encode()], dtype=object))
        else:
            tensor = grpcclient.InferInput("input_ids", [1, IDS_LENGTH], "INT64")
            tensor.set_data_from_numpy(token_ids(self.vocab_size, IDS_LENGTH, seed)[None])
        return [tensor]


def workload(export_dir: str) -> Workload:
    """The Workload of an export: texts where it has a tokenizer, token ids otherwise."""
    from model.export_format import read_metadata

    meta = read_metadata(Path(export_dir))
    has_texts = (Path(export_dir) / "tokenizer.json").exists()
    return Workload(meta.name, Path(export_dir).resolve(), "texts" if has_texts else "input_ids",
                    meta.config.vocab_size)


@dataclass(frozen=True)
class Target:
    """Where each model is served: {model name: host:port}, and the server processes behind them."""

    name: str
    urls: dict[str, str]
    servers: tuple[ServerHandle, ...]


# -- starting the servers ----------------------------------------------------------------------------------

def models_ready(models: list[str]):
    """A running_server readiness probe: KServe ModelReady says yes for every one of `models`."""
    def probe(server: ServerHandle) -> bool:
        import tritonclient.grpc as grpcclient

        client = grpcclient.InferenceServerClient(url=server.target)
        try:
            return all(client.is_model_ready(m) for m in models)
        finally:
            client.close()

    return probe


@contextmanager
def serve_process(source_flags: list[str], models: list[str], flags: list[str]):
    """One `python -m serve` on 127.0.0.1 (OS-chosen ports, HTTP off, metrics on), ready for `models`."""
    with running_server(None, ["--metrics-port", "0", "--metrics-host", "127.0.0.1", *flags], source=source_flags,
                        ready=models_ready(models), start_timeout_s=START_TIMEOUT_S) as server:
        yield server.target, server


@contextmanager
def two_processes(workloads: list[Workload], flags: list[str]):
    """One server process per export, started one after the other (their warm-ups do not overlap)."""
    with ExitStack() as stack:
        urls, servers = {}, []
        for w in workloads:
            url, server = stack.enter_context(serve_process(["--export-dir", str(w.export_dir)], [w.name], flags))
            urls[w.name] = url
            servers.append(server)
        yield Target("two_processes", urls, tuple(servers))


def repository(workloads: list[Workload], into: Path) -> Path:
    """A model repository in `into`: one symlink per model, named by the model, to its export."""
    into.mkdir(parents=True, exist_ok=True)
    for w in workloads:
        (into / w.name).symlink_to(w.export_dir, target_is_directory=True)
    return into


@contextmanager
def one_server(workloads: list[Workload], flags: list[str]):
    """One server process holding every export, from a model repository of symlinks."""
    repo = repository(workloads, Path(tempfile.mkdtemp(prefix="bench-models-repo-")) / "models")
    names = [w.name for w in workloads]
    with serve_process(["--model-repository", str(repo)], names, flags) as (url, server):
        yield Target("one_server", {name: url for name in names}, (server,))


def one_server_available() -> bool:
    """Whether this checkout's server takes --model-repository (serve/config.py ServerConfig)."""
    import dataclasses

    from serve.config import ServerConfig

    return any(f.name == "model_repository" for f in dataclasses.fields(ServerConfig))


# -- load ----------------------------------------------------------------------------------------------------

COUNTERS = ("encoder_session_run_cpu_seconds_total", "encoder_model_rows_total", "encoder_sequences_total",
            "encoder_inference_seconds_sum", "encoder_inference_seconds_count")  # kept per phase, per label set


def run_load(target: Target, workloads: dict[str, Workload], clients: dict[str, int], *, seconds: float,
             warmup_s: float) -> dict:
    """clients[model] threads per model, each on its own channel sending single requests back to back, for
    `seconds` after `warmup_s`. Per model: req/s, latency, rows per session.run, errors; per server: CPU
    cores used and the part inside session.run (encoder_session_run_cpu_seconds_total, the batcher threads'
    own CPU); the bench process's CPU (the clients)."""
    import tritonclient.grpc as grpcclient

    outputs = [grpcclient.InferRequestedOutput("embeddings")]
    calls, models_of, closers = [], [], []
    for model, count in clients.items():
        for seed in range(count):
            client = grpcclient.InferenceServerClient(url=target.urls[model])
            inputs = workloads[model].request(seed)

            def call(client=client, inputs=inputs, model=model) -> tuple[str, int]:
                response = client.infer(model, inputs, outputs=outputs, client_timeout=60.0).get_response()
                return model, response.parameters["batch_size"].int64_param

            calls.append(call)
            models_of.append(model)
            closers.append(client.close)

    def snapshot():
        return ([(cpu_seconds(s.pid), scrape_metrics(s.metrics_port)) for s in target.servers], cpu_seconds(),
                host_busy_seconds())

    try:  # a failed request is counted, and its client pauses 10 ms so that a dead server is not spun on
        load = closed_loop(calls, seconds=seconds, warmup_s=warmup_s, snapshot=snapshot, error_pause_s=0.01,
                           grace_s=90.0)
    finally:
        for close in closers:
            close()
    (servers0, me0, host0), (servers1, me1, host1) = load.snapshots
    wall = load.seconds
    models = {}
    for model in clients:
        latencies = [ms for ms, (m, _) in zip(load.latencies_ms, load.results) if m == model]
        rows = [r for m, r in load.results if m == model]
        done = len(latencies)
        models[model] = {"clients": clients[model], "requests": done,
                         "errors": sum(e for e, m in zip(load.client_errors, models_of) if m == model),
                         "rate_rps": done / wall, **(latency_summary(latencies) if done else {}),
                         "rows_per_run": len(rows) / sum(1.0 / b for b in rows) if rows and min(rows) > 0 else None}
    servers = []
    for server, (cpu0, scrape0), (cpu1, scrape1) in zip(target.servers, servers0, servers1):
        in_run = (metric_sum(scrape1, "encoder_session_run_cpu_seconds_total")
                  - metric_sum(scrape0, "encoder_session_run_cpu_seconds_total"))
        counters = {k: v - scrape0.get(k, 0.0) for k, v in scrape1.items() if k.split("{")[0] in COUNTERS}
        servers.append({"pid": server.pid, "cpu_cores": (cpu1 - cpu0) / wall,
                        "session_run_batcher_cpu_cores": in_run / wall, "counters": counters})
    ours = sum(s["cpu_cores"] for s in servers) + (me1 - me0) / wall
    # what else ran on the host meanwhile (another job's CPU makes the phase noisy)
    return {"seconds": wall, "models": models, "servers": servers, "client_cpu_cores": (me1 - me0) / wall,
            "other_cpu_cores": max(0.0, (host1 - host0) / wall - ours)}


# -- one round ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class HostGate:
    """Keeps other jobs' CPU out of the figures: before a phase, wait (at most `wait_s`) until the host's
    busy CPU over a second is under `max_other_cores`; a phase during which other processes used more
    than that runs again (at most `retries` times; the quietest attempt is kept). max_other_cores 0: off."""

    max_other_cores: float = 0.25
    wait_s: float = 120.0
    retries: int = 2

    def wait(self, say) -> float:
        """The host's busy cores over the last second once quiet (or when the wait ran out)."""
        if not self.max_other_cores:
            return 0.0
        deadline = time.monotonic() + self.wait_s
        while True:
            before = host_busy_seconds()
            time.sleep(1.0)  # the host's busy CPU over one second
            busy = host_busy_seconds() - before
            if busy < self.max_other_cores or time.monotonic() > deadline:
                if busy >= self.max_other_cores:
                    say(f"  host still busy ({busy:.2f} cores) after {self.wait_s:.0f} s; measuring anyway")
                return busy


def measure(target: Target, workloads: dict[str, Workload], *, seconds: float, warmup_s: float,
            gate: HostGate = HostGate(0.0), say=print) -> dict:
    """alone (each model), both, and the latency phases on one target; the ratios of this round."""
    a, b = list(workloads)
    phases = {}

    def phase(label: str, clients: dict[str, int]) -> dict:
        attempts = []
        for attempt in range(1 + (gate.retries if gate.max_other_cores else 0)):
            gate.wait(say)
            result = run_load(target, workloads, clients, seconds=seconds, warmup_s=warmup_s)
            attempts.append(result)
            cells = "  ".join(f"{m[:7]:7s} {r['rate_rps']:7.1f} req/s p50 {r.get('p50_ms', float('nan')):6.2f} ms"
                              + (f" ({r['errors']} errors)" if r["errors"] else "")
                              for m, r in result["models"].items())
            cpu = " + ".join(f"{s['cpu_cores']:.2f}" for s in result["servers"])
            clients_cpu, other = result["client_cpu_cores"], result["other_cpu_cores"]
            say(f"  {target.name:13s} {label:36s} {cells}  server CPU {cpu} cores, clients {clients_cpu:.2f}, "
                f"other {other:.2f}" + (f" (attempt {attempt + 1})" if attempt else ""))
            if not gate.max_other_cores or other < gate.max_other_cores:
                break
        best = min(attempts, key=lambda r: r["other_cpu_cores"])
        phases[label] = {**best, "attempts": len(attempts)}
        return best

    alone = {m: phase(f"alone {m}", {m: FLOOD_CLIENTS})["models"][m]["rate_rps"] for m in (a, b)}
    both = phase("both", {a: FLOOD_CLIENTS // 2, b: FLOOD_CLIENTS // 2})["models"]
    idle, flooded = {}, {}
    for quiet, loud in ((a, b), (b, a)):
        idle[quiet] = phase(f"idle {quiet}", {quiet: 1})["models"][quiet]["p50_ms"]
        flooded[quiet] = phase(f"{quiet} vs {loud}", {quiet: 1, loud: FLOOD_CLIENTS})["models"][quiet]["p50_ms"]
    result = {"target": target.name, **round_figures(alone, {m: both[m]["rate_rps"] for m in (a, b)}, idle, flooded),
              "phases": phases}
    say(f"  {target.name:13s} share {result['share']:.3f}  p50 flooded/idle "
        + "  ".join(f"{m} {r:.2f}x" for m, r in result["p50_ratio"].items()))
    return result


def round_figures(rate_alone: dict[str, float], rate_both: dict[str, float], p50_idle: dict[str, float],
                  p50_flooded: dict[str, float]) -> dict:
    """One round's figures from its rates and p50s per model: share = sum of rate_both / rate_alone,
    and each model's p50 while the other is flooded over its idle p50."""
    parts = {m: rate_both[m] / rate_alone[m] for m in rate_alone}
    return {"share": sum(parts.values()), "share_parts": parts, "rate_alone_rps": dict(rate_alone),
            "rate_both_rps": dict(rate_both), "p50_idle_ms": dict(p50_idle), "p50_flooded_ms": dict(p50_flooded),
            "p50_ratio": {m: p50_flooded[m] / p50_idle[m] for m in p50_idle}}


# -- summary --------------------------------------------------------------------------------------------------

def _median(values: list[float]) -> float:
    return float(np.median(values))


def summarize(rounds: list[dict], max_other_cpu: float = 0.0) -> dict:
    """Per target: the median over rounds of the share, rates and p50s, and the share's range; the ratio
    one_server share / two_processes share, taken within each round, where both ran; the phases that
    other processes disturbed past `max_other_cpu` cores on every attempt."""
    summary = {}
    for name in TARGETS:
        mine = [r[name] for r in rounds if name in r]
        if not mine:
            continue
        models = list(mine[0]["rate_alone_rps"])
        shares = [r["share"] for r in mine]
        summary[name] = {
            "rounds": len(mine),
            "share_median": _median(shares), "share_range": [min(shares), max(shares)],
            **{f"{key}_median": {m: _median([r[key][m] for r in mine]) for m in models}
               for key in ("rate_alone_rps", "rate_both_rps", "p50_idle_ms", "p50_flooded_ms", "p50_ratio")},
        }
    noisy = [(name, label, phase["other_cpu_cores"]) for r in rounds for name, t in r.items()
             for label, phase in t["phases"].items() if phase["other_cpu_cores"] >= max_other_cpu > 0]
    summary["noisy_phases"] = [f"{name} {label}: other processes {cores:.2f} cores" for name, label, cores in noisy]
    paired = [r["one_server"]["share"] / r["two_processes"]["share"] for r in rounds
              if "one_server" in r and "two_processes" in r]
    if paired:
        summary["one_over_two_share_median"] = _median(paired)
    return summary


def format_table(summary: dict) -> str:
    rows = [("target", "model", "alone req/s", "both req/s", "both/alone", "idle p50", "flooded p50", "ratio")]
    for name in TARGETS:
        s = summary.get(name)
        if not s:
            continue
        for m in s["rate_alone_rps_median"]:
            alone, both = s["rate_alone_rps_median"][m], s["rate_both_rps_median"][m]
            rows.append((name, m, f"{alone:.1f}", f"{both:.1f}", f"{both / alone:.3f}",
                         f"{s['p50_idle_ms_median'][m]:.2f} ms", f"{s['p50_flooded_ms_median'][m]:.2f} ms",
                         f"{s['p50_ratio_median'][m]:.2f}x"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    for name in TARGETS:
        s = summary.get(name)
        if s:
            lo, hi = s["share_range"]
            lines.append(f"{name} share {s['share_median']:.3f} (median of {s['rounds']}, range {lo:.3f}-{hi:.3f})")
    if "one_over_two_share_median" in summary:
        lines.append(f"one_server / two_processes share {summary['one_over_two_share_median']:.2f}x "
                     "(within a round, median)")
    lines.append("(medians over rounds; the both/alone column is of the medians, the shares are per round)")
    if summary.get("noisy_phases"):
        lines.append(f"{len(summary['noisy_phases'])} phase(s) ran beside other jobs' CPU: "
                     + "; ".join(summary["noisy_phases"]))
    return "\n".join(lines)


def _commit() -> str:
    """The checkout's commit, "+dirty" when serve/ has changes (the server measured)."""
    import subprocess

    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                              text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "serve"], cwd=REPO, capture_output=True,
                               text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""
    return head + ("+dirty" if dirty else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.many_models", description=__doc__.split("\n")[0])
    parser.add_argument("--export-dir", action="append", default=None,
                        help="an export to serve (twice); default: exports/default and exports/all-minilm-l6-v2")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=8.0, help="measured seconds per phase")
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds of load before each phase's clock")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 1 round of 2 s phases")
    parser.add_argument("--targets", default="auto",
                        help="comma-separated of " + ", ".join(TARGETS) + "; auto: one_server only where "
                             "the server takes --model-repository")
    parser.add_argument("--flags", default="", help="more `python -m serve` flags for every server (default: none)")
    parser.add_argument("--one-server-flags", default="",
                        help="more flags for the one_server target only, after --flags (e.g. '--instances 2')")
    parser.add_argument("--max-other-cpu", type=float, default=0.25,
                        help="cores other processes may use during a phase before it runs again (0: no check)")
    parser.add_argument("--quiet-wait", type=float, default=120.0,
                        help="seconds to wait for a quiet host before each phase")
    parser.add_argument("--out", default="bench-results/models.json")
    args = parser.parse_args(argv)
    # a SIGTERMed bench still stops its servers (the `with` blocks run)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    if args.quick:
        args.rounds, args.seconds, args.warmup = 1, 2.0, 1.0
    exports = args.export_dir or ["exports/default", "exports/all-minilm-l6-v2"]
    if len(exports) != 2:
        parser.error("--export-dir: give two exports, or none for the defaults")
    for export in exports:
        if not (Path(export) / "metadata.json").exists():
            parser.error(f"{export} is not an export; write it first (`python -m export --graphs fp32,optimized`, "
                         "`python -m export --minilm`)")
    loads = [workload(e) for e in exports]
    if loads[0].name == loads[1].name:
        parser.error(f"both exports are named {loads[0].name!r}; a repository needs distinct model names")
    workloads = {w.name: w for w in loads}
    if args.targets == "auto":
        targets = list(TARGETS) if one_server_available() else ["two_processes"]
    else:
        targets = [t.strip() for t in args.targets.split(",") if t.strip()]
        unknown = [t for t in targets if t not in TARGETS]
        if unknown:
            parser.error(f"unknown target(s) {unknown}; known: {', '.join(TARGETS)}")
    if "one_server" not in targets:
        print("one_server skipped: this server has no --model-repository (serve/config.py)", file=sys.stderr)
    starters = {"two_processes": two_processes, "one_server": one_server}
    flags = args.flags.split()
    target_flags = {"two_processes": flags, "one_server": flags + args.one_server_flags.split()}
    commit = _commit()  # what is measured: the checkout as the servers start
    gate = HostGate(args.max_other_cpu, args.quiet_wait, 0 if args.quick else 2)
    say = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    rounds = []
    for number in range(args.rounds):
        order = targets if number % 2 == 0 else targets[::-1]
        say(f"round {number + 1}/{args.rounds}: {', '.join(order)}")
        results = {}
        for name in order:
            with starters[name](loads, target_flags[name]) as target:
                results[name] = measure(target, workloads, seconds=args.seconds, warmup_s=args.warmup, gate=gate,
                                        say=say)
        rounds.append(results)
    summary = summarize(rounds, args.max_other_cpu)
    table = format_table(summary)
    print(table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"summary": summary, "rounds": rounds, "table": table, "cpus": os.cpu_count(),
                               "settings": {"rounds": args.rounds, "seconds": args.seconds, "warmup_s": args.warmup,
                                            "flood_clients": FLOOD_CLIENTS, "ids_length": IDS_LENGTH,
                                            "max_other_cpu": args.max_other_cpu,
                                            "exports": [str(w.export_dir) for w in loads], "flags": target_flags,
                                            "commit": commit,
                                            "targets": targets}}, indent=2))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
