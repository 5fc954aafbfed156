"""The inference backend protocol and its ONNX Runtime implementation.

A backend takes one padded batch of graph inputs and returns the graph outputs. It fails fast at
start: it checks the device it got, and that the graph's inputs are the ones this server feeds.
"""

from __future__ import annotations

import ctypes
import logging
import os
import time
from dataclasses import dataclass
from typing import Callable, Mapping, Protocol

import numpy as np

from model.attention_paths import DENSE, computes
from model.config import EncoderConfig
from model.mask_kinds import MaskKind
from model.signature import input_specs
from serve import logs
from serve.backend.feeds import Rows, pad_batch
from serve.config import ServerConfig
from serve.errors import BackendError
from serve.backend.export_dir import ExportDir

log = logging.getLogger("serve.backend.session")

CPU = "CPUExecutionProvider"
CUDA = "CUDAExecutionProvider"
TENSORRT = "TensorrtExecutionProvider"
TENSORRT_LIBRARY = "libnvinfer.so.10"  # TensorRT 10, which onnxruntime-gpu's TensorRT provider loads
_ORT_TYPES = {"int64": "tensor(int64)", "float32": "tensor(float)", "bool": "tensor(bool)"}


def expected_inputs(config: EncoderConfig, path: str = DENSE) -> dict[str, str]:
    """The graph inputs this server feeds on `path`, in graph order, with their ONNX Runtime type."""
    return {name: _ORT_TYPES[dtype] for name, dtype, _ in input_specs(config, path)}


@dataclass(frozen=True)
class BackendInfo:
    providers: tuple[str, ...]  # what the session actually uses, in priority order
    available_providers: tuple[str, ...]
    paths: tuple[str, ...] = (DENSE,)  # attention paths with a loaded graph (model/attention_paths.py)

    @property
    def execution_provider(self) -> str:
        return self.providers[0] if self.providers else "none"


class Backend(Protocol):
    info: BackendInfo

    def health(self) -> None: ...  # raises BackendError when it cannot serve

    # (hidden states [B, T, D], the graph's per-row output [B, K]); hidden=False: (None, per-row output), the
    # hidden states not fetched (on a GPU: not copied back to the host)
    def encode(self, batch: Mapping[str, np.ndarray], path: str = DENSE, *,
               hidden: bool = True) -> tuple[np.ndarray | None, np.ndarray]: ...


def can_load(library: str) -> bool:
    """Whether the dynamic loader finds and loads `library` (a soname)."""
    try:
        ctypes.CDLL(library)
    except OSError:
        return False
    return True


def offered_providers(available: list[str], loadable=can_load) -> list[str]:
    """onnxruntime's available providers, less TensorRT where its library cannot be loaded:
    onnxruntime-gpu lists TensorRT whenever the wheel holds the provider, TensorRT installed or not
    (the GPU image has none), and a session asked for it would fail."""
    if TENSORRT in available and not loadable(TENSORRT_LIBRARY):
        logs.event(log, "tensorrt_not_offered", library=TENSORRT_LIBRARY, reason="cannot be loaded")
        return [p for p in available if p != TENSORRT]
    return list(available)


def cuda_options(cuda_device_id: int = 0, tf32: bool = False) -> dict:
    """CUDA execution provider options: the device, and TF32 off unless asked for (ServerConfig.cuda_tf32)."""
    return {"device_id": int(cuda_device_id), "use_tf32": "1" if tf32 else "0"}


def choose_providers(device: str, cuda_device_id: int, available: list[str], tf32: bool = False) -> list:
    if device == "cpu":
        return [CPU]
    if CUDA not in available:
        if device == "cuda":
            raise BackendError(
                f"--device cuda: this onnxruntime has no {CUDA} (available: {', '.join(available)}); "
                "install onnxruntime-gpu (instead of onnxruntime) on a host with an NVIDIA GPU, or use --device cpu"
            )
        logs.event(log, "cuda_unavailable_fallback_cpu", logging.WARNING, available=",".join(available))
        return [CPU]
    return [(CUDA, cuda_options(cuda_device_id, tf32)), CPU]


# Where a run is too small to share: a dense graph up to this size gets a 1-thread session beside its
# multi-thread one (the weights a second time, so small models only), and runs whose work is below the
# crossover measured at start (OnnxRuntimeBackend.calibrate_one_thread) take it. On this project's 2-vCPU
# hosts a (1, 128) run of a 1-layer, 32-wide encoder took 0.85 ms on 1 thread and 1.00 ms on 2; a 4-layer,
# 256-wide one 16.0 against 10.7 ms (docs/performance.md "Small runs on one thread").
ONE_THREAD_MAX_GRAPH_BYTES = 32 << 20
ONE_THREAD_SHAPES = ((1, 16), (4, 128), (8, 256))  # (rows, length) timed on both sessions; capped at the position limit
ONE_THREAD_IDLE_S = 0.001  # the pause before each timed run (back to back, the other threads are still awake)
ONE_THREAD_PAIRS_S = 0.15  # about how long each shape's timings take (5 to 31 pairs)


