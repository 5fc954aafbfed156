"""`python -m bench --long`: attention at long lengths, each mask kind on the graph the server would run.

Batch 1, T in LENGTHS, on the default model (and its linear / performer variants): median time and peak
RSS of one session.run of the whole encoder, each measurement in a fresh process (so peak RSS is that
run's own), the fitted growth exponent over T, and beside them the dense graph and PyTorch eager (the
dense reference, and `scaled_dot_product_attention` with the same boolean mask) where their memory
estimate fits. Prints a table, judges the issue's targets, writes JSON.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from bench.harness import peak_rss_mib, verdicts

LENGTHS = (1024, 4096, 16384, 32768)
QUICK_LENGTHS = (256, 1024)
# (label, model variant, mask kind, window, step, causal)
CASES = (
    ("bidirectional", "default", "bidirectional", 0, 1, False),
    ("window 128", "default", "sliding_window", 128, 1, False),
    ("causal window 128", "default", "sliding_window", 128, 1, True),
    ("dilated 8", "default", "dilated", 0, 8, False),
    ("local+strided (128, 64)", "default", "local_strided", 128, 64, False),
    ("linear", "linear", "bidirectional", 0, 1, False),
    ("performer", "performer", "bidirectional", 0, 1, False),
)
# Engines compared at every length where they fit: the graph the server picks, the dense graph, PyTorch.
ENGINES = ("served", "dense", "torch", "torch-sdpa")
# Fraction of this machine's memory a measurement may be estimated to take before it is skipped.
MEMORY_SHARE = 0.7
# The long paths the growth and memory targets name: (key, case label).
LONG_PATHS = (("window128", "window 128"), ("causal_window128", "causal window 128"), ("linear", "linear"),
              ("performer", "performer"))
TARGETS = (
    *((f"growth_{key}", f"{case}: time(32k) / time(4k)", 9.0, False) for key, case in LONG_PATHS),
    *((f"rss_{key}@32k", f"{case}: peak RSS at T=32768 (GiB)", 2.0, False) for key, case in LONG_PATHS),
    ("window128_vs_dense@8k", "window 128 at T=8192: dense graph time / sparse graph time", 4.0, True),
    ("window128_vs_sdpa@8k", "window 128 at T=8192: PyTorch masked SDPA time / sparse graph time", 3.0, True),
    ("dilated8_vs_dense@8k", "dilated 8 at T=8192: dense graph time / sparse graph time", 3.0, True),
)


@dataclass(frozen=True)
class Measurement:
    case: str
    engine: str
    length: int
    path: str
    median_ms: float | None
    peak_rss_mib: float | None
    note: str = ""


def _configs(quick: bool) -> dict:
    from model.config import EncoderConfig

    base = EncoderConfig(name="long-quick", d_model=32, n_heads=2, n_layers=1, d_ff=64, vocab_size=64) if quick \
        else EncoderConfig()
    return {"default": base, "linear": base.replace(name=f"{base.name}-linear", attention="linear"),
            "performer": base.replace(name=f"{base.name}-performer", attention="performer")}


def _estimate(config, path: str, length: int, kind: str, window: int, step: int) -> int:
    from model.attention_paths import RowMask, attention_bytes
    from model.mask_kinds import MaskKind

    return attention_bytes(path, 1, length, RowMask(MaskKind.parse(kind), window, step), config)


def run_long(out: str, *, quick: bool = False, threads: int = 0, repeats: int = 3, device: str = "cpu",
             lengths: tuple = (), engines: tuple = (), say=print) -> dict:
    """Exports (or reuses) the three models with their long graphs, measures every case, returns the report.
    `lengths` and `engines` (default: all) narrow a run to fit a time budget (a lent GPU's, say)."""
    from bench.model_and_server import BenchOptions, ensure_export, machine_info, physical_cores
    from model.attention_paths import DENSE, cheapest, RowMask
    from model.config import to_dict
    from model.export_format import read_metadata
    from model.mask_kinds import MaskKind
    from serve.core.attention_budget import available_memory

    engines = tuple(engines) or ENGINES
    unknown = set(engines) - set(ENGINES)
    if unknown:
        raise ValueError(f"unknown engines {sorted(unknown)}; known: {', '.join(ENGINES)}")
    threads = threads or physical_cores()
    options = BenchOptions(out=out, quick=quick)
    configs = _configs(quick)
    exports = {name: ensure_export(config, ("fp32", "long"), options, say) for name, config in configs.items()}
    extra = () if quick or lengths else (8192,)  # the comparison point (named lengths: only those)
    lengths = tuple(lengths) or (QUICK_LENGTHS if quick else LENGTHS)
    if device == "cuda":
        import torch

        memory = torch.cuda.mem_get_info()[1] * MEMORY_SHARE
    else:
        memory = available_memory() * MEMORY_SHARE
    results: list[Measurement] = []
    for label, variant, kind, window, step, causal in CASES:
        config = configs[variant]
        metadata = read_metadata(exports[variant])
        files = {entry.attention_path: exports[variant] / entry.file
                 for name, entry in metadata.graphs.items() if name in ("fp32", "sparse", "linear")}
        for length in sorted({*lengths, *extra}):
            served = cheapest(length, RowMask(MaskKind.parse(kind), window, step), config, tuple(files))
            for engine in engines:
                if length in extra and engine != "served" and label not in ("window 128", "dilated 8"):
                    continue
                if engine == "torch-sdpa" and config.attention != "softmax":
                    continue
                path = served if engine == "served" else DENSE
                if engine == "dense" and served == DENSE:
                    continue  # the same run as "served"
                estimate = _estimate(config, path, length, kind, window, step) * (2 if engine.startswith("torch") else 1)
                if estimate > memory:
                    results.append(Measurement(label, engine, length, path, None, None,
                                               f"skipped: needs ~{estimate / 2**30:.0f} GiB"))
                    continue
                job = {"engine": engine, "graph": str(files[path]), "path": path, "config": to_dict(config),
                       "length": length, "kind": kind, "window": window, "step": step, "causal": causal,
                       "threads": threads, "repeats": repeats, "device": device}
                say(f"long: {label} T={length} {engine} ({path})")
                results.append(_measure(label, engine, length, path, job))
    report = {"format": "encoder-bench-long/1", "machine": machine_info(), "threads": threads, "quick": quick,
              "device": device,
              "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "results": [r.__dict__ for r in results]}
    report["growth"] = growth(results, lengths)
    report["targets"] = [] if quick else judge(results, report["growth"])
    report["table"] = format_table(results, report["growth"], report["targets"], report["machine"], threads, device)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(report, indent=2) + "\n")
    return report


def _measure(label: str, engine: str, length: int, path: str, job: dict) -> Measurement:
    from serve.__main__ import HUGE_PAGES  # measured as the server runs: malloc on huge pages

    env = {**os.environ, "GLIBC_TUNABLES": ":".join(filter(None, [os.environ.get("GLIBC_TUNABLES"), HUGE_PAGES]))}
    proc = subprocess.run([sys.executable, "-m", "bench.long_input_attention", json.dumps(job)],
                          capture_output=True, text=True, timeout=900, env=env)
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["killed"])[-1][:160]
        return Measurement(label, engine, length, path, None, None, f"failed: {tail}")
    data = json.loads(proc.stdout.strip().splitlines()[-1])
    return Measurement(label, engine, length, path, data["median_ms"], data["peak_rss_mib"])


