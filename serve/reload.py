"""Building an engine for an export directory, and swapping models without downtime.

`build_engine` is the whole load path (start-up and reload share it): read metadata.json and check
the graph's sha256 (serve/export_dir.py), create and check the session, warm up, then `probe`: one
real inference whose outputs must have the config's shapes and be finite. Only an engine that
passed all of that is ever served. With length_split on, a few timed dummy runs then measure the
backend's cost per session.run for the batcher's length-sorted runs (serve/batch_plan.py).

`reload_model(server, export_dir)` builds the new engine beside the old one while the old keeps
serving, then swaps the server's engine reference under its lock (one assignment: a request sees
the old engine or the new one, never a mix). The old engine is retired in the background: its
batcher finishes what it holds (requests admitted before the swap answer from the old model, and
say so in `metadata.model_sha256`), then stops. Any failure before the swap raises ModelRefused and
changes nothing. Triggered by `encoder.v1.AdminService/ReloadModel` (`--admin`) or SIGHUP.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Callable

import numpy as np

from model.config import EncoderConfig
from serve import batch_plan, logs
from serve.attention_budget import AttentionBudget, default_budget
from serve.backend import CUDA, Backend, dummy_batch
from serve.batch_plan import RunCost
from serve.batcher import Batcher
from serve.config import ServerConfig
from serve.engine import Engine
from serve.errors import BackendError, ModelRefused, Overloaded, ServeError, Unavailable
from serve.export_dir import ExportDir, load_export
from serve.pb import pb  # noqa: F401  (generates serve/_proto first when stale)
from serve._proto.encoder.v1 import admin_pb2, admin_pb2_grpc  # noqa: E402

if TYPE_CHECKING:
    from serve.app import EncoderServer

log = logging.getLogger("serve.reload")

BackendFactory = Callable[[ExportDir, ServerConfig], Backend]
RETIRE_SETTLE_S = 0.5  # after the old batcher drains, how long it still accepts stragglers


def probe(backend: Backend, export: ExportDir) -> None:
    """One real inference at a shape warm-up may not use; refuses wrong shapes or non-finite output."""
    config = export.config
    rows, length = 2, min(5, config.position_limit or 5)
    hidden, pooled = backend.encode(dummy_batch(config, rows, length))
    want_hidden, want_pooled = (rows, length, config.d_model), (rows, config.d_model)
    if tuple(hidden.shape) != want_hidden or tuple(pooled.shape) != want_pooled:
        raise BackendError(
            f"{export.graph_path}: probe inference gave shapes {list(hidden.shape)} / {list(pooled.shape)}, "
            f"metadata.json config says {list(want_hidden)} / {list(want_pooled)}; graph and metadata do not match"
        )
    if not (np.isfinite(hidden).all() and np.isfinite(pooled).all()):
        raise BackendError(f"{export.graph_path}: probe inference produced NaN or infinity")


def run_cost_for(backend: Backend, config: EncoderConfig, server: ServerConfig) -> RunCost | None:
    """The backend's cost per session.run for length-sorted runs (serve/batch_plan.py): pinned by
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
                 observe: Callable[..., None] | None = None) -> tuple[Engine, float]:
    """A started engine for `export_dir` that passed every check, and its warm-up seconds."""
    export = load_export(export_dir, graph, auto=auto_graphs(config.device), long_paths=config.long_paths)
    backend = backend_factory(export, config)
    budget = AttentionBudget(export.config, backend.info.paths, config.max_attention_bytes or default_budget())
    warm_s = backend.warm_up() if config.warmup and hasattr(backend, "warm_up") else 0.0
    backend.health()
    probe(backend, export)
    run_cost = run_cost_for(backend, export.config, config)
    batcher = Batcher(
        backend, export.config,
        max_batch_size=config.max_batch_size, max_batch_tokens=config.max_batch_tokens,
        max_queue_delay_s=config.max_queue_delay_ms / 1e3, max_queue_size=config.max_queue_size,
        observe=observe, run_cost=run_cost, budget=budget, instances=config.instances,
    )
    engine = Engine(export, backend, batcher, config)  # checks the tokenizer: before any thread starts
    batcher.start()
    return engine, warm_s


def retire(engine: Engine, grace_s: float) -> threading.Thread:
    """Lets the old engine answer what it holds, then stops it (in a background thread)."""

    def run() -> None:
        started = time.monotonic()
        drained = engine.batcher.drain(grace_s)
        time.sleep(RETIRE_SETTLE_S)  # a handler that fetched the old engine just before the swap
        drained = engine.batcher.drain(grace_s) and drained
        engine.batcher.stop(0)
        logs.event(log, "model_retired", sha256=engine.export.sha256[:12], drained=drained,
                   retire_s=f"{time.monotonic() - started:.3f}")

    thread = threading.Thread(target=run, name="retire-model", daemon=True)
    thread.start()
    return thread


def reload_model(server: "EncoderServer", export_dir: str = "", graph: str = "") -> admin_pb2.ReloadModelResponse:
    """Builds, checks and swaps in a new model; raises ModelRefused (old model keeps serving)."""
    if not server._reload_lock.acquire(blocking=False):
        raise Overloaded("reload: another reload is in progress; retry when it finishes")
    try:
        old = server.engine()  # Unavailable while loading or shutting down
        export_dir = export_dir or str(old.export.path)
        graph = graph or server.config.graph
        started = time.monotonic()
        logs.event(log, "reload_started", export_dir=export_dir, graph=graph)
        try:
            new, warm_s = build_engine(export_dir, graph, server.config, server._backend_factory,
                                       server.metrics.observe_batcher)
        except ServeError as error:
            logs.event(log, "reload_refused", logging.ERROR, export_dir=export_dir, error=error.message)
            raise ModelRefused(
                f"reload refused, still serving sha256={old.export.sha256}: {error.message}") from None
        except Exception as error:  # e.g. onnxruntime raising its own types
            logs.event(log, "reload_refused", logging.ERROR, export_dir=export_dir, error=repr(error))
            raise ModelRefused(f"reload refused, still serving sha256={old.export.sha256}: "
                               f"{type(error).__name__}: {error}") from None
        if not server._swap_engine(old, new):
            new.batcher.stop(0)
            raise Unavailable("reload: the server is shutting down (or the model changed meanwhile)")
        load_s = time.monotonic() - started
        logs.event(log, "model_swapped", previous=old.export.sha256[:12], sha256=new.export.sha256[:12],
                   model=new.export.name, warmup_s=f"{warm_s:.3f}", load_s=f"{load_s:.3f}")
        retire(old, server.config.grace_s)
        return admin_pb2.ReloadModelResponse(
            previous_sha256=old.export.sha256, sha256=new.export.sha256, model_name=new.export.name,
            model_version=new.export.version, load_seconds=load_s,
        )
    finally:
        server._reload_lock.release()


class AdminServicer(admin_pb2_grpc.AdminServiceServicer):
    """`encoder.v1.AdminService`: errors -> status through serve.errors.to_status, like the servicer."""

    def __init__(self, server: "EncoderServer") -> None:
        self._server = server

    def ReloadModel(self, request, context):
        from serve.errors import to_status

        try:
            return reload_model(self._server, request.export_dir, request.graph)
        except Exception as error:
            context.abort(*to_status(error))


def add_admin_to_server(server: "EncoderServer", grpc_server) -> None:
    admin_pb2_grpc.add_AdminServiceServicer_to_server(AdminServicer(server), grpc_server)


ADMIN_SERVICE_NAME = admin_pb2.DESCRIPTOR.services_by_name["AdminService"].full_name