def one_thread_below(gains: list[tuple[float, float]]) -> float:
    """The run work (batch_plan.RunCost.work) below which one intra-op thread is faster than several, from
    (work, seconds saved on one thread) at shapes of growing work: 0 when one thread is not faster at the
    smallest; the largest shape's work when it is faster at every one (never extrapolated past what was
    measured); else where the gain, straight between the last shape it was positive at and the next, is 0."""
    if not gains or gains[0][1] <= 0:
        return 0.0
    for (work, gain), (next_work, next_gain) in zip(gains, gains[1:]):
        if next_gain <= 0:
            return float(work + gain / (gain - next_gain) * (next_work - work))
    return float(gains[-1][0])


@dataclass(frozen=True)
class SessionPlan:
    """The sessions of the dense graph a backend loads: one home for OnnxRuntimeBackend and the repository's
    memory estimate (serve/assembly/repository.py)."""

    threads: int  # the main (narrow) session's intra-op threads
    wide: bool  # a second session on every CPU, for batches that run alone
    one_thread_runs: bool  # runs too small to share may take a 1-thread session (calibrate_one_thread)

    @property
    def separate_one_thread(self) -> bool:
        """A session of its own for those runs (the narrow one serves them where it has one thread)."""
        return self.one_thread_runs and self.threads > 1

    @property
    def copies(self) -> int:
        """How many times the dense graph's weights are held."""
        return 1 + self.wide + self.separate_one_thread