def growth(results: list[Measurement], lengths) -> dict:
    """Per case on the served path: the fitted exponent of time ~ T^p, and time(max) / time(4k)."""
    out = {}
    for label, *_ in CASES:
        points = [(r.length, r.median_ms) for r in results
                  if r.case == label and r.engine == "served" and r.median_ms and r.length in lengths]
        if len(points) < 2:
            continue
        xs, ys = [math.log(t) for t, _ in points], [math.log(ms) for _, ms in points]
        mx, my = statistics.fmean(xs), statistics.fmean(ys)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
        times = dict(points)
        ratio = times[32768] / times[4096] if 32768 in times and 4096 in times else None
        out[label] = {"exponent": round(slope, 3), "ratio_32k_4k": ratio}
    return out


def _find(results, case, engine, length):
    return next((r for r in results if r.case == case and r.engine == engine and r.length == length), None)


def judge(results: list[Measurement], grown: dict) -> list[dict]:
    def ratio(case, slow, fast, length=8192):
        a, b = _find(results, case, slow, length), _find(results, case, fast, length)
        return a.median_ms / b.median_ms if a and b and a.median_ms and b.median_ms else None

    def rss(case):
        r = _find(results, case, "served", 32768)
        return r.peak_rss_mib / 1024 if r and r.peak_rss_mib else None

    values = {
        **{f"growth_{key}": grown.get(case, {}).get("ratio_32k_4k") for key, case in LONG_PATHS},
        **{f"rss_{key}@32k": rss(case) for key, case in LONG_PATHS},
        "window128_vs_dense@8k": ratio("window 128", "dense", "served"),
        "window128_vs_sdpa@8k": ratio("window 128", "torch-sdpa", "served"),
        "dilated8_vs_dense@8k": ratio("dilated 8", "dense", "served"),
    }
    return verdicts(TARGETS, values)


