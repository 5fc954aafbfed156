"""Building a served engine for an export directory, and retiring one: the whole load path.

`build_engine` is shared by start-up (`EncoderServer.load`) and hot reload (`EncoderServer.reload`):
read metadata.json and check the graph's sha256 (serve/backend/export_dir.py), create and check the session,
warm up, then `probe`: one real inference whose outputs must have the config's shapes and be finite.
Only an engine that passed all of that is ever served. With length_split on, a few timed dummy runs
then measure the backend's cost per session.run for the batcher's length-sorted runs
(serve/core/batch_plan.py). `retire` lets a swapped-out engine answer what it holds, then stops it.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable

import numpy as np

from model.signature import head_output

from model.config import EncoderConfig
from model.tasks import PER_TOKEN_KINDS
from serve import logs
from serve.core import batch_plan
from serve.core.attention_budget import AttentionBudget, default_budget
from serve.backend.session import CUDA, Backend, OnnxRuntimeBackend, dummy_batch
from serve.core.batch_plan import RunCost
from serve.core.batcher import Batcher
from serve.config import ServerConfig, least_run_slots
from serve.core.scheduler import Scheduler
from serve.core.engine import Engine
from serve.core.pooling import project
from serve.errors import BackendError
from serve.backend.export_dir import ExportDir, load_export

log = logging.getLogger("serve.assembly.loading")

BackendFactory = Callable[[ExportDir, ServerConfig], Backend]


def default_backend(export: ExportDir, config: ServerConfig) -> Backend:
    backend = OnnxRuntimeBackend(export, device=config.device, cuda_device_id=config.cuda_device_id,
                                 intra_op_threads=config.intra_op_threads, cuda_tf32=config.cuda_tf32,
                                 instances=config.instances, intra_op_spin=config.intra_op_spin)
    if config.fault_inject:  # tests only (serve/backend/faults.py); logs event=fault_injection_enabled
        from serve.backend.faults import FaultInjectingBackend

        return FaultInjectingBackend(backend, config.fault_inject)
    return backend


def probe(backend: Backend, export: ExportDir) -> None:
    """One real inference at a shape warm-up may not use, its mean through the projection after pooling (if
    the export has one); refuses wrong shapes or non-finite output."""
    config = export.config
    rows, length = 2, min(5, config.position_limit or 5)
    hidden, pooled = backend.encode(dummy_batch(config, rows, length))
    head = head_output(config)  # the per-row output: a head's, else the mean embedding
    if export.task in PER_TOKEN_KINDS:  # its head's output is read as the hidden states; the mean beside it
        head = None
    want_hidden = (rows, length, export.hidden_width)
    want_pooled = (rows, config.d_model if head is None else head[2][1])
    if tuple(hidden.shape) != want_hidden or tuple(pooled.shape) != want_pooled:
        raise BackendError(
            f"{export.graph_path}: probe inference gave shapes {list(hidden.shape)} / {list(pooled.shape)}, "
            f"metadata.json config says {list(want_hidden)} / {list(want_pooled)}; graph and metadata do not match"
        )
    embeddings = project(pooled, export.dense) if head is None else pooled
    if head is None and export.task not in PER_TOKEN_KINDS and embeddings.shape != (rows, export.embedding_width):
        raise BackendError(f"{export.path}: the projection after pooling gave embeddings of shape "
                           f"{list(embeddings.shape)}, metadata.json says [{rows}, {export.embedding_width}]")
    if not (np.isfinite(hidden).all() and np.isfinite(embeddings).all()):
        raise BackendError(f"{export.graph_path}: probe inference produced NaN or infinity")


def run_cost_for(backend: Backend, config: EncoderConfig, server: ServerConfig) -> RunCost | None:
    """The backend's cost per session.run for length-sorted runs (serve/core/batch_plan.py): pinned by
    split_overhead_tokens, or measured with a few dummy runs; logged. None: length_split is off."""
    if not server.length_split:
        return None
    if server.split_overhead_tokens >= 0:
        cost = RunCost.for_config(config, server.split_overhead_tokens)
    else:
        run = batch_plan.timer(lambda rows, length: backend.encode(dummy_batch(config, rows, length)))
        cost = batch_plan.calibrate(run, config, max_rows=server.max_batch_size)
    logs.event(log, "run_cost", overhead_tokens=f"{cost.overhead_tokens:.1f}",
               attention_width=f"{cost.attention_width:.0f}")
    return cost


def auto_graphs(device: str) -> tuple[str, ...]:
    """What graph "auto" prefers (else fp32): the fastest variant within fp32's parity bound."""
    import onnxruntime as ort

    cuda = device == "cuda" or (device == "auto" and CUDA in ort.get_available_providers())
    return ("fp16",) if cuda else ("optimized",)


def build_engine(export_dir: str, graph: str, config: ServerConfig, backend_factory: BackendFactory,
                 observe: Callable[..., None] | None = None, *, name: str = "",
                 scheduler: Scheduler | None = None, memory_bytes: int = 0) -> tuple[Engine, float]:
    """A started engine for `export_dir` that passed every check, and its warm-up seconds. `name`: what
    it is served as (default: the export's name); `scheduler`: the server's run slots, shared by every
    model (serve/core/scheduler.py)."""
    if not config.instances:  # 0: resolved by the repository (run_slots); alone: the device's least
        config = dataclasses.replace(config, instances=least_run_slots(config))
    export = load_export(export_dir, graph, auto=auto_graphs(config.device), long_paths=config.long_paths)
    backend = backend_factory(export, config)
    budget = AttentionBudget.for_device(export.config, backend.info.paths,
                                        config.max_attention_bytes or default_budget(), backend.info.execution_provider)
    warm_s = backend.warm_up() if config.warmup and hasattr(backend, "warm_up") else 0.0
    backend.health()
    probe(backend, export)
    if hasattr(backend, "calibrate_one_thread"):  # which runs are too small to share (serve/backend/session.py)
        backend.calibrate_one_thread(RunCost.for_config(export.config, 0.0).work)
    run_cost = run_cost_for(backend, export.config, config)
    batcher = Batcher(
        backend, export.config,
        max_batch_size=config.max_batch_size, max_batch_tokens=config.max_batch_tokens,
        max_queue_delay_s=config.max_queue_delay_ms / 1e3, max_queue_size=config.max_queue_size,
        express_run_s=config.express_run_ms / 1e3,
        observe=observe, run_cost=run_cost, budget=budget, instances=config.instances, scheduler=scheduler,
        dense=export.dense,
    )
    engine = Engine(export, backend, batcher, config, name=name, memory_bytes=memory_bytes)  # checks the tokenizer: before any thread starts
    batcher.start()
    return engine, warm_s
