"""The export contract as data (after Optimum's OnnxConfig): input and output names with their
dtypes and symbolic axes, the opset and the tolerance. The exporter derives everything it passes to
`torch.onnx.export` from this object, and metadata.json records it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from model.attention_paths import DENSE
from model.config import EncoderConfig
from model.signature import input_specs, output_specs

DEFAULT_OPSET = 18
# onnxruntime 1.31 reads IR version <= 13; onnx 1.23 writes 14 unless told otherwise.
MAX_IR_VERSION = 13
# Hidden states and pooled vectors: PyTorch vs ONNX Runtime, absolute.
FP32_TOLERANCE = {"metric": "max_abs", "limit": 1e-4}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str
    dims: tuple[str | int, ...]  # str = symbolic axis, int = fixed

    def as_dict(self) -> dict:
        return {"name": self.name, "dtype": self.dtype, "dims": list(self.dims)}


@dataclass(frozen=True)
class ExportContract:
    config: EncoderConfig
    opset: int = DEFAULT_OPSET
    tolerance: dict = field(default_factory=lambda: dict(FP32_TOLERANCE))
    path: str = DENSE  # the attention path of the graph (model/attention_paths.py)

    @property
    def inputs(self) -> tuple[TensorSpec, ...]:
        return tuple(TensorSpec(*spec) for spec in input_specs(self.config, self.path))

    @property
    def outputs(self) -> tuple[TensorSpec, ...]:
        return tuple(TensorSpec(*spec) for spec in output_specs(self.config))

    def dynamic_axes(self) -> dict[str, dict[int, str]]:
        """{"input_ids": {0: "batch", 1: "sequence"}, ...} for inputs and outputs."""
        return {
            spec.name: {i: dim for i, dim in enumerate(spec.dims) if isinstance(dim, str)}
            for spec in (*self.inputs, *self.outputs)
        }
