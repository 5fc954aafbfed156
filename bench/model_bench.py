"""Model benchmark: PyTorch eager vs ONNX Runtime sessions, one (batch, length) point at a time.

Every timing is the median wall time of repeated calls after warm-up, the engines compared at a
point taking turns in blocks (see time_interleaved), on inputs built by export.cases.make_feeds
(bidirectional mask, every row full length).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from bench.encoder_flops import encoder_flops
from export.cases import MaskSpec, make_feeds
from model.config import EncoderConfig
from serve.backend.session import cuda_options


@dataclass(frozen=True)
class SessionSettings:
    """The ONNX Runtime knobs the tuning step varies."""

    intra_op_threads: int
    optimization: str = "all"  # basic | extended | all | disabled
    execution_mode: str = "sequential"  # sequential | parallel
    inter_op_threads: int = 1
    allow_spinning: bool = True

    def label(self) -> str:
        spin = "" if self.allow_spinning else ",no-spin"
        return (f"intra={self.intra_op_threads},opt={self.optimization},{self.execution_mode}"
                f"{',inter=' + str(self.inter_op_threads) if self.execution_mode == 'parallel' else ''}{spin}")


# The server's CUDA options (TF32 off), so in-process and served sessions run the same kernels.
CUDA_PROVIDERS = [("CUDAExecutionProvider", cuda_options()), "CPUExecutionProvider"]


def make_session(path: str, settings: SessionSettings, providers: list[str] | None = None):
    import onnxruntime as ort

    levels = {
        "disabled": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
        "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
        "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
        "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
    }
    options = ort.SessionOptions()
    options.graph_optimization_level = levels[settings.optimization]
    options.intra_op_num_threads = settings.intra_op_threads
    options.inter_op_num_threads = settings.inter_op_threads
    options.execution_mode = (ort.ExecutionMode.ORT_PARALLEL if settings.execution_mode == "parallel"
                              else ort.ExecutionMode.ORT_SEQUENTIAL)
    options.add_session_config_entry("session.intra_op.allow_spinning", "1" if settings.allow_spinning else "0")
    return ort.InferenceSession(path, options, providers=providers or ["CPUExecutionProvider"])


def bench_feeds(config: EncoderConfig, batch: int, length: int, seed: int = 0) -> dict[str, np.ndarray]:
    return make_feeds(config, [length] * batch, MaskSpec(), seed=seed, padded_to=length)


def time_interleaved(runners: dict[str, Callable[[], object]], *, warmup: int, repeats: int,
                     budget_s: float, rounds: int = 4) -> dict[str, dict]:
    """Median (and spread) per runner of up to `repeats` timed calls after `warmup` calls each.

    The runners take turns in blocks: each round, each runner makes one untimed call and then a
    block of timed calls (rotating the order every round), so a slow spell of the machine falls on
    all of them alike. Blocks rather than single calls: PyTorch's OpenMP threads and ONNX Runtime's
    pool keep spinning for a while after a call, and alternating call by call made each engine run
    beside the other's spinning threads (measured: ORT fp32 at (8,256) 224 ms interleaved per call,
    150 ms per block). Stops after the round that passes `budget_s` once 2 rounds are in.
    """
    names = list(runners)
    for name in names:
        for _ in range(warmup):
            runners[name]()
    block = max(1, -(-repeats // rounds))
    times: dict[str, list[float]] = {name: [] for name in names}
    started = time.perf_counter()
    for round_ in range(rounds):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            runners[name]()  # untimed: lets the previous engine's threads go idle
            for _ in range(min(block, repeats - len(times[name]))):
                t0 = time.perf_counter()
                runners[name]()
                times[name].append(time.perf_counter() - t0)
        if round_ >= 1 and time.perf_counter() - started > budget_s:
            break
    return {name: {"median_ms": 1e3 * statistics.median(t), "min_ms": 1e3 * min(t), "max_ms": 1e3 * max(t),
                   "runs": len(t)} for name, t in times.items()}


def matmul_gflops(threads: int, n: int = 2048, repeats: int = 10, device: str = "cpu") -> float:
    """Single-precision GEMM rate of this machine: torch.matmul on (n, n) x (n, n), best of `repeats`
    after warm-up, at `threads` threads (the peak a dense model could approach). On cuda: plain fp32
    (TF32 off, PyTorch's default for matmul)."""
    import torch

    torch.set_num_threads(threads)
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    out = torch.empty(n, n, device=device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(2):
        torch.matmul(a, b, out=out)
    sync()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.matmul(a, b, out=out)
        sync()
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best / 1e9


def torch_runner(model, feeds: dict[str, np.ndarray], input_order: list[str],
                 device: str = "cpu") -> Callable[[], object]:
    """PyTorch eager on `device`; on cuda the inputs live on the GPU and each call waits for the result."""
    import torch

    args = [torch.from_numpy(np.ascontiguousarray(feeds[name])).to(device) for name in input_order]
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def run():
        with torch.no_grad():
            out = model(*args)
        sync()
        return out

    return run


def ort_runner(session, feeds: dict[str, np.ndarray]) -> Callable[[], object]:
    names = [o.name for o in session.get_outputs()]
    return lambda: session.run(names, feeds)


def point_row(config: EncoderConfig, batch: int, length: int, engine: str, timing: dict) -> dict:
    flops = encoder_flops(config, batch, length)
    return {"engine": engine, "batch": batch, "length": length, **timing,
            "gflop": flops / 1e9, "gflops_per_s": flops / 1e9 / (timing["median_ms"] / 1e3)}
