"""Judging a benchmark run against the issue's targets, and the table printed for it. Works on the
report dict bench/model_and_server.py writes (bench-results/bench.json), so a saved report can be re-read.
"""

from __future__ import annotations

from bench.harness import verdicts

# The targets: (key, description, limit, at least (True) or at most (False)).
TARGETS = (
    ("ort_fp32_vs_torch@8x256", "ORT fp32 speed-up over PyTorch eager at (8,256)", 1.5, True),
    ("ort_fp32_vs_torch@1x1024", "ORT fp32 speed-up over PyTorch eager at (1,1024)", 1.5, True),
    ("best_fp32_matmul_fraction@8x256", "best fp32 graph, fraction of measured matmul GFLOP/s at (8,256)", 0.75, True),
    ("int8_vs_ort_fp32@8x256", "int8 speed-up over ORT fp32 at (8,256)", 1.8, True),
    ("server_p50_vs_inprocess@1x128", "server p50 / in-process p50 at (1,128)", 1.15, False),
    ("batching_throughput_gain@32x32", "throughput batching on / off, 32 clients, length 32", 3.0, True),
    ("rss_growth_1k_to_20k", "server RSS (high-water mark) growth from 1k to 20k requests (fraction)", 0.05, False),
)


def judge(model_rows: list[dict], server: dict | None, matmul: float) -> list[dict]:
    def ms(engine, b, t):
        for row in model_rows:
            if row["engine"] == engine and (row["batch"], row["length"]) == (b, t):
                return row["median_ms"]
        return None

    def ratio(a, b):
        return a / b if a is not None and b is not None and b > 0 else None

    def best_rate(b, t):
        rates = [r["gflops_per_s"] for r in model_rows
                 if (r["batch"], r["length"]) == (b, t) and r["engine"] in ("ort-fp32", "ort-optimized")]
        return max(rates) if rates else None

    values = {
        "ort_fp32_vs_torch@8x256": ratio(ms("torch-eager", 8, 256), ms("ort-fp32", 8, 256)),
        "ort_fp32_vs_torch@1x1024": ratio(ms("torch-eager", 1, 1024), ms("ort-fp32", 1, 1024)),
        "best_fp32_matmul_fraction@8x256": ratio(best_rate(8, 256), matmul),
        "int8_vs_ort_fp32@8x256": ratio(ms("ort-fp32", 8, 256), ms("ort-int8", 8, 256)),
    }
    if server:
        lat, thr, mem = server.get("latency", {}), server.get("throughput", {}), server.get("memory", {})
        if "server" in lat and "in_process" in lat:
            values["server_p50_vs_inprocess@1x128"] = ratio(lat["server"]["p50_ms"], lat["in_process"]["p50_ms"])
        if "batching_on" in thr and "batching_off" in thr:
            values["batching_throughput_gain@32x32"] = ratio(thr["batching_on"]["throughput_rps"],
                                                             thr["batching_off"]["throughput_rps"])
        values["rss_growth_1k_to_20k"] = mem.get("growth")
    return verdicts(TARGETS, values)


def row_text(row: dict) -> str:
    return (f"{row['engine']:15s} ({row['batch']:>2},{row['length']:>5}) {row['median_ms']:9.2f} ms  "
            f"{row['gflops_per_s']:7.1f} GFLOP/s  [{row['runs']} runs]")


