"""The native KServe v2 lane (`--kserve-native-port`): inference.GRPCInferenceService served by C++.

Why: a Python gRPC server costs ~0.34 ms of CPU per call here before any of our code runs (bare
grpcio, docs/performance.md), Triton's C++ front end ~0.26 ms in all. So the wire is C++
(native/kserve_lane.cc, built by `python -m serve.native_build`), and Python handles batches:

  fast path  ModelInfer with raw INT64/INT32 input_ids (+ a right-padded attention_mask), the default
             (bidirectional) mask, outputs last_hidden_state / embeddings, parameters pooling
             (mean | first) and normalize, within the limits. C++ parses and checks it, queues it, and
             hands every queued request to the lane's worker as ONE padded batch whenever the worker
             is free (so a batch holds all that arrived during the previous session.run: Triton's
             dynamic batching with no queue delay). The worker runs it on the served engine's backend
             (length-sorted runs where that pays, as the batcher's), pools and normalises per row in
             numpy, and C++ cuts the outputs per request and answers.
  slow path  everything else (texts, other masks, typed contents, unknown parameters, anything
             invalid, bytes that are no protobuf at all, the other v2 methods) reaches
             serve/kserve.py's servicer as the request bytes (every method is raw in C++) and is
             answered exactly as on the Python port: its checks and error messages are the only
             ones, C++ only recognises the happy path.

The fast path shares the engine's backend (and CPUs) with the Python batcher, which runs the slow
path's and the Python port's requests. Deadlines and cancellation are checked when a batch forms;
a drain refuses new calls with UNAVAILABLE, answers what it admitted, then abandons what is left
with UNAVAILABLE (as serve/app.py's drain). TLS and bearer tokens are not offered on this port.
"""

from __future__ import annotations

import importlib
import logging
import threading
import time
from typing import Callable

import grpc
import numpy as np
from google.protobuf.message import DecodeError

from model.attention_paths import DENSE, RowMask, attention_bytes
from model.mask_kinds import MaskKind
from serve import logs
from serve.attention_budget import longest
from serve.batch_plan import plan_runs
from serve.core import default_mask_feeds
from serve.engine import Engine
from serve.errors import ServeError, Unavailable, to_status
from serve.kserve import SERVICE, M, KServeServicer
from serve.metrics import Metrics
from serve.security import malformed

log = logging.getLogger("serve.native_lane")

FIRST = 1  # pooling code of a fast row (native/kserve_lane.cc): 0 mean, 1 first
POLL_S = 0.25  # how often idle workers look up from their queue (to notice a stop)
SLOW_WORKERS = 8  # Python threads answering the slow path (each may wait on the batcher)
METHOD = "v2.ModelInfer"  # the metrics label, as on the Python port


def load_module():
    """The compiled lane; ServeError (UNAVAILABLE) naming the build command when it is missing."""
    try:
        return importlib.import_module("serve._native._kserve_lane")
    except ImportError as error:
        raise Unavailable(f"--kserve-native-port: the native lane is not built ({error}); run "
                          f"`python -m serve.native_build` (make native)") from None


def missing_reason() -> str | None:
    """Why the lane cannot start here (the module is not built), or None."""
    try:
        load_module()
    except ServeError as error:
        return error.message
    return None