def session_plan(device: str, intra_op_threads: int, instances: int, graph_bytes: int,
                 cpus: int | None = None) -> SessionPlan:
    """What OnnxRuntimeBackend loads for a dense graph of `graph_bytes` on `cpus` CPUs (default: those this
    process may run on, sched_getaffinity). An explicit thread count (--intra-op-threads) is kept for every
    run: no wide and no 1-thread session then."""
    cpus = len(os.sched_getaffinity(0)) if cpus is None else cpus
    # An explicit count measured 10-30% faster than onnxruntime's own default (docs/performance.md).
    # With `instances` batches running at once, each gets its share of the CPUs.
    threads = int(intra_op_threads) or max(1, cpus // max(1, instances))
    automatic = device == "cpu" and not intra_op_threads
    return SessionPlan(threads=threads, wide=automatic and threads < cpus,
                       one_thread_runs=automatic and cpus > 1 and graph_bytes <= ONE_THREAD_MAX_GRAPH_BYTES)


def spin_entries(policy: str) -> tuple[tuple[str, str], ...]:
    """ONNX Runtime's session settings for a ServerConfig.intra_op_spin policy."""
    return {"run": (("session.intra_op.allow_spinning", "1"), ("session.force_spinning_stop", "1")),
            "always": (("session.intra_op.allow_spinning", "1"),),
            "never": (("session.intra_op.allow_spinning", "0"),)}[policy]


class OnnxRuntimeBackend:
    def __init__(self, export: ExportDir, *, device: str = "cpu", cuda_device_id: int = 0,
                 intra_op_threads: int = 0, cuda_tf32: bool = False, instances: int = 1,
                 intra_op_spin: str = ServerConfig.intra_op_spin) -> None:
        import onnxruntime as ort

        self.export = export
        self.config = export.config
        # the hidden states (a multivector model's token vectors) and the per-row output: the mean embedding, or
        # the model's head (its task)
        self.outputs = (export.hidden_output, export.row_output)
        available = offered_providers(ort.get_available_providers())
        providers = choose_providers(device, cuda_device_id, available, cuda_tf32)
        spinning = spin_entries(intra_op_spin)  # ServerConfig.intra_op_spin: every session of this backend alike

        def session_options(threads: int):
            made = ort.SessionOptions()
            made.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
            made.intra_op_num_threads = threads
            for key, value in spinning:
                made.add_session_config_entry(key, value)
            return made

        cpus = len(os.sched_getaffinity(0))  # the wide session's threads
        plan = session_plan(device, intra_op_threads, instances, export.file_bytes(export.graph_path), cpus)
        options = session_options(plan.threads)
        self.session = self._load(ort, export.graph_path, options, providers, device)
        # With instances sharing the CPUs, a batch that runs alone (no other batch running, none queued:
        # a lone client) gets a second session of the dense graph on every CPU, so instances cost a lone
        # request no latency (docs/serving.md "Instances"). Its price: the dense weights twice in memory.
        self.wide = None
        if plan.wide:
            self.wide = self._load(ort, export.graph_path, session_options(cpus), providers, device)
        # runs of the narrow session at once that fill every CPU: a batch that runs alone and splits into several
        # runs takes them (serve/core/runs.py); 1 where there is no wide session
        self.parallel_runs = max(1, cpus // options.intra_op_num_threads) if self.wide is not None else 1
        # A run too small to share its work pays more for waking the other intra-op threads than they save it:
        # those run on one thread (ONE_THREAD_MAX_GRAPH_BYTES). The narrow session where it has one thread, else
        # a session of its own; none where the thread count was pinned (--intra-op-threads) or on a GPU. Which
        # runs take it is measured at start (calibrate_one_thread); until then, none.
        self.one_thread = None
        self.one_thread_below = 0.0  # runs of less work (`_work`: batch_plan.RunCost.work) take `one_thread`
        self._work: Callable[[int, int], float] | None = None
        if plan.one_thread_runs:
            if not plan.separate_one_thread:
                self.one_thread = self.session
            else:
                self.one_thread = self._load(ort, export.graph_path, session_options(1), providers, device)
        # The long-input graphs run without ONNX Runtime's CPU arena: their runs are long (malloc is
        # nothing beside them), and an arena keeps every run's peak (a 32k-token run's peak
        # RSS measured 2.16 GiB with it, 1.40 GiB without; docs/performance.md).
        long_options = session_options(plan.threads)
        long_options.enable_cpu_mem_arena = False
        # Nor do they pre-pack their weights (MLAS' packed copy of each MatMul's B, made at load and held
        # per session): the dense session holds its own packed copy, and a long graph's would be a second
        # one from the start. Unpacked, a long graph reads its weights where ONNX Runtime put them (an
        # export's external data file is mapped, not read: nothing resident until a long run touches it)
        # and packs each weight per run, one pass over the weights beside a run of thousands of tokens
        # (docs/serving.md "Memory").
        long_options.add_session_config_entry("session.disable_prepacking", "1")
        self.sessions = {DENSE: self.session}
        for path, graph_path in export.long_graphs:
            self.sessions[path] = self._load(ort, graph_path, long_options, providers, device)
        actual = tuple(self.session.get_providers())
        if device == "cuda" and (not actual or actual[0] != CUDA):
            raise BackendError(
                f"--device cuda was asked for but the session runs on {actual[0] if actual else 'nothing'} "
                f"(providers {list(actual)}): check the CUDA/cuDNN libraries onnxruntime-gpu needs "
                f"and --cuda-device-id={cuda_device_id}"
            )
        if device == "auto" and CUDA in available and actual[0] != CUDA:
            logs.event(log, "cuda_session_failed_fallback_cpu", logging.WARNING, providers=",".join(actual))
        self.info = BackendInfo(actual, tuple(available), tuple(self.sessions))
        graph_paths = {DENSE: export.graph_path, **dict(export.long_graphs)}
        for path, session in self.sessions.items():
            self._check_graph(session, path, graph_paths[path])

    @staticmethod
    def _load(ort, graph_path, options, providers, device: str):
        try:
            return ort.InferenceSession(str(graph_path), sess_options=options, providers=providers)
        except Exception as error:  # onnxruntime raises its own exception types
            raise BackendError(f"cannot load {graph_path} on {device}: {error}") from error

    def _check_graph(self, session, path: str, graph_path) -> None:
        expected = expected_inputs(self.config, path)
        got = {i.name: i.type for i in session.get_inputs()}
        if got != expected:
            raise BackendError(
                f"{graph_path}: graph inputs {got} are not the ones this server feeds {expected}; "
                "re-export with this version of `python -m export`"
            )
        outputs = [o.name for o in session.get_outputs()]
        missing = [name for name in self.outputs if name not in outputs]
        if missing:
            raise BackendError(f"{graph_path}: graph lacks output(s) {missing} (has {outputs})")

    def health(self) -> None:
        if self.session is None:
            raise BackendError("session closed")

    @property
    def has_wide(self) -> bool:
        return self.wide is not None

    def session_for(self, batch: Mapping[str, np.ndarray], path: str = DENSE, wide: bool = False):
        """The session that runs `batch`: the path's; on the dense path, the 1-thread one for a run below
        `one_thread_below`, else the wide one for a batch that runs alone (`wide`) where there is one."""
        if path != DENSE:
            return self.sessions[path]
        if self.one_thread_below and self._work(*batch["attention_mask"].shape) < self.one_thread_below:
            return self.one_thread
        return self.wide if wide and self.wide is not None else self.session

    def use_one_thread_below(self, below: float, work: Callable[[int, int], float]) -> None:
        """Runs whose `work(rows, length)` is below `below` take the 1-thread session (0: none does)."""
        self.one_thread_below, self._work = (below, work) if self.one_thread is not None else (0.0, None)

    def calibrate_one_thread(self, work: Callable[[int, int], float]) -> float:
        """Times ONE_THREAD_SHAPES, least `work(rows, length)` first (the batcher's cost model,
        serve/core/batch_plan.py RunCost.work, handed down), on the 1-thread session and on the one with the
        most threads (medians, taking turns, each run after a pause) and sets `one_thread_below` where one
        thread stops being faster (module function `one_thread_below`); a separate 1-thread session that is
        never faster is dropped (its memory back). Returns the threshold (0: every run on the multi-thread
        sessions)."""
        if self.one_thread is None:
            return 0.0
        limit = self.config.position_limit
        shapes = [(rows, min(length, limit) if limit else length) for rows, length in ONE_THREAD_SHAPES]
        multi = self.wide if self.wide is not None else self.session
        gains, median = [], {}
        for shape in sorted(dict.fromkeys(shapes), key=lambda shape: work(*shape)):
            feeds, took = dummy_batch(self.config, *shape), {"one": [], "multi": []}
            started = time.perf_counter()
            multi.run([self.outputs[1]], feeds)
            # as many pairs as fit ONE_THREAD_PAIRS_S (a short run's gain is small beside its noise), within bounds
            pairs = int(min(max(ONE_THREAD_PAIRS_S / (2 * (time.perf_counter() - started)), 5), 31))
            for _ in range(pairs):
                for name, session in (("one", self.one_thread), ("multi", multi)):
                    time.sleep(ONE_THREAD_IDLE_S)  # as a request after a pause finds it: the pool's threads asleep
                    started = time.perf_counter()
                    session.run([self.outputs[1]], feeds)
                    took[name].append(time.perf_counter() - started)
            for name, times in took.items():
                median[name, shape] = float(np.median(times))
            gains.append((work(*shape), median["multi", shape] - median["one", shape]))
            if gains[-1][1] <= 0:  # one_thread_below looks no further
                break
        below = one_thread_below(gains)
        self.use_one_thread_below(below, work)
        logs.event(log, "one_thread_runs", below_work=f"{below:.0f}",
                   **{f"{name}_{rows}x{length}_ms": f"{1e3 * seconds:.3f}"
                      for (name, (rows, length)), seconds in median.items()})
        if not below and self.one_thread is not self.session:
            self.one_thread = None
        return below

    def encode(self, batch: Mapping[str, np.ndarray], path: str = DENSE, *,
               wide: bool = False, hidden: bool = True) -> tuple[np.ndarray | None, np.ndarray]:
        """`wide`: run on every CPU (the batch runs alone), where there is a wide session. `hidden` False: only
        the per-row output is fetched (no caller of the run asked for hidden states), (None, it)."""
        session = self.session_for(batch, path, wide)
        try:
            if not hidden:
                return None, session.run([self.outputs[1]], dict(batch))[0]
            states, pooled = session.run(list(self.outputs), dict(batch))
        except Exception as error:
            raise BackendError(f"inference failed: {type(error).__name__}: {error}") from error
        return states, pooled

    def warm_up(self, lengths: tuple[int, ...] = (1, 8, 64)) -> float:
        """Runs a few shapes on the dense graph (every mask kind it computes) so the first request does not
        pay for allocation. The long-input graphs stay cold: their runs are long beside that cost, and a
        warm-up run would make their weights resident (an external data file is mapped, not read: see
        __init__) before any long request needs them."""
        started = time.perf_counter()
        kinds = [kind for kind in MaskKind if computes(DENSE, kind, self.config)]
        for length in lengths:
            batch = dummy_batch(self.config, len(kinds), min(length, self.config.position_limit or length), kinds)
            self.encode(batch)
            if self.wide is not None:
                self.encode(batch, wide=True)
            if self.one_thread is not None and self.one_thread is not self.session:
                self.one_thread.run(list(self.outputs), batch)
        return time.perf_counter() - started


def dummy_batch(config: EncoderConfig, rows: int, length: int, kinds: list[MaskKind] | None = None,
                path: str = DENSE) -> dict:
    """A full-length batch of zeros (one mask kind per row) for warm-up and the start-up probe."""
    kinds = kinds or [MaskKind.BIDIRECTIONAL] * rows
    shape = (length,) if config.input_kind == "tokens" else (length, config.d_model)
    dtype = np.int64 if config.input_kind == "tokens" else np.float32
    lengths = np.array([length])
    batch = [(Rows(np.zeros((1, *shape), dtype), lengths, int(kind), False, 1, 2), None) for kind in kinds]
    return pad_batch(batch, length, config, path)
