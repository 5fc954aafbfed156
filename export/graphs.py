"""The graph variants an export directory can hold, as data.

"fp32" is the graph torch.onnx writes; every other variant is derived from it by a `build`
function (path of the fp32 graph, path to write, config) and validated against the same PyTorch
reference with its own documented tolerance before the export is reported as written.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from export.contract import FP32_TOLERANCE
from export.optimize import build_fp16, build_int8, build_optimized
from model.attention_paths import DENSE, LINEAR, SPARSE, long_path
from model.config import EncoderConfig

Build = Callable[[str, str, EncoderConfig], None]


@dataclass(frozen=True)
class GraphVariant:
    name: str
    file: str
    tolerance: dict
    build: Build | None = None  # None: the graph torch.onnx.export writes
    description: str = ""
    path: str = DENSE  # the attention path (model/attention_paths.py); long paths are exported by torch too
    # Execution providers the export validates it on (a CUDA-only graph could not be checked here).
    validate_on: tuple[str, ...] = field(default=("CPUExecutionProvider",))


GRAPHS: dict[str, GraphVariant] = {
    "fp32": GraphVariant("fp32", "model.onnx", dict(FP32_TOLERANCE), None, "torch.onnx.export (dynamo), float32"),
    # Same arithmetic as fp32, fewer kernels: the fp32 tolerance applies unchanged.
    "optimized": GraphVariant(
        "optimized", "model.optimized.onnx", dict(FP32_TOLERANCE), build_optimized,
        "fp32 with attention fused into contrib Attention (packed QKV) + ORT_ENABLE_EXTENDED fusions, saved offline",
    ),
    # int8 weights move every hidden value a little: judged on the direction of the pooled vector.
    "int8": GraphVariant(
        "int8", "model.int8.onnx", {"metric": "min_cosine", "limit": 0.999}, build_int8,
        "dynamic int8 quantisation (QInt8 weights per channel in a 7-bit range, QAttention) of the "
        "fused-attention graph, for CPU",
    ),
    # Built for CUDA; ONNX Runtime's CPU provider runs it too (casting around the kernels it lacks
    # in float16), so the export validates it here.
    "fp16": GraphVariant(
        "fp16", "model.fp16.onnx", {"metric": "min_cosine", "limit": 0.9999}, build_fp16,
        "float16 weights and arithmetic, float32 inputs/outputs, for CUDA",
    ),
    # The long-input paths: the same weights, attention computed at its own cost. Served beside a dense
    # graph for the rows whose mask kind they compute (the server picks per row; serve/core/batcher.py).
    "sparse": GraphVariant(
        "sparse", "model.sparse.onnx", dict(FP32_TOLERANCE), None,
        "softmax attention for sliding_window/dilated/local_strided rows at O(T·w + T²/k): blocked band + "
        "interleaved sub-sequences, no [T, T] tensor", path=SPARSE,
    ),
    "linear": GraphVariant(
        "linear", "model.linear.onnx", dict(FP32_TOLERANCE), None,
        "linear/performer attention for bidirectional/causal rows at O(T): φ(K)ᵀV, chunked prefix sums",
        path=LINEAR,
    ),
}
# `--graphs long` names the long-input graph of the config's attention kind (none for additive).
LONG = "long"


def resolve(names: tuple[str, ...], config: EncoderConfig) -> tuple[str, ...]:
    """The graph variants to build for `config`: fp32 first, "long" replaced by the config's long
    path (dropped where it has none), each once."""
    out = ["fp32"]
    for name in names:
        if name == LONG:
            name = long_path(config) or ""
        if name and name not in out:
            out.append(name)
    return tuple(out)
