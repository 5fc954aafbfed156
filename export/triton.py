"""Write a Triton Inference Server model repository from an export directory.

    repo_dir/<model_name>/config.pbtxt      # platform "onnxruntime_onnx", dims from metadata.json
    repo_dir/<model_name>/1/model.onnx      # the chosen graph, copied byte for byte
    repo_dir/<model_name>/metadata.json     # the export contract, for humans and our clients

Triton's dims exclude the batch axis when max_batch_size > 0: a symbolic axis ("sequence") becomes
-1, a fixed one stays (d_model), and a per-row input with no other axis ([batch], the mask choice)
becomes `dims: [ 1 ]` with `reshape: { shape: [ ] }`, Triton's idiom for a rank-1 batched tensor.
Only `metadata.json` is read, through model/export_format.py (no onnx, no torch), so this runs anywhere
the export directory is.

The model is the same graph the gRPC server runs: the mask choice is an input tensor per row
(mask_kind, mask_causal, mask_window, mask_step, custom_mask; see docs/export-format.md). Triton's
dynamic batcher only merges requests whose non-batch dims agree (same padded length).

What the server does after the graph is not in it: an export whose pooled embedding passes through
sentence-transformers Dense layers (metadata.json "pooling" "dense", model/projection.py) is refused
(`check_projection`), since a Triton model would answer its `mean_pooled` without them: embeddings its
owner's model never gives. Serve such an export with `python -m serve`.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from model import onnx_files
from model.export_format import METADATA_FILE, ExportError, Metadata, read_metadata

# metadata.json dtype -> Triton model_config DataType name.
TRITON_DTYPES = {
    "bool": "TYPE_BOOL",
    "int32": "TYPE_INT32",
    "int64": "TYPE_INT64",
    "float16": "TYPE_FP16",
    "float32": "TYPE_FP32",
    "float64": "TYPE_FP64",
}
ACCELERATORS = ("tensorrt", "cuda", "none")
PRECISIONS = ("FP32", "FP16")
INSTANCE_KINDS = ("KIND_GPU", "KIND_CPU", "KIND_AUTO")
BATCH_AXIS = "batch"


class TritonRepoError(ValueError):
    """An export directory or option this writer cannot turn into a Triton model."""


def check_projection(pooling: dict, name: str) -> None:
    """Refuses an export whose embeddings pass through Dense layers after pooling (metadata.json "pooling"
    "dense"): they are not in the graph, so a Triton model would answer un-projected embeddings."""
    layers = len(pooling.get("dense") or ())
    if layers:
        raise TritonRepoError(f"export {name!r}: pooling.dense has {layers} Dense layer(s) applied after the graph, "
                              "which a Triton model would not apply; serve it with `python -m serve`")


@dataclass(frozen=True)
class TritonOptions:
    max_batch_size: int = 32
    max_queue_delay_us: int = 2000
    instance_kind: str = "KIND_GPU"
    instance_count: int = 1
    accelerator: str = "tensorrt"  # GPU execution accelerator: tensorrt | cuda | none
    precision: str = "FP16"  # TensorRT precision_mode
    trt_workspace_bytes: int = 1 << 30
    trt_engine_cache_path: str = "/tmp/triton-trt-cache"

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise TritonRepoError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.instance_count < 1:
            raise TritonRepoError(f"instance_count must be >= 1, got {self.instance_count}")
        if self.accelerator not in ACCELERATORS:
            raise TritonRepoError(f"accelerator {self.accelerator!r} is not one of {', '.join(ACCELERATORS)}")
        if self.precision not in PRECISIONS:
            raise TritonRepoError(f"precision {self.precision!r} is not one of {', '.join(PRECISIONS)}")
        if self.instance_kind not in INSTANCE_KINDS:
            raise TritonRepoError(f"instance_kind {self.instance_kind!r} is not one of {', '.join(INSTANCE_KINDS)}")


def _tensor_block(key: str, spec: dict) -> str:
    """One `input [...]`/`output [...]` entry; the leading batch axis is Triton's, not ours."""
    name, dtype, dims = spec["name"], spec["dtype"], list(spec["dims"])
    if dtype not in TRITON_DTYPES:
        raise TritonRepoError(f"{key} {name!r}: dtype {dtype!r} has no Triton type")
    if not dims or dims[0] != BATCH_AXIS:
        raise TritonRepoError(f"{key} {name!r}: first axis must be {BATCH_AXIS!r}, got {dims}")
    rest = [d if isinstance(d, int) else -1 for d in dims[1:]]
    lines = ["  {", f'    name: "{name}"', f"    data_type: {TRITON_DTYPES[dtype]}"]
    if rest:
        lines.append(f"    dims: [ {', '.join(str(d) for d in rest)} ]")
    else:  # a per-row scalar: Triton needs a non-empty dims, so [1] reshaped to [] per row
        lines += ["    dims: [ 1 ]", "    reshape: { shape: [ ] }"]
    lines.append("  }")
    return "\n".join(lines)