def format_table(report: dict) -> str:
    matmul = report.get("matmul_gflops_best", report["matmul_gflops"])
    gpu = f", device cuda ({report['machine'].get('gpu')})" if report.get("device") == "cuda" else ""
    lines = [f"machine: {report['machine']['cpu']}, {report['machine']['physical_cores']} physical cores{gpu}, "
             f"threads {report['threads']}; matmul {matmul:.1f} GFLOP/s ({report['matmul_n']}x{report['matmul_n']} "
             f"fp32, best of before {report['matmul_gflops']:.1f} / after "
             f"{report.get('matmul_gflops_after', float('nan')):.1f})", "",
             f"{'engine':15s} {'(B, T)':>10s} {'median ms':>10s} {'GFLOP/s':>8s} {'% matmul':>8s} {'vs torch':>8s}"]
    torch_ms = {(r["batch"], r["length"]): r["median_ms"] for r in report["model"] if r["engine"] == "torch-eager"}
    for row in report["model"]:
        base = torch_ms.get((row["batch"], row["length"]))
        lines.append(f"{row['engine']:15s} {str((row['batch'], row['length'])):>10s} {row['median_ms']:10.2f} "
                     f"{row['gflops_per_s']:8.1f} {100 * row['gflops_per_s'] / matmul:7.1f}% "
                     f"{(base / row['median_ms']) if base else float('nan'):7.2f}x")
    if report.get("tuning"):
        lines += ["", f"tuning at {tuple(report['tuning_point'])}:"]
        lines += [f"  {r['engine']:15s} {r['settings']:52s} {r['median_ms']:9.2f} ms" for r in report["tuning"]]
    server = report.get("server")
    if server:
        for key, title in (("latency", "server defaults (no queue delay)"),
                           ("latency_queue_delay_2ms", "--max-queue-delay-ms 2")):
            lat = server.get(key)
            if not lat:
                continue
            lines += ["", f"latency at (1,{lat['point'][1]}), graph {lat['graph']}, {title}:"]
            for name in ("server", "bare_grpc", "in_process"):
                if name not in lat:
                    continue
                p = lat[name]
                lines.append(f"  {name:10s} p50 {p['p50_ms']:8.2f}  p90 {p['p90_ms']:8.2f}  "
                             f"p99 {p['p99_ms']:8.2f} ms (n={p['n']})")
            if "bare_grpc" in lat:
                lines.append(f"  (bare_grpc: bench/bare_server.py, gRPC + session.run only: "
                             f"{lat['bare_grpc']['p50_ms'] / lat['in_process']['p50_ms']:.3f}x in-process at p50)")
        lines.append("throughput:")
        for name, t in server["throughput"].items():
            lines.append(f"  {name:12s} {t['throughput_rps']:8.1f} req/s  rows per run {_num(t.get('rows_per_run'))}  "
                         f"CPU per request: front end {_num(t.get('front_cpu_ms_per_request'), 2)} ms, model "
                         f"{_num(t.get('model_cpu_ms_per_request'), 2)} ms  "
                         f"{t['clients']} clients  {t['requests']} requests  {t['errors']} errors  "
                         f"RSS idle {t['rss_idle_mb']:.0f} MiB, peak {t['rss_peak_mb']:.0f} MiB")
        mixed = server.get("mixed_lengths")
        if mixed:
            lines.append(f"mixed lengths {min(mixed['lengths'])}-{max(mixed['lengths'])}, "
                         f"{len(mixed['lengths'])} clients, batching on:")
            for name, title in (("split", "length-sorted runs"), ("one_run", "one padded run (--length-split false)")):
                t = mixed[name]
                lines.append(f"  {title:38s} {t['throughput_rps']:8.1f} req/s  {t['tokens_per_s']:8.0f} tokens/s  "
                             f"p50 {t['latency']['p50_ms']:7.1f} ms  p99 {t['latency']['p99_ms']:7.1f} ms  "
                             f"rows per run {_num(t.get('rows_per_run'))}  front-end CPU "
                             f"{_num(t.get('front_cpu_ms_per_request'), 2)} ms/request")
            if mixed.get("split_gain"):
                lines.append(f"  length-sorted runs: {mixed['split_gain']:.2f}x the throughput")
        mem = server.get("memory") or {}
        if mem:
            def pct(value):
                return "n/a" if value is None else f"{100 * value:.2f}%"

            marks = ", ".join(f"{c['requests']} req: {c['rss_mb']:.1f} MiB (peak so far {c.get('peak_mb', 0):.1f})"
                              for c in mem["checkpoints"])
            lines.append(f"memory: idle {mem['idle_mb']:.1f} MiB; {marks}; growth of the peak "
                         f"{pct(mem.get('growth'))}, of point samples {pct(mem.get('growth_point_samples'))}")
    elif report.get("server_skipped"):
        lines += ["", f"server: skipped ({report['server_skipped']})"]
    lines += ["", "targets:"]
    for v in report["targets"]:
        value = "n/a" if v["value"] is None else f"{v['value']:.3f}"
        state = {True: "MET", False: "NOT MET", None: "not measured"}[v["met"]]
        lines.append(f"  {state:12s} {v['description']}: {value} (target {v['direction']} {v['limit']})")
    return "\n".join(lines)


def _num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"