class LaneAbort(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class LaneContext:
    """What serve/kserve.py's servicer uses of a grpc.ServicerContext, for a slow-path call."""

    def __init__(self, remaining: float | None) -> None:
        self._deadline = None if remaining is None else time.monotonic() + remaining
        self._callbacks: list[Callable[[], None]] = []

    def time_remaining(self) -> float | None:
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    def add_callback(self, callback: Callable[[], None]) -> bool:
        self._callbacks.append(callback)
        return True

    def abort(self, code: grpc.StatusCode, details: str):
        raise LaneAbort(code, details)

    def ended(self) -> None:
        for callback in self._callbacks:
            callback()


def fast_max_length(engine: Engine) -> int:
    """The longest row the fast path takes: within the limits, and short enough that a full batch of
    such rows (bidirectional, dense graph) fits the attention budget; longer rows take the slow path."""
    config, rows = engine.export.config, engine.server.max_batch_size
    mask = RowMask(MaskKind.BIDIRECTIONAL, 0, 1)
    return longest(lambda n: rows * attention_bytes(DENSE, 1, n, mask, config) <= engine.budget.max_bytes,
                   engine.limits.max_sequence_length)


class NativeLane:
    def __init__(self, address: str, current: Callable[[], Engine | None], admit: Callable[..., Engine],
                 metrics: Metrics, max_receive_bytes: int, instances: int = 1) -> None:
        """`current()`: the engine to run fast batches on (None: not loaded); `admit`: the slow path's
        admission (serve/app.py EncoderServer.admit: counts the call in flight, UNAVAILABLE unless serving)."""
        module = load_module()
        self._lane = module.Lane()
        self.port = self._lane.start(address, max_receive_bytes)
        self._current, self._metrics = current, metrics
        self._kserve = KServeServicer(admit, metrics)
        self._stopping = False
        self._count, self._running = threading.Lock(), 0  # fast batches running now
        # one fast worker per batch that may run at once (ServerConfig.instances), as the batcher's
        self._threads = [threading.Thread(target=self._fast_loop, name=f"lane-fast-{i}", daemon=True)
                         for i in range(max(1, instances))]
        self._threads += [threading.Thread(target=self._slow_loop, name=f"lane-slow-{i}", daemon=True)
                          for i in range(SLOW_WORKERS)]
        for thread in self._threads:
            thread.start()

    def configure(self, engine: Engine) -> None:
        """Turns the fast path on for `engine` (at load and after each reload)."""
        export, config, server = engine.export, engine.export.config, engine.server
        fast = config.input_kind == "tokens" and export.default_pooling in ("mean", "first")
        max_length = fast_max_length(engine) if fast else 0
        self._lane.configure({
            "fast": fast, "model": export.name, "vocab": int(config.vocab_size),
            "max_length": max_length,
            "max_rows_per_request": engine.limits.max_sequences_per_request,
            "max_request_bytes": server.max_request_bytes,
            "max_request_tokens": engine.limits.max_request_tokens,
            "max_response_bytes": server.max_response_bytes,
            "max_queue": server.max_queue_size,
            "max_batch_rows": server.max_batch_size, "max_batch_tokens": server.max_batch_tokens,
            "pad_id": int(config.pad_token_id), "d_model": int(config.d_model),
            "default_pooling": export.default_pooling, "default_normalize": bool(export.default_normalize),
            "provider": engine.backend.info.execution_provider,
        })
        logs.event(log, "native_lane", port=self.port, fast=fast, model=export.name, max_length=max_length)

    # -- the fast path: one batch at a time ---------------------------------------------------
    def _fast_loop(self) -> None:
        while not self._stopping:
            got = self._lane.next_batch(POLL_S)
            if got is None:
                continue
            handle, ids, lengths, pooling, normalize, queued = got
            with self._count:
                self._running += 1
            try:
                engine = self._current()
                if engine is None:
                    raise Unavailable("model is loading; not serving, retry later")
                outputs = self._run(engine, ids, lengths, pooling, normalize, len(queued))
            except Exception as error:  # a failed run fails its batch, nothing else
                code, message = to_status(error)
                if not isinstance(error, ServeError):
                    logs.event(log, "unexpected_error", logging.ERROR, method=METHOD, error=message)
                self._lane.fail(handle, code.value[0], message)
                for _ in queued:
                    self._metrics.finished(METHOD, code.name, 0.0)
                continue
            finally:
                with self._count:
                    self._running -= 1
            try:
                seconds = self._lane.complete(handle, *outputs)
            except Exception as error:  # outputs that do not fit the batch: C++ answered INTERNAL
                logs.event(log, "unexpected_error", logging.ERROR, method=METHOD, error=repr(error))
                continue
            if seconds is not None:
                self._metrics.sequences.inc(len(lengths))
                for q, s in zip(queued, seconds):
                    self._metrics.observe_batcher(queue_s=float(q))
                    self._metrics.finished(METHOD, "OK", float(s))

    def _run(self, engine: Engine, ids: np.ndarray, lengths: np.ndarray, pooling: np.ndarray,
             normalize: np.ndarray, requests: int):
        """Runs a fast batch (length-sorted runs where that pays); per row: hidden [B, T, D], embedding
        [B, D] pooled and normalised, and the rows and padded length of the run that computed it."""
        config, backend = engine.export.config, engine.backend
        rows, length = ids.shape
        # With instances sharing the CPUs, a lone client's request (one request in the batch, no other
        # fast batch running, nothing queued) runs on the wide session, on every CPU. Under load a
        # momentarily empty queue is common; a wide run then competes with the next narrow one for the
        # cores (measured: 0.89x Triton 2x1's req/s with every lone batch wide, 1.07x without).
        wide = backend.has_wide and requests == 1 and self._running == 1 and self._lane.queued() == 0
        cost = engine.batcher.run_cost
        runs = plan_runs(lengths.tolist(), cost) if cost is not None and lengths.min() != lengths.max() else [None]
        run_rows = np.empty(rows, np.int64)
        run_length = np.empty(rows, np.int64)
        hidden = pooled = None
        for members in runs:
            n = rows if members is None else len(members)
            run_max = length if members is None else int(lengths[members].max())
            feeds = default_mask_feeds(ids if members is None else ids[members, :run_max],
                                       lengths if members is None else lengths[members], config)
            started = time.monotonic()
            h, p = backend.encode(feeds, DENSE, wide=wide)
            self._metrics.observe_batcher(batch_size=n, batch_tokens=n * run_max, path=DENSE,
                                          inference_s=time.monotonic() - started,
                                          padding_tokens=n * run_max - int(feeds["attention_mask"].sum()))
            if members is None:
                hidden, pooled = h, p
                run_rows[:], run_length[:] = n, run_max
                break
            if hidden is None:
                hidden = np.empty((rows, length, h.shape[-1]), np.float32)
                pooled = np.empty((rows, p.shape[-1]), np.float32)
            hidden[members, :run_max] = h
            pooled[members] = p
            run_rows[members], run_length[members] = n, run_max
        embeddings = np.where((pooling == FIRST)[:, None], hidden[:, 0], pooled).astype(np.float32, copy=False)
        if normalize.any():
            norms = np.maximum(np.linalg.norm(embeddings, axis=1, keepdims=True), 1e-12)
            embeddings = np.where(normalize[:, None], embeddings / norms, embeddings)
        return hidden, np.ascontiguousarray(embeddings, np.float32), run_rows, run_length

    # -- the slow path: serve/kserve.py, one call per thread -----------------------------------
    def _slow_loop(self) -> None:
        while not self._stopping:
            got = self._lane.next_slow(POLL_S)
            if got is None:
                continue
            handle, method, payload, remaining = got
            context = LaneContext(remaining)
            code, message, body = 0, "", b""
            try:
                try:
                    request = M[f"{method}Request"].FromString(payload)
                except DecodeError:
                    raise malformed(f"/{SERVICE}/{method}") from None
                body = getattr(self._kserve, method)(request, context).SerializeToString()
            except LaneAbort as abort:
                code, message = abort.code.value[0], abort.details
            except Exception as error:  # not through the servicer's edge (e.g. a parse error): its status
                status, message = to_status(error)
                code = status.value[0]
            finally:
                self._lane.finish_slow(handle, code, message, body)
                context.ended()

    # -- drain and stop -----------------------------------------------------------------------
    def drain(self, message: str, timeout: float) -> bool:
        """New calls get UNAVAILABLE `message`; True once every admitted call is answered within `timeout`."""
        return self._lane.drain(message, max(0.0, timeout))

    def wait_quiet(self, quiet: float, timeout: float) -> None:
        """Until no call has reached the lane for `quiet` s (or `timeout` s passed)."""
        self._lane.wait_quiet(quiet, max(0.0, timeout))

    def abandon(self, message: str) -> int:
        return self._lane.abandon(message)

    def in_flight(self) -> int:
        return self._lane.in_flight()

    def stop(self) -> None:
        self._stopping = True
        self._lane.stop(0.0)
        for thread in self._threads:
            thread.join(timeout=5)
