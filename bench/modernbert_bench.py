"""`python -m bench.modernbert_bench`: a ModernBERT-base-shaped encoder at long lengths, batch 1.

The checkpoint is transformers' ModernBertModel at random initialisation of ModernBertConfig()'s
defaults (768 wide, 12 heads, 22 layers: 8 global, 14 local with window 128, i.e. |i - j| <= 64),
saved and exported by `python -m export --from-pretrained` (fp32 + long-input graph). Engines, each
in a fresh process (its own peak RSS), bidirectional rows (what an embedding request sends):

  long      model.sparse.onnx: the model's own plan, local layers banded, global layers every pair in tiles
  dense     model.onnx: every layer computes all T x T pairs, the local ones masked to their window
  hf-sdpa   transformers' ModernBertModel, attn_implementation="sdpa" (masks, computes every pair)
  hf-eager  transformers' ModernBertModel, eager attention (the parity reference)

Time is one timed run after one warm-up run (the runs are long); `--lengths` and `--engines` choose.
`--device cuda`: every engine on the GPU (ONNX Runtime's CUDA provider with TF32 off, as the server runs
it; PyTorch with its inputs there, synchronised), and the device memory in use after the run beside
the host's peak RSS (NVML; one engine runs at a time, and both allocators keep their peak pools).
The arithmetic bound of long vs dense at 8192: projections and FFN are equal, attention is 8/22 of
dense's, about 1.8x overall.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.harness import peak_rss_mib

ENGINES = ("long", "dense", "hf-sdpa", "hf-eager")


def build(directory: Path, layers: int | None = None) -> Path:
    """ModernBERT-base shape at random init saved into directory/checkpoint, exported to directory/export."""
    import torch
    from transformers import ModernBertConfig, ModernBertModel

    from export.cli import main as export_main

    checkpoint = directory / "checkpoint"
    config = ModernBertConfig(pad_token_id=0, **({"num_hidden_layers": layers} if layers else {}))
    torch.manual_seed(0)
    ModernBertModel(config).eval().save_pretrained(str(checkpoint))
    code = export_main(["--from-pretrained", str(checkpoint), "--out-dir", str(directory), "--name", "export",
                        "--graphs", "fp32,long", "--quiet"])
    if code:
        raise SystemExit(f"export failed ({code})")
    return directory


def _device_used_mib() -> float | None:
    """Memory in use on GPU 0 (NVML): this process's pools plus its CUDA context, the only process there."""
    try:
        import pynvml
    except ImportError:
        return None
    pynvml.nvmlInit()
    try:
        return pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).used / 2**20
    finally:
        pynvml.nvmlShutdown()


def one(directory: Path, engine: str, length: int, threads: int, device: str = "cpu") -> dict:
    """One measurement in this process."""
    import numpy as np

    ids = np.random.default_rng(0).integers(5, 50000, (1, length)).astype(np.int64)
    mask = np.ones((1, length), np.int64)
    if engine.startswith("hf"):
        import torch
        from transformers import ModernBertModel

        torch.set_num_threads(threads)
        model = ModernBertModel.from_pretrained(str(directory / "checkpoint"),
                                                attn_implementation=engine.split("-")[1]).eval().to(device)
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 products, as the ONNX sessions run them
        ids_t, mask_t = torch.from_numpy(ids).to(device), torch.from_numpy(mask).to(device)

        def run():
            with torch.no_grad():
                return model(input_ids=ids_t, attention_mask=mask_t).last_hidden_state.cpu().numpy()
    else:
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        # as the server runs them (serve/backend/session.py): the arena on the dense graph only; ENCODER_BENCH_NO_ARENA=1
        # turns it off there too (ModernBERT-base's dense graph at 8192 does not fit 23 GiB with it)
        options.enable_cpu_mem_arena = engine == "dense" and not os.environ.get("ENCODER_BENCH_NO_ARENA")
        graph = directory / "export" / ("model.sparse.onnx" if engine == "long" else "model.onnx")
        providers = [("CUDAExecutionProvider", {"use_tf32": "0"})] if device == "cuda" else ["CPUExecutionProvider"]
        session = ort.InferenceSession(str(graph), options, providers=providers)
        if session.get_providers()[0] != providers[0][0] and device == "cuda":
            raise SystemExit(f"CUDAExecutionProvider not available: {session.get_providers()}")
        feeds = {"input_ids": ids, "attention_mask": mask, "mask_kind": np.zeros(1, np.int64),
                 "mask_causal": np.zeros(1, bool), "mask_window": np.zeros(1, np.int64),
                 "mask_step": np.ones(1, np.int64), "custom_mask": np.ones((1, length, length), bool)}
        inputs = {i.name: feeds[i.name] for i in session.get_inputs()}

        def run():
            return session.run(["last_hidden_state"], inputs)[0]

    started = time.perf_counter()
    run()
    warm = time.perf_counter() - started
    started = time.perf_counter()
    hidden = run()
    elapsed = time.perf_counter() - started
    np.save(directory / f"hidden-{engine}-{length}.npy", hidden)  # for the parity column
    result = {"engine": engine, "length": length, "ms": elapsed * 1e3, "warmup_ms": warm * 1e3,
              "peak_rss_mib": peak_rss_mib(), "device": device}
    if device == "cuda":
        result["device_used_mib"] = _device_used_mib()
    return result


