"""Export an encoder to a validated export directory (graph files + metadata.json).

`export_onnx` writes one graph; `export_model` builds the whole directory under a temporary name,
validates every graph against PyTorch, writes metadata.json and only then renames it into place,
so a failure leaves nothing half-written where the server looks.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import onnx
import torch

from export.cases import MaskSpec, make_feeds, validation_cases
from export.contract import MAX_IR_VERSION, ExportContract
from export.graphs import GRAPHS, LONG, resolve
from export.long_graphs import translation_table
from export import trace_cache
from export.metadata import build_metadata
from export.validate import ValidationReport, validate
from model.attention_paths import DENSE, MAX_SEQUENCE, long_path
from model.config import EncoderConfig
from model.encoder import Encoder, build_encoder, with_path
from model import onnx_files
from model.host_memory import memory_free as available_memory  # the one reading of the cgroup
from model.export_format import ExportError, GraphEntry, Metadata, TokenizerEntry, sha256_file, write_metadata
from model.tasks import TaskError, check_task, task_for

# torch.onnx warns once per missing torchvision op; irrelevant to an encoder.
logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)

Progress = Callable[[str], None]

# The sample traced at export (batch 2, length 16): validation uses other shapes on purpose.
SAMPLE_LENGTHS = [16, 9]


@dataclass
class GraphResult:
    name: str
    path: Path
    report: ValidationReport
    seconds: float


@dataclass
class ExportResult:
    directory: Path
    metadata: Metadata
    graphs: list[GraphResult]


def export_onnx(model: Encoder, contract: ExportContract, path: str | Path, *, external_data: bool = False) -> None:
    """torch.onnx.export (dynamo) of `model` on the contract's attention path, with symbolic batch and
    sequence axes taken from the contract. Long-input paths translate their attention op into the
    O(T·w) / O(T) subgraphs of export/long_graphs.py."""
    path = Path(path)
    model = with_path(model, contract.path)
    kwargs, dynamic = trace_arguments(contract)
    trace_cache.traced(model, contract, path, external_data,
                       lambda out: _trace(model, contract, out, kwargs, dynamic, external_data))


def trace_arguments(contract: ExportContract) -> tuple[dict, dict]:
    """The sample inputs torch.export traces with (Encoder.forward's keyword arguments) and their symbolic batch and
    sequence axes."""
    config = contract.config
    feeds = make_feeds(config, SAMPLE_LENGTHS, MaskSpec(), seed=0)
    batch = torch.export.Dim("batch", min=1, max=4096)
    sequence = torch.export.Dim("sequence", min=1, max=config.position_limit or MAX_SEQUENCE)
    axis = {"batch": batch, "sequence": sequence}
    # Encoder.forward's parameters are named as the graph inputs, but for the first ("inputs").
    param = {spec.name: ("inputs" if i == 0 else spec.name) for i, spec in enumerate(contract.inputs)}
    kwargs = {param[s.name]: torch.from_numpy(feeds[s.name]) for s in contract.inputs}
    dynamic = {
        param[spec.name]: {i: axis[d] for i, d in enumerate(spec.dims) if isinstance(d, str)}
        for spec in contract.inputs
    }
    return kwargs, dynamic


def _trace(model: Encoder, contract: ExportContract, path: Path, kwargs: dict, dynamic: dict,
           external_data: bool) -> None:
    # Traced in inference mode: no autograd bookkeeping while torch.export traces and decomposes the model
    # (13 % less time on the tiny models of the suite; the same graphs: docs/export-format.md).
    with warnings.catch_warnings(), torch.inference_mode():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            model,
            (),
            kwargs=kwargs,
            dynamic_shapes=dynamic,
            input_names=[s.name for s in contract.inputs],
            output_names=[s.name for s in contract.outputs],
            opset_version=contract.opset,
            dynamo=True,
            verbose=False,
            custom_translation_table=None if contract.path == DENSE else translation_table(),
        )
    program.save(str(path), external_data=True if external_data else None)  # None: external over 2 GB
    onnx_files.cap_ir_version(path, MAX_IR_VERSION)


# Peak resident memory of an export, per byte of the model's float32 weights: the PyTorch model, the
# exporter's copy of the graph, ONNX Runtime's session while validating and the optimizer's copy
# (measured on an XLM-RoBERTa of bge-m3's shape, 2.12 GiB of weights: 10.1 GiB peak for fp32,
# optimized and sparse, 4.8x; 13.6 GiB for fp32 and int8, 6.4x, the quantizer holding copies of its
# own; docs/export-format.md). fp16 is taken to cost what int8 does (not measured).
PEAK_PER_WEIGHT_BYTE = 5.0
PEAK_PER_WEIGHT_BYTE_CONVERTED = 7.0  # with an int8 or fp16 graph


def check_memory(config: EncoderConfig, model: Encoder | None, graphs: tuple[str, ...] = ("fp32",)) -> int:
    """The export's expected peak memory in bytes; ExportError naming the need when the host cannot hold
    it (checked before any graph is written, so a big model fails in seconds, not in swap). `model` None:
    its weights counted from `config` alone (an Encoder on the meta device, no memory), so that a checkpoint
    too big for the host is refused before its weights are read (export/cli.py)."""
    if model is None:
        with torch.device("meta"):
            model = Encoder(config)
    weights = sum(p.numel() * 4 for p in model.parameters())
    factor = PEAK_PER_WEIGHT_BYTE_CONVERTED if {"int8", "fp16"} & set(graphs) else PEAK_PER_WEIGHT_BYTE
    need = int(weights * factor)
    free = available_memory()
    if free and need > free:
        raise ExportError(
            f"exporting {config.name} needs about {need / (1 << 30):.1f} GiB of memory "
            f"({factor:g} x its {weights / (1 << 30):.2f} GiB of float32 weights); this host has "
            f"{free / (1 << 30):.1f} GiB available; export on a host with more memory")
    return need


def _check_writable(out_dir: Path) -> None:
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out_dir, prefix=".write-check-"):
            pass
    except OSError as exc:
        raise ExportError(f"output directory {out_dir} is not writable: {exc.strerror or exc}") from None


def _swap_into_place(staging: Path, target: Path) -> None:
    """Rename `staging` to `target`; an existing target is moved aside first, then removed."""
    backup = None
    if target.exists():
        backup = target.with_name(f".{target.name}.old-{os.getpid()}")
        os.rename(target, backup)
    os.rename(staging, target)
    if backup is not None:
        shutil.rmtree(backup, ignore_errors=True)


def export_model(
    config: EncoderConfig,
    out_dir: str | Path,
    *,
    model: Encoder | None = None,
    opset: int | None = None,
    graphs: tuple[str, ...] = ("fp32",),
    extra_files: dict[str, Path] | None = None,
    tokenizer: TokenizerEntry | None = None,
    pooling: dict | None = None,
    task: dict | None = None,
    prompts: dict | None = None,
    default_prompt_name: str | None = None,
    long_length: int = 67,
    progress: Progress | None = None,
    external_data: bool = False,
) -> ExportResult:
    """Export `model` (default: the seeded encoder for `config`) into `out_dir/config.name/`.

    extra_files: name -> source path copied into the directory (e.g. tokenizer.json).
    task: metadata.json's "task" (model/tasks.py); default: task_for(config), {"kind": "embed"} without a head.
    external_data: every graph's weights as ONNX external data (model/onnx_files.py); without it, only
    graphs whose weights exceed onnx_files.EXTERNAL_BYTES (protobuf's 2 GB limit). The external tensors
    of all the graphs end in one file, each distinct tensor once (onnx_files.share_data).
    Raises ExportError (model/export_format.py) for bad requests and
    export.validate.ExportValidationError when a graph does not match PyTorch; in both cases nothing
    is left in out_dir.
    """
    say = progress or (lambda _msg: None)
    unknown = [g for g in graphs if g not in GRAPHS and g != LONG]
    if unknown:
        raise ExportError(f"unknown graph variant(s) {', '.join(unknown)}; known: {', '.join(GRAPHS)}, {LONG}")
    graphs = resolve(tuple(graphs), config)
    wrong = [g for g in graphs if GRAPHS[g].path not in (DENSE, long_path(config))]
    if wrong:
        raise ExportError(f"graph variant(s) {', '.join(wrong)} do not apply to attention={config.attention!r} "
                          f"(its long-input graph: {long_path(config) or 'none'})")
    if "fp16" in graphs and config.positional == "rotary":
        # onnxruntime's float16 converter casts the rotary angles (t·θ^(-2k/d), t in the thousands) to
        # float16, where positions past 2048 are not exact, and its casts around blocked nodes break
        # the graph's order: not built for rotary configs yet.
        raise ExportError("graph variant fp16 is not built for positional='rotary' (rotary angles need "
                          "float32); export fp32, optimized, long or int8")
    try:
        task = check_task(task, config) if task is not None else task_for(config)
    except TaskError as exc:
        raise ExportError(f"[{config.name}] {exc}") from None
    out_dir = Path(out_dir)
    _check_writable(out_dir)
    model = (model or build_encoder(config)).eval()
    need = check_memory(config, model, graphs)
    say(f"[{config.name}] expected peak memory about {need / (1 << 30):.2f} GiB")
    contract = ExportContract(config, **({"opset": opset} if opset else {}))
    contracts = {name: dataclasses.replace(contract, path=GRAPHS[name].path) for name in graphs}
    target = out_dir / config.name
    staging = Path(tempfile.mkdtemp(dir=out_dir, prefix=f".{config.name}.staging-"))
    try:
        results: list[GraphResult] = []
        for name in graphs:
            variant = GRAPHS[name]
            path = staging / variant.file
            cases = validation_cases(config, long_length=long_length, path=variant.path)
            started = time.perf_counter()
            if variant.build is None:
                say(f"[{config.name}] exporting {name} with torch.onnx (dynamo, opset {contract.opset}, "
                    f"{variant.path} attention)")
                export_onnx(model, contracts[name], path, external_data=external_data)
            else:
                say(f"[{config.name}] building {name} from fp32")
                variant.build(str(staging / GRAPHS["fp32"].file), str(path), config)
            say(f"[{config.name}] validating {name} on {len(cases)} cases vs PyTorch")
            report = validate(str(path), model, contracts[name], cases, tolerance=variant.tolerance,
                              providers=variant.validate_on)
            results.append(GraphResult(name, path, report, time.perf_counter() - started))
            say(f"[{config.name}] {name}: {report.metric} worst {report.worst:.3g} "
                f"(limit {report.limit:g}) over {report.cases} cases")
        if any(onnx_files.is_external(r.path) for r in results):
            say(f"[{config.name}] writing the graphs' external weights to one file, each tensor once")
            onnx_files.share_data([r.path for r in results])
        used = {r.name: onnx_files.tensor_bytes(r.path) for r in results}  # per graph: data file -> its tensors' bytes
        data = {name: {"file": name, "sha256": sha256_file(staging / name), "bytes": (staging / name).stat().st_size}
                for name in dict.fromkeys(f for files in used.values() for f in files)}  # each shared file hashed once
        for name, source in (extra_files or {}).items():
            shutil.copyfile(source, staging / name)
        metadata = build_metadata(
            contract,
            graphs={r.name: GraphEntry(
                        file=GRAPHS[r.name].file, sha256=sha256_file(r.path), bytes=r.path.stat().st_size,
                        data=tuple({**data[name], "tensor_bytes": n} for name, n in used[r.name].items()),
                        ir_version=int(onnx.load(str(r.path), load_external_data=False).ir_version),
                        description=GRAPHS[r.name].description, attention_path=GRAPHS[r.name].path,
                        inputs=tuple(s.as_dict() for s in contracts[r.name].inputs),
                        tolerance=dict(GRAPHS[r.name].tolerance), validation=r.report.as_dict())
                    for r in results},
            tokenizer=tokenizer,
            pooling=pooling,
            task=task,
            prompts=prompts,
            default_prompt_name=default_prompt_name,
        )
        write_metadata(staging, metadata)
        staging.chmod(0o755)  # mkdtemp makes it 0700; the server may run as another user
        _swap_into_place(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    for r in results:
        r.path = target / r.path.name
    return ExportResult(target, metadata, results)