def format_table(results, grown, targets, machine, threads, device="cpu") -> str:
    where = f"{machine.get('gpu')} (CUDA, TF32 off), peak host RSS" if device == "cuda" else \
        f"{machine['cpu']}, {threads} threads, peak RSS"
    lines = [f"long inputs, batch 1, {where} (ms, MiB; each run in a fresh process)"]
    lengths = sorted({r.length for r in results})
    header = f"{'case':26s}{'engine':12s}{'path':8s}" + "".join(f"{f'T={t}':>20s}" for t in lengths) + "  growth"
    lines.append(header)
    for label, *_ in CASES:
        for engine in ENGINES:
            row = [_find(results, label, engine, t) for t in lengths]
            if not any(row):
                continue
            path = next(r.path for r in row if r)
            cells = []
            for r in row:
                if r is None:
                    cells.append(f"{'':>20s}")
                elif r.median_ms is None:
                    cells.append(f"{r.note.split(':')[0]:>20s}")
                else:
                    cells.append(f"{r.median_ms:>11.0f} {r.peak_rss_mib:>7.0f}M")
            g = grown.get(label, {}) if engine == "served" else {}
            tail = f"  T^{g['exponent']:.2f}" if g else ""
            lines.append(f"{label:26s}{engine:12s}{path:8s}" + "".join(cells) + tail)
    if targets:
        lines.append("")
        lines.append("targets:")
        for t in targets:
            value = "n/a" if t["value"] is None else f"{t['value']:.3g}"
            lines.append(f"  {'MET    ' if t['met'] else 'NOT MET'}  {t['description']}: {value} "
                         f"(target {t['direction']} {t['limit']:g})")
    return "\n".join(lines)


# --- one measurement, in its own process -----------------------------------------------------------


def _one(job: dict) -> dict:
    from export.cases import MaskSpec, make_feeds
    from model.config import from_dict
    from model.mask_kinds import MaskKind
    from model.signature import input_names

    config = from_dict(job["config"])
    spec = MaskSpec(MaskKind.parse(job["kind"]), window=job["window"], step=job["step"], causal=job["causal"])
    feeds = make_feeds(config, [job["length"]], spec, seed=0)
    cuda = job.get("device") == "cuda"
    if job["engine"].startswith("torch"):
        import torch

        torch.set_num_threads(job["threads"])
        from model.encoder import build_encoder

        if job["engine"] == "torch-sdpa":
            import model.attention as attention

            def sdpa(q, k, v, allowed, scale):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale)

            attention.scaled_dot_product = sdpa
        where = "cuda" if cuda else "cpu"
        if cuda:
            torch.backends.cuda.matmul.allow_tf32 = False
        model = build_encoder(config).to(where)
        args = [torch.from_numpy(feeds[name]).to(where) for name in input_names(config)]

        def run():
            with torch.no_grad():
                model(*args)
            if cuda:
                torch.cuda.synchronize()
    else:
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = job["threads"]
        options.enable_cpu_mem_arena = job["path"] == "dense"  # as the server runs them (serve/backend/session.py)
        providers = [("CUDAExecutionProvider", {"use_tf32": "0"})] if cuda else ["CPUExecutionProvider"]
        session = ort.InferenceSession(job["graph"], options, providers=providers)
        if cuda and session.get_providers()[0] != "CUDAExecutionProvider":
            raise RuntimeError(f"no CUDA session: {session.get_providers()}")
        inputs = {i.name: feeds[i.name] for i in session.get_inputs()}
        del feeds

        def run():
            session.run(None, inputs)

    run()  # warm-up
    times = []
    for _ in range(job["repeats"]):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return {"median_ms": statistics.median(times) * 1e3, "peak_rss_mib": peak_rss_mib(), "pid": os.getpid()}


if __name__ == "__main__":
    print(json.dumps(_one(json.loads(sys.argv[1]))))