def _difference(directory: Path, first: str, engine: str, length: int) -> float | None:
    """max |hidden(engine) - hidden(first engine)| at this length (every position is real here)."""
    import numpy as np

    a, b = (directory / f"hidden-{e}-{length}.npy" for e in (first, engine))
    return float(np.abs(np.load(a) - np.load(b)).max()) if a.is_file() and b.is_file() else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.modernbert_bench", description=__doc__.split("\n")[0])
    parser.add_argument("--dir", type=Path, help="reuse (or build into) this directory")
    parser.add_argument("--lengths", default="8192")
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: ONNX Runtime's CUDA provider and PyTorch on the GPU (needs onnxruntime-gpu)")
    parser.add_argument("--layers", type=int, help="fewer layers than ModernBERT-base's 22 (smoke runs)")
    parser.add_argument("--out", type=Path, default=Path("bench-results/modernbert.json"))
    parser.add_argument("--one", nargs=2, metavar=("ENGINE", "LENGTH"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    directory = args.dir or Path(tempfile.mkdtemp(prefix="modernbert-bench-"))
    if args.one:
        print(json.dumps(one(directory, args.one[0], int(args.one[1]), args.threads, args.device)))
        return 0
    if not (directory / "export" / "metadata.json").is_file():
        started = time.perf_counter()
        build(directory, args.layers)
        print(f"built and exported in {time.perf_counter() - started:.0f} s: {directory}", file=sys.stderr)
    results = []
    for length in (int(n) for n in args.lengths.split(",")):
        for engine in args.engines.split(","):
            proc = subprocess.run([sys.executable, "-m", "bench.modernbert_bench", "--dir", str(directory),
                                   "--threads", str(args.threads), "--device", args.device,
                                   "--one", engine, str(length)],
                                  capture_output=True, text=True)
            if proc.returncode:
                result = {"engine": engine, "length": length, "error": (proc.stderr or "")[-300:] or f"rc {proc.returncode}"}
            else:
                result = json.loads(proc.stdout.strip().splitlines()[-1])
                result["max_abs_vs_first"] = _difference(directory, args.engines.split(",")[0], engine, length)
            results.append(result)
            print(json.dumps(result), file=sys.stderr, flush=True)
    print(f"{'engine':10} {'T':>6} {'ms':>10} {'peak RSS MiB':>13} {'vs long':>8} {'max |diff| vs first':>20}"
          + (f" {'GPU used MiB':>13}" if args.device == "cuda" else ""))
    for r in results:
        if "error" in r:
            print(f"{r['engine']:10} {r['length']:>6} failed: {r['error'][-120:]!r}")
            continue
        base = next((x["ms"] for x in results if x["engine"] == "long" and x["length"] == r["length"] and "ms" in x), None)
        ratio = f"{r['ms'] / base:.2f}x" if base else ""
        diff = r.get("max_abs_vs_first")
        used = r.get("device_used_mib")
        print(f"{r['engine']:10} {r['length']:>6} {r['ms']:>10.0f} {r['peak_rss_mib']:>13.0f} {ratio:>8} "
              f"{'' if diff is None else f'{diff:.2e}':>20}" + (f" {used:>13.0f}" if used is not None else ""))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"threads": args.threads, "device": args.device, "directory": str(directory), "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
