"""The model repository: which models the server holds, loading and unloading them while it serves.

`--model-repository DIR` serves every subfolder of DIR that holds a `metadata.json`, under the
subfolder's name (Triton's layout rule: the folder is the model); `--export-dir` is the one-model
shorthand, served under the export's own name. Each model is an Engine (its own queue, limits,
batcher and metrics label); all of them share the server's one Scheduler (serve/core/scheduler.py).

While serving, through Triton's repository extension (serve/protocols/kserve_v2.py, kserve_rest.py)
or encoder.v1.AdminService:
  load(name)     builds the model beside the others and serves it (a model already served is
                 rebuilt and swapped in: the hot reload, per model). Nothing another model serves is
                 touched: a failed load is refused with its reason (FAILED_PRECONDITION) and only
                 that model's index entry says so.
  unload(name)   new calls get UNAVAILABLE naming the model; every call admitted before is answered
                 (within grace_s), then its batcher stops and its memory is released.
  index()        every model in the repository, served or not, with its state and reason.
One change at a time (a lock); requests to every model flow meanwhile.

The memory budget (`--memory-budget-mb`; 0: MEMORY_SHARE of the memory this process may use): a
load whose estimate (the graph files it loads; the dense graph once per session of it: session_plan)
would take the models past it is refused RESOURCE_EXHAUSTED, naming the budget, what is in use and
by which models. Once loaded, a model holds the larger of its estimate and the resident memory the
process grew by while loading it (loads run one at a time), reported in GetModelInfo and
`encoder_model_memory_bytes{model}`. On CUDA the estimate is all there is (RSS does not see the GPU).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from pathlib import Path
from typing import Callable

from model.export_format import repository_folders
from serve import logs
from serve.assembly.loading import BackendFactory, auto_graphs, build_engine
from serve.backend.export_dir import load_export
from serve.backend.session import session_plan
from serve.config import ServerConfig, least_run_slots
from serve.core.admission import Admission, names
from serve.core.attention_budget import available_memory, gib
from serve.core.engine import Engine, Reloaded
from serve.core.metrics import Metrics
from serve.core.model_index import LOADING, READY, UNAVAILABLE, UNLOADING, IndexEntry
from serve.core.scheduler import Scheduler
from serve.errors import ModelRefused, NotFound, Overloaded, ServeError, TooLarge, Unavailable, quote

log = logging.getLogger("serve.assembly.repository")

MEMORY_SHARE = 0.5  # of the memory this process may use, for the models (attention takes the other half)
ONE_EXPORT = "this server serves one export (--export-dir); start it with --model-repository to load and unload models"


def scan(root: Path) -> dict[str, Path]:
    """The model folders of a repository by name (model/export_format.py `repository_folders`)."""
    if not root.is_dir():
        raise Unavailable(f"--model-repository {root}: not a folder")
    return repository_folders(root)


def refused(what: str, error: ServeError) -> ServeError:
    """A refused load's error: past the memory budget RESOURCE_EXHAUSTED (TooLarge), any other check
    FAILED_PRECONDITION (ModelRefused), with the reason."""
    return (TooLarge if isinstance(error, TooLarge) else ModelRefused)(f"{what}: {error.message}")


def run_slots(config: ServerConfig, root: Path | None) -> int:
    """ServerConfig.instances, or by default: one for --export-dir; for a repository, one per model
    found at start, at most one per CPU this process may run on; with --device cuda at least two
    (serve/config.py least_run_slots)."""
    if config.instances:
        return config.instances
    least = least_run_slots(config)
    if root is None or not root.is_dir():
        return least
    return max(least, min(len(os.sched_getaffinity(0)), len(scan(root))))


def resident_bytes() -> int:
    """This process's resident memory (Linux /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class MemoryBudget:
    """What the loaded models may hold together (module docstring)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held: dict[str, int] = {}

    def in_use(self, without: str = "") -> int:
        return sum(n for name, n in self.held.items() if name != without)

    def check(self, name: str, estimate: int, replacing: str = "") -> None:
        """Refuses (TooLarge: RESOURCE_EXHAUSTED) a load of `estimate` bytes that does not fit; a model
        being replaced (`replacing`) still holds its share while its successor loads."""
        used = self.in_use()
        if used + estimate <= self.limit:
            return
        held = ", ".join(f"{n} {gib(b)}" for n, b in sorted(self.held.items())) or "none"
        raise TooLarge(f"load {quote(name)}: needs about {gib(estimate)}, and the memory budget "
                       f"(--memory-budget-mb) is {gib(self.limit)} with {gib(used)} in use by {held}"
                       + ("; the model it replaces holds its share until the new one serves" if replacing else "")
                       + "; unload a model or raise the budget")


class ModelRepository:
    def __init__(self, config: ServerConfig, admission: Admission, metrics: Metrics,
                 backend_factory: BackendFactory, swap: Callable[[Engine, Engine], bool] | None = None) -> None:
        self.config = config
        self.admission = admission
        self.metrics = metrics
        self._backend_factory = backend_factory
        self._swap = swap or admission.swap
        self.root = Path(config.model_repository) if config.model_repository else None
        # the run slots (ServerConfig.instances; 0: one per model found at start): every model's
        # sessions and batchers are built for them (serve/core/scheduler.py)
        self.config = config = dataclasses.replace(config, instances=run_slots(config, self.root))
        self.scheduler = Scheduler(config.instances)
        limit = config.memory_budget_mb << 20 if config.memory_budget_mb else int(available_memory() * MEMORY_SHARE)
        self.budget = MemoryBudget(limit)
        self._lock = threading.Lock()  # one load, unload or reload at a time
        self._entries: dict[str, IndexEntry] = {}  # the last state of each model that was tried

    # -- what is there ---------------------------------------------------------------------------
    def sources(self) -> dict[str, Path]:
        """Model name -> export folder ("" for the one --export-dir model: named by its export)."""
        if self.root is None:
            return {"": Path(self.config.export_dir)}
        return scan(self.root)

    def index(self) -> list[IndexEntry]:
        """Every model in the repository (and every one served), with its state (Triton's index)."""
        served = self.admission.engines()
        found = set(self.sources()) - {""} if self.root is not None else set()
        entries = []
        for name in sorted(found | set(served) | set(self._entries)):
            entry = self._entries.get(name)
            if name in served:
                entries.append(IndexEntry(name, "1", READY, ""))
            elif entry is not None:
                entries.append(entry)
            else:
                entries.append(IndexEntry(name, "", UNAVAILABLE, "not loaded"))
        return entries

    # -- start -----------------------------------------------------------------------------------
    def load_all(self) -> dict[str, Engine]:
        """Every model of the repository built and checked (before the server says SERVING). One
        that fails is logged and listed UNAVAILABLE with its reason; the others serve. Raises the
        error when --export-dir's model fails, or when no model of a non-empty repository loads."""
        sources = self.sources()
        engines: dict[str, Engine] = {}
        errors = []
        for name, path in sources.items():
            try:
                engine = self._build(name, path, self.config.graph, replacing="")
            except ServeError as error:
                if self.root is None:
                    raise
                errors.append(error)
                continue
            engines[engine.name] = engine
        if sources and not engines:
            raise errors[0] if len(errors) == 1 else Unavailable(
                f"--model-repository {self.root}: no model loaded: " + "; ".join(e.message for e in errors))
        return engines

    # -- while serving ---------------------------------------------------------------------------
    def load(self, name: str) -> Reloaded:
        """Loads `name` from the repository (reloads it when it is served); ServeError naming why not."""
        if self.root is None:
            raise ModelRefused(f"load: {ONE_EXPORT}")
        with self._exclusive("load"):
            path = self.sources().get(name)
            if path is None:
                raise NotFound(f"model {quote(name)} is not in the repository {self.root}; it holds "
                               f"{names(self.sources()) or 'no model'}")
            if name in self.admission.engines():
                return self._reload(name, str(path), self.config.graph)
            self.admission.changing(name, "loading")
            try:
                started = time.monotonic()
                try:
                    engine = self._build(name, path, self.config.graph, replacing="")
                except (TooLarge, ModelRefused):
                    raise
                except ServeError as error:  # e.g. BackendError: the export's fault, not the server's
                    raise ModelRefused(f"load {quote(name)} refused: {error.message}") from None
                if not self.admission.add(name, engine):
                    engine.batcher.stop(0)
                    self._forget(name)
                    raise Unavailable("load: the server is shutting down")
            finally:
                self.admission.changing(name, None)
            logs.event(log, "model_loaded", model=name, sha256=engine.export.sha256[:12],
                       memory=gib(engine.memory_bytes))
            return Reloaded(previous_sha256="", sha256=engine.export.sha256, model_name=name,
                            model_version=engine.export.version, load_seconds=time.monotonic() - started)

    def unload(self, name: str) -> None:
        """Stops serving `name`: new calls get UNAVAILABLE naming it; calls admitted before finish
        (within grace_s), then its batcher stops and its memory share is released."""
        if self.root is None:  # its one model would be gone, with nothing to load it again
            raise ModelRefused(f"unload: {ONE_EXPORT}")
        with self._exclusive("unload"):
            self.admission.changing(name, "unloading")
            try:
                engine = self.admission.remove(name)
                if engine is None:
                    raise NotFound(f"model {quote(name)} is not loaded; loaded: "
                                   f"{names(self.admission.engines()) or 'none'}")
                self._entries[name] = IndexEntry(name, "1", UNLOADING, "unloading")
                started = time.monotonic()
                drained = self._retire(engine)
            finally:
                self.admission.changing(name, None)
            self._forget(name)
            self._entries[name] = IndexEntry(name, "1", UNAVAILABLE, "unloaded")
            logs.event(log, "model_unloaded", model=name, drained=drained,
                       unload_s=f"{time.monotonic() - started:.3f}")

    def reload(self, name: str = "", export_dir: str = "", graph: str = "") -> Reloaded:
        """Rebuilds `name` ("": the only or default model) from `export_dir` ("": where it came from)
        beside the old engine and swaps it in (EncoderServer.reload)."""
        with self._exclusive("reload"):
            old = self.admission.engine(name)  # Unavailable while loading or shutting down
            return self._reload(old.name, export_dir, graph or self.config.graph)

    def reload_all(self) -> list[Reloaded]:
        """Re-reads every served model from its folder (SIGHUP); a refusal keeps that model's engine."""
        done = []
        for name in list(self.admission.engines()):
            try:
                done.append(self.reload(name))
            except ServeError as error:
                logs.event(log, "sighup_reload_failed", logging.ERROR, model=name, error=error.message)
        return done

    # -- the steps -------------------------------------------------------------------------------
    def _exclusive(self, what: str):
        if not self._lock.acquire(blocking=False):
            raise Overloaded(f"{what}: another load, unload or reload is in progress; retry when it finishes")
        lock = self._lock

        class _Held:
            def __enter__(self):
                return self

            def __exit__(self, *exc):
                lock.release()
                return False

        return _Held()

    def _estimate(self, path: Path, graph: str) -> int:
        """Bytes a model's sessions hold, before loading it: its graph files (the dense one once per session
        of it: serve/backend/session.py session_plan)."""
        export = load_export(path, graph, verify=False, auto=auto_graphs(self.config.device),
                             long_paths=self.config.long_paths)
        c = self.config
        dense = export.file_bytes(export.graph_path)  # with its external weights
        plan = session_plan(c.device, c.intra_op_threads, c.instances, dense)
        return dense * plan.copies + sum(export.file_bytes(p) for _, p in export.long_graphs)

    def _build(self, name: str, path: Path, graph: str, replacing: str) -> Engine:
        """A started engine for the export at `path` that passed every check and fits the budget; its
        index entry says UNAVAILABLE with the reason when it does not."""
        label = name or path.name
        self._entries[label] = IndexEntry(label, "", LOADING, "loading")
        try:
            estimate = self._estimate(path, graph)
            self.budget.check(label, estimate, replacing)
            before = resident_bytes()
            engine, warm_s = build_engine(str(path), graph, self.config, self._backend_factory,
                                          self.metrics.observer(name or path.name), name=name,
                                          scheduler=self.scheduler)
        except ServeError as error:
            self._entries[label] = IndexEntry(label, "", UNAVAILABLE, error.message)
            logs.event(log, "model_refused", logging.ERROR, model=label, path=str(path), error=error.message)
            raise
        except Exception as error:  # e.g. onnxruntime raising its own types
            message = f"{type(error).__name__}: {error}"
            self._entries[label] = IndexEntry(label, "", UNAVAILABLE, message)
            logs.event(log, "model_refused", logging.ERROR, model=label, path=str(path), error=message)
            raise ModelRefused(f"model {quote(label)}: {message}") from None
        self._entries.pop(label, None)
        engine.memory_bytes = max(estimate, resident_bytes() - before)
        if not replacing:
            self.budget.held[engine.name] = engine.memory_bytes
            self.metrics.model_loaded(engine.name, engine.memory_bytes)
        logs.event(log, "model_built", model=engine.name, sha256=engine.export.sha256[:12], graph=engine.export.graph,
                   provider=engine.backend.info.execution_provider, warmup_s=f"{warm_s:.3f}",
                   memory=gib(engine.memory_bytes))
        return engine

    def _reload(self, name: str, export_dir: str, graph: str) -> Reloaded:
        """The hot swap of one model (the caller holds the lock): the new engine is built and checked
        beside the old one, which keeps serving; then swapped in one assignment; the old one answers
        what was admitted to it, then stops. Any failure before the swap changes nothing."""
        old = self.admission.engine(name)
        export_dir = export_dir or str(old.export.path)
        started = time.monotonic()
        logs.event(log, "reload_started", model=name, export_dir=export_dir, graph=graph)
        try:
            new = self._build(name, Path(export_dir), graph, replacing=name)
        except ServeError as error:
            self._entries.pop(name, None)  # it still serves: READY in the index
            logs.event(log, "reload_refused", logging.ERROR, model=name, export_dir=export_dir, error=error.message)
            raise refused(f"reload refused, still serving sha256={old.export.sha256}", error) from None
        if not self._swap(old, new):
            new.batcher.stop(0)
            raise Unavailable("reload: the server is shutting down (or the model changed meanwhile)")
        self.budget.held[name] = new.memory_bytes
        self.metrics.model_loaded(name, new.memory_bytes)
        load_s = time.monotonic() - started
        logs.event(log, "model_swapped", model=name, previous=old.export.sha256[:12], sha256=new.export.sha256[:12],
                   load_s=f"{load_s:.3f}")
        threading.Thread(target=self._retire, args=(old,), name="retire-model", daemon=True).start()
        return Reloaded(previous_sha256=old.export.sha256, sha256=new.export.sha256, model_name=name,
                        model_version=new.export.version, load_seconds=load_s)

    def _retire(self, engine: Engine) -> bool:
        """Lets an engine no longer admitted to answer every call admitted to it (within grace_s),
        then stops it; True when all were answered in time."""
        started = time.monotonic()
        end = started + self.config.grace_s
        drained = self.admission.wait_engine(engine, end)
        drained = engine.batcher.drain(max(0.0, end - time.monotonic())) and drained
        if not drained:
            engine.batcher.abandon(Unavailable(
                f"model {engine.name!r} was unloaded and grace_s ({self.config.grace_s:g} s) ran out before "
                "this request ran; retry it"))
        engine.batcher.stop(0)
        logs.event(log, "model_retired", model=engine.name, sha256=engine.export.sha256[:12], drained=drained,
                   retire_s=f"{time.monotonic() - started:.3f}")
        return drained

    def _forget(self, name: str) -> None:
        self.budget.held.pop(name, None)
        self.metrics.model_unloaded(name)
