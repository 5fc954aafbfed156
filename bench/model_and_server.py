"""One benchmark run: export (or reuse) the graphs, time the model, time the server, write JSON.
`python -m bench` calls `run_bench`; judging the targets and the table are bench/model_and_server_report.py's.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from bench import model_bench as mb
from bench import server_bench as sb
from bench.harness import RssSampler, mib, peak_rss_mib, running_server, token_ids
from bench.model_and_server_report import format_table, judge, row_text
from model.config import EncoderConfig
from model.export_format import ExportError, read_metadata

DEFAULT_POINTS = ((1, 128), (8, 256), (1, 1024))
MODEL_GRAPHS = ("fp32", "optimized", "int8", "fp16")


@dataclass(frozen=True)
class BenchOptions:
    quick: bool = False
    out: str = "bench-results/bench.json"
    export_dir: str = ""  # an existing export directory; empty: export into bench-results/
    threads: int = 0  # 0: physical cores
    points: tuple = DEFAULT_POINTS
    graphs: tuple = MODEL_GRAPHS
    repeats: int = 20
    budget_s: float = 10.0  # per (engine, point): stop timing past this once 3 runs are in
    model: bool = True
    server: bool = True
    serve_graph: str = "optimized"  # the graph the server benchmark serves (and runs in-process)
    latency_requests: int = 300
    clients: int = 32
    client_length: int = 32
    mixed_lengths: tuple = (8, 256)  # the mixed-length run: each client's length drawn from this range
    throughput_requests: int = 3000
    throughput_deadline_s: float = 20.0
    rss_checkpoints: tuple = (1000, 20000)
    tune: bool = True
    device: str = "cpu"  # cpu | cuda: where PyTorch, every session and the server run

    @classmethod
    def quick_defaults(cls, **overrides) -> "BenchOptions":
        base = dict(quick=True, points=((1, 16), (2, 32)), repeats=3, budget_s=1.0, latency_requests=20,
                    clients=4, client_length=8, mixed_lengths=(2, 32), throughput_requests=40,
                    throughput_deadline_s=10.0,
                    rss_checkpoints=(20, 60), tune=False)
        base.update(overrides)
        return cls(**base)


def quick_config() -> EncoderConfig:
    return EncoderConfig(name="bench-quick", d_model=32, n_heads=2, n_layers=1, d_ff=64, vocab_size=64,
                         max_positions=64)


def physical_cores() -> int:
    import psutil

    return psutil.cpu_count(logical=False) or os.cpu_count() or 1


def machine_info() -> dict:
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        model = platform.processor()
    import onnxruntime as ort
    import psutil
    import torch

    return {"cpu": model, "physical_cores": physical_cores(), "logical_cpus": psutil.cpu_count(),
            "memory_gb": round(psutil.virtual_memory().total / 2**30, 1), "platform": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__, "onnxruntime": ort.__version__,
            "ort_providers": ort.get_available_providers(), "load_average_start": list(os.getloadavg()),
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


def ensure_export(config: EncoderConfig, graphs: tuple, options: BenchOptions, say) -> Path:
    """The export directory holding `graphs`: the given one, or one written (and reused) under
    bench-results/export/."""
    if options.export_dir:
        return Path(options.export_dir)
    from export.exporter import export_model
    from export.graphs import resolve

    root = Path(options.out).parent / "export"
    target = root / config.name
    stamp = root / f".{config.name}.source-sha256"
    source = _exporter_source_hash()
    if stamp.exists() and stamp.read_text() == source:
        try:
            metadata = read_metadata(target)
        except ExportError:
            metadata = None
        if metadata and metadata.config == config and set(resolve(tuple(graphs), config)) <= set(metadata.graphs):
            say(f"reusing export {target}")
            return target
    say(f"exporting {', '.join(graphs)} to {target}")
    export_model(config, root, graphs=tuple(graphs), long_length=24 if options.quick else 67, progress=say)
    stamp.write_text(source)
    return target


def _exporter_source_hash() -> str:
    """sha256 over model/ and export/ sources: a reused export must come from the code being measured."""
    repo = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for path in sorted([*repo.glob("model/*.py"), *repo.glob("export/*.py")]):
        digest.update(path.relative_to(repo).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def bench_model(config: EncoderConfig, export_dir: Path, graphs: tuple, threads: int, options: BenchOptions,
                say) -> list[dict]:
    import onnxruntime as ort
    import torch

    from model.encoder import build_encoder
    from model.signature import input_names

    graph_files = read_metadata(export_dir).graphs
    cuda = "CUDAExecutionProvider" in ort.get_available_providers()
    on_gpu = options.device == "cuda"
    torch.set_num_threads(threads)
    model = build_encoder(config).to(options.device)
    settings = mb.SessionSettings(intra_op_threads=threads)
    sessions = {}
    for graph in graphs:
        if graph not in graph_files:
            continue
        providers = mb.CUDA_PROVIDERS if (on_gpu or graph == "fp16") else None
        if graph == "fp16" and not cuda:
            say("fp16: skipped (no CUDA execution provider here; the fp16 graph is for GPUs)")
            continue
        if graph == "int8" and on_gpu:
            say("int8: skipped on cuda (dynamic quantisation is the CPU variant)")
            continue
        sessions[graph] = mb.make_session(str(export_dir / graph_files[graph].file), settings, providers)
    rows = []
    order = list(input_names(config))
    for batch, length in options.points:
        feeds = mb.bench_feeds(config, batch, length)
        runners = {"torch-eager": mb.torch_runner(model, feeds, order, device=options.device)}
        runners.update({f"ort-{graph}": mb.ort_runner(session, feeds) for graph, session in sessions.items()})
        timings = mb.time_interleaved(runners, warmup=2, repeats=options.repeats,
                                      budget_s=options.budget_s * len(runners))
        for engine, timing in timings.items():
            rows.append(mb.point_row(config, batch, length, engine, timing))
            say(row_text(rows[-1]))
    return rows


def tune_sessions(config: EncoderConfig, export_dir: Path, threads: int, point: tuple, options: BenchOptions,
                  say) -> list[dict]:
    """fp32 / optimized / int8 at one point under a few SessionOptions: threads, optimisation level,
    execution mode, spinning."""
    graph_files = read_metadata(export_dir).graphs
    batch, length = point
    feeds = mb.bench_feeds(config, batch, length)
    candidates = [
        mb.SessionSettings(threads),
        mb.SessionSettings(0),  # onnxruntime's own default thread count
        mb.SessionSettings(1),
        mb.SessionSettings(threads, optimization="extended"),
        mb.SessionSettings(threads, optimization="basic"),
        mb.SessionSettings(threads, execution_mode="parallel", inter_op_threads=threads),
        mb.SessionSettings(threads, allow_spinning=False),
    ]
    runners, labels = {}, {}
    for graph in ("fp32", "optimized", "int8"):
        if graph not in graph_files:
            continue
        path = str(export_dir / graph_files[graph].file)
        for settings in candidates:
            if graph != "fp32" and settings.optimization != "all":
                continue  # the level matters for the raw graph; the derived ones are fused already
            key = f"ort-{graph} {settings.label()}"
            runners[key] = mb.ort_runner(mb.make_session(path, settings), feeds)
            labels[key] = (f"ort-{graph}", settings.label())
    timings = mb.time_interleaved(runners, warmup=2, repeats=max(5, options.repeats // 2),
                                  budget_s=options.budget_s * len(runners) / 2)
    rows = []
    for key, timing in timings.items():
        engine, label = labels[key]
        rows.append({**mb.point_row(config, batch, length, engine, timing), "settings": label})
        say(f"tune {engine:13s} {label:50s} {timing['median_ms']:9.2f} ms")
    return rows


def bench_server(config: EncoderConfig, export_dir: Path, threads: int, options: BenchOptions, say) -> dict:
    from bench.model_bench import SessionSettings, make_session
    from export.cases import MaskSpec, make_feeds

    graph_files = read_metadata(export_dir).graphs
    vocab = config.vocab_size
    length = min(128, config.max_positions) if not options.quick else min(16, config.max_positions)
    ids = token_ids(vocab, length, seed=1)
    result: dict = {"latency": {}, "throughput": {}, "memory": {}}

    # (b) latency, server vs in-process: same graph, same thread count, same session options.
    graph = options.serve_graph if options.serve_graph in graph_files else "fp32"
    device = ["--device", options.device]
    flags = sb.server_flags(graph, threads, batching=True) + device
    session = make_session(str(export_dir / graph_files[graph].file), SessionSettings(threads),
                           mb.CUDA_PROVIDERS if options.device == "cuda" else None)
    feeds = make_feeds(config, [length], MaskSpec(), padded_to=length)
    feeds[next(iter(feeds))] = ids[None, :]
    # Beside them, on CPU: bench/bare_server.py, a gRPC server that only runs session.run -- the floor
    # that gRPC in Python sets under any Python server's latency.
    with ExitStack() as stack:
        server = stack.enter_context(running_server(str(export_dir), flags))
        say(f"server up on {server.target} (pid {server.pid}) flags {' '.join(flags)}")
        targets = {"server": server.target}
        if options.device == "cpu" and config.input_kind == "tokens":
            targets["bare_grpc"] = stack.enter_context(sb.running_bare_server(str(export_dir), graph, threads)).target
        result["latency"] = sb.paired_latency(targets, ids, session, feeds, warmup=10,
                                              requests=options.latency_requests)
    result["latency"].update(point=[1, length], graph=graph, flags=flags)
    # The same with a 2 ms batching delay: what waiting for company costs a lone request.
    flags = sb.server_flags(graph, threads, batching=True, queue_delay_ms=2.0) + device
    with running_server(str(export_dir), flags) as server:
        result["latency_queue_delay_2ms"] = sb.paired_latency({"server": server.target}, ids, session, feeds,
                                                             warmup=10, requests=options.latency_requests)
    result["latency_queue_delay_2ms"].update(point=[1, length], graph=graph, flags=flags)
    for key in ("latency", "latency_queue_delay_2ms"):
        for name in ("server", "bare_grpc", "in_process"):
            if name in result[key]:
                say(f"{key} {name} (1,{length}): " + ", ".join(
                    f"{k} {v:.2f}" for k, v in result[key][name].items() if k.endswith("_ms")))
    del session

    # (b) throughput with batching on / off; (c) RSS of the batching server from its start.
    client_ids = [token_ids(vocab, options.client_length, seed=100 + i) for i in range(options.clients)]
    first, last = options.rss_checkpoints
    for mode in ("off", "on"):
        flags = sb.server_flags(graph, threads, batching=(mode == "on")) + device
        with running_server(str(export_dir), flags) as server:
            with RssSampler(server.pid) as rss:
                idle = rss.now()
                # Warm-up, and for the batching server the first RSS checkpoint: `first` requests
                # answered since start (the health check and per-channel connects included).
                warm = sb.concurrent_load(server.target, client_ids, total_requests=max(first, len(client_ids)),
                                          deadline_s=600.0)
                served = warm["requests"] + len(client_ids)
                after_first, peak_first = rss.now(), rss.peak
                load = sb.concurrent_load(server.target, client_ids, total_requests=options.throughput_requests,
                                          deadline_s=options.throughput_deadline_s, server=server, model_threads=threads)
                served += load["requests"] + len(client_ids)
                load.update(flags=flags, rss_idle_mb=mib(idle), rss_peak_mb=mib(rss.peak))
                result["throughput"][f"batching_{mode}"] = load
                say(f"throughput batching {mode}: {load['throughput_rps']:.1f} req/s "
                    f"(rows per run {load['rows_per_run'] or 0:.1f}, run {load['mean_inference_ms']:.1f} ms, "
                    f"server CPU per request {sb.ms(load['server_cpu_ms_per_request'])}: front end "
                    f"{sb.ms(load['front_cpu_ms_per_request'])}, model {sb.ms(load['model_cpu_ms_per_request'])}; "
                    f"queue {load['mean_queue_ms']:.1f} ms, CPU cores: clients {load['client_cpu_cores']:.2f}, "
                    f"server {load['server_cpu_cores']:.2f}; {load['requests']} requests, {load['errors']} errors)")
                if mode == "on":
                    if last > served:
                        more = sb.concurrent_load(server.target, client_ids, total_requests=last - served,
                                                  deadline_s=900.0)
                        served += more["requests"] + len(client_ids)
                    after_last, peak_last = rss.now(), rss.peak
                    checkpoints = [{"requests": warm["requests"] + len(client_ids), "rss_mb": mib(after_first),
                                    "peak_mb": mib(peak_first)},
                                   {"requests": served, "rss_mb": mib(after_last), "peak_mb": mib(peak_last)}]
                    # Judged on the high-water mark (sampled every 50 ms since start): this server's RSS
                    # swings by ~10 MiB between samples at steady load, so two point samples compare
                    # phases of that swing; a leak raises the high-water mark. Both are kept.
                    result["memory"] = {"graph": graph, "idle_mb": mib(idle), "checkpoints": checkpoints,
                                        "peak_sampled_mb": mib(rss.peak),
                                        "peak_vmhwm_mb": peak_rss_mib(server.pid),
                                        "growth": (peak_last - peak_first) / peak_first if peak_first else None,
                                        "growth_point_samples": ((after_last - after_first) / after_first
                                                                 if after_first else None)}
                    say(f"server RSS: idle {mib(idle):.1f} MiB, after {checkpoints[0]['requests']} requests "
                        f"{mib(after_first):.1f} MiB (peak {mib(peak_first):.1f}), after {served} "
                        f"{mib(after_last):.1f} MiB (peak {mib(peak_last):.1f})")
    result["mixed_lengths"] = bench_mixed_lengths(config, export_dir, graph, threads, options, say)
    return result


def bench_mixed_lengths(config: EncoderConfig, export_dir: Path, graph: str, threads: int, options: BenchOptions,
                        say) -> dict:
    """(d) Batching on, clients of different lengths: length-sorted runs (the default) vs one padded
    run per batch (--length-split false). Each client keeps its own length, drawn once (seeded)."""
    low, high = options.mixed_lengths
    high = min(high, config.max_positions)
    lengths = np.random.default_rng(7).integers(low, high + 1, options.clients)
    client_ids = [token_ids(config.vocab_size, int(n), seed=200 + i) for i, n in enumerate(lengths)]
    requests = max(len(client_ids), options.throughput_requests // 3)
    result: dict = {"lengths": [int(n) for n in lengths]}
    for mode in ("split", "one_run"):
        flags = sb.server_flags(graph, threads, batching=True, length_split=(mode == "split")) + ["--device",
                                                                                                  options.device]
        with running_server(str(export_dir), flags) as server:
            sb.concurrent_load(server.target, client_ids, total_requests=2 * len(client_ids), deadline_s=600.0)
            load = sb.concurrent_load(server.target, client_ids, total_requests=requests,
                                      deadline_s=options.throughput_deadline_s, server=server, model_threads=threads)
        load.update(flags=flags)
        result[mode] = load
        say(f"mixed lengths {low}-{high}, {mode}: {load['throughput_rps']:.1f} req/s, "
            f"{load['tokens_per_s']:.0f} tokens/s (p50 {load['latency']['p50_ms']:.1f} ms; {load['requests']} requests; "
            f"rows per run {load['rows_per_run'] or 0:.1f}; front-end CPU per request "
            f"{sb.ms(load['front_cpu_ms_per_request'])})")
    result["split_gain"] = (result["split"]["throughput_rps"] / result["one_run"]["throughput_rps"]
                            if result["one_run"]["throughput_rps"] else None)
    return result


def run_bench(options: BenchOptions, *, progress=None) -> dict:
    say = progress or (lambda _msg: None)
    started = time.time()
    config = quick_config() if options.quick else EncoderConfig()
    if options.export_dir:  # benchmark the model that export holds, whatever its size
        config = read_metadata(options.export_dir).config
    threads = options.threads or physical_cores()
    report: dict = {"format": "encoder-bench/1", "quick": options.quick,
                    "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    "options": {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(options).items()},
                    "config": {"name": config.name, "d_model": config.d_model, "n_heads": config.n_heads,
                               "n_layers": config.n_layers, "d_ff": config.d_ff,
                               "max_positions": config.max_positions},
                    "machine": machine_info(), "threads": threads}
    graphs = tuple(g for g in options.graphs if g != "fp32")
    export_dir = ensure_export(config, ("fp32", *graphs), options, say)
    report["export_dir"] = str(export_dir)
    report["device"] = options.device
    report["matmul_n"] = 256 if options.quick else (8192 if options.device == "cuda" else 2048)
    report["matmul_gflops"] = mb.matmul_gflops(threads, n=report["matmul_n"], repeats=3 if options.quick else 10,
                                               device=options.device)
    say(f"matmul: {report['matmul_gflops']:.1f} GFLOP/s at {threads} threads")
    report["model"] = (bench_model(config, export_dir, ("fp32", *graphs), threads, options, say)
                       if options.model else [])
    if options.tune and options.model and options.device == "cpu":
        point = (8, 256) if (8, 256) in options.points else options.points[0]
        report["tuning_point"] = list(point)
        report["tuning"] = tune_sessions(config, export_dir, threads, point, options, say)
    report["matmul_gflops_after"] = mb.matmul_gflops(threads, n=report["matmul_n"], repeats=3, device=options.device)
    report["server"] = None
    if options.server:
        try:
            import client  # noqa: F401
        except ImportError as error:
            report["server_skipped"] = f"serve is not importable: {error}"
        else:
            report["server"] = bench_server(config, export_dir, threads, options, say)
    else:
        report["server_skipped"] = "--no-server"
    # The machine's GEMM rate is the better of the two measurements: on a shared host one of them
    # can land in a busy spell, and the larger makes the fraction target the harder one.
    report["matmul_gflops_best"] = max(report["matmul_gflops"], report["matmul_gflops_after"])
    report["targets"] = judge(report["model"], report["server"], report["matmul_gflops_best"])
    if options.quick or options.device != "cpu":  # the targets are for the default model on CPU
        for verdict in report["targets"]:
            verdict.update(met=None, note="quick mode: not judged" if options.quick else "cuda run: not judged")
    report["machine"]["load_average_end"] = list(os.getloadavg())
    report["seconds"] = time.time() - started
    out = Path(options.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    os.replace(tmp, out)
    report["table"] = format_table(report)
    return report