def _optimization(options: TritonOptions) -> list[str]:
    if options.instance_kind == "KIND_CPU" or options.accelerator == "none":
        return []
    if options.accelerator == "tensorrt":
        params = {
            "precision_mode": options.precision,
            "max_workspace_size_bytes": str(options.trt_workspace_bytes),
            "trt_engine_cache_enable": "1",
            "trt_engine_cache_path": options.trt_engine_cache_path,
        }
    else:  # cuda: ONNX Runtime's CUDA execution provider, options as the ORT backend reads them
        params = {"cudnn_conv_algo_search": "0", "use_ep_level_unified_stream": "1"}
    body = "\n".join(f'        parameters {{ key: "{k}" value: "{v}" }}' for k, v in params.items())
    return [
        "optimization {",
        "  execution_accelerators {",
        "    gpu_execution_accelerator: [",
        "      {",
        f'        name: "{options.accelerator}"',
        body,
        "      }",
        "    ]",
        "  }",
        "}",
    ]


def triton_config(metadata: Metadata, model_name: str, options: TritonOptions = TritonOptions()) -> str:
    """config.pbtxt text for the export described by `metadata` (model/export_format.py)."""
    inputs = ",\n".join(_tensor_block("input", s) for s in metadata.inputs)
    outputs = ",\n".join(_tensor_block("output", s) for s in metadata.outputs)
    lines = [
        f"# Written by export/triton.py from {metadata.format} export {metadata.name!r}.",
        f'name: "{model_name}"',
        'platform: "onnxruntime_onnx"',
        f"max_batch_size: {options.max_batch_size}",
        f"input [\n{inputs}\n]",
        f"output [\n{outputs}\n]",
        "dynamic_batching {",
        f"  max_queue_delay_microseconds: {options.max_queue_delay_us}",
        "}",
        "instance_group [",
        f"  {{ count: {options.instance_count} kind: {options.instance_kind} }}",
        "]",
        *_optimization(options),
    ]
    return "\n".join(lines) + "\n"


def write_triton_repo(
    export_dir: str | Path,
    repo_dir: str | Path,
    *,
    model_name: str | None = None,
    graph: str = "fp32",
    version: int = 1,
    max_batch_size: int = 32,
    max_queue_delay_us: int = 2000,
    instance_kind: str = "KIND_GPU",
    instance_count: int = 1,
    accelerator: str = "tensorrt",
    precision: str = "FP16",
) -> Path:
    """Writes `repo_dir/<model_name>/` (replacing an existing one whole) and returns its path.

    model_name defaults to the export's name; graph picks a metadata.json "graphs" entry.
    Raises TritonRepoError for a missing/unknown export, graph or option, and for an export with a
    projection after pooling (`check_projection`).
    """
    export_dir = Path(export_dir)
    options = TritonOptions(max_batch_size=max_batch_size, max_queue_delay_us=max_queue_delay_us,
                            instance_kind=instance_kind, instance_count=instance_count,
                            accelerator=accelerator, precision=precision)
    if version < 1:
        raise TritonRepoError(f"version must be >= 1, got {version}")
    try:
        metadata = read_metadata(export_dir)
    except ExportError as exc:
        raise TritonRepoError(f"{export_dir} is not an export directory: {exc}") from None
    check_projection(metadata.pooling, metadata.name)
    if graph not in metadata.graphs:
        raise TritonRepoError(f"graph {graph!r} not in {export_dir / METADATA_FILE} "
                              f"(has: {', '.join(metadata.graphs)})")
    source = export_dir / metadata.graphs[graph].file
    if not source.is_file():
        raise TritonRepoError(f"{source} is missing")
    model_name = model_name or metadata.name
    config_text = triton_config(metadata, model_name, options)

    repo_dir = Path(repo_dir)
    repo_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=repo_dir, prefix=f".{model_name}.staging-"))
    target = repo_dir / model_name
    try:
        (staging / str(version)).mkdir()
        onnx_files.copy(source, staging / str(version) / "model.onnx")  # with its external data files
        shutil.copyfile(export_dir / METADATA_FILE, staging / METADATA_FILE)
        (staging / "config.pbtxt").write_text(config_text)
        staging.chmod(0o755)
        if target.exists():
            backup = repo_dir / f".{model_name}.old-{os.getpid()}"
            os.rename(target, backup)
            shutil.rmtree(backup, ignore_errors=True)
        os.rename(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target
