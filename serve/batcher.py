"""Dynamic batching: a bounded queue and one worker that groups concurrent requests into one run.

Admission: `submit` raises Overloaded when max_queue_size requests wait, Unavailable once closed.
The worker takes the oldest request, waits up to max_queue_delay for company, then takes requests
in arrival order (FIFO: no request is starved by shorter ones) while the batch stays within
max_batch_size rows and max_batch_tokens (rows x padded length). Each row carries its own mask
kind, since the graph takes per-row mask inputs, so requests with different masks batch together.
Padding is masked out of attention, so a row's result does not depend on its batch-mates.
Cancelled and deadline-expired requests are dropped when the batch is formed.
A batch whose inference fails is re-run request by request, so one bad request fails alone (INTERNAL).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Callable

import numpy as np

from model.config import EncoderConfig
from serve import logs
from serve.backend import Backend
from serve.core import EncodeRequest, EncodeResult, Row, SequenceOutput, pad_batch
from serve.errors import Cancelled, DeadlineExceeded, Overloaded, ServeError, Unavailable, ValidationError

log = logging.getLogger("serve.batcher")


class Ticket:
    """A submitted request: `wait()` returns its EncodeResult or raises its ServeError."""

    __slots__ = ("request", "rows", "length", "enqueued", "deadline", "cancelled", "_done", "_result", "_error")

    def __init__(self, request: EncodeRequest, rows: tuple[Row, ...], deadline: float | None) -> None:
        self.request = request
        self.rows = rows
        self.length = max(r.length for r in rows)
        self.enqueued = time.monotonic()
        self.deadline = deadline  # time.monotonic() value, or None
        self.cancelled = False
        self._done = threading.Event()
        self._result: EncodeResult | None = None
        self._error: BaseException | None = None

    def cancel(self) -> None:
        self.cancelled = True

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> EncodeResult:
        if not self._done.wait(timeout):
            raise DeadlineExceeded("deadline exceeded while waiting for the batch")
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result

    def _finish(self, result: EncodeResult | None = None, error: BaseException | None = None) -> None:
        self._result, self._error = result, error
        self._done.set()


class Batcher:
    def __init__(
        self,
        backend: Backend,
        config: EncoderConfig,
        *,
        max_batch_size: int,
        max_batch_tokens: int,
        max_queue_delay_s: float,
        max_queue_size: int,
        observe: Callable[..., None] | None = None,
    ) -> None:
        self.backend = backend
        self.config = config
        self.max_batch_size = max_batch_size
        self.max_batch_tokens = max_batch_tokens
        self.max_queue_delay_s = max_queue_delay_s
        self.max_queue_size = max_queue_size
        self._observe = observe or (lambda **_: None)
        self._queue: collections.deque[Ticket] = collections.deque()
        self._queued_rows = 0
        self._cond = threading.Condition()
        self._closed = False
        self._stopping = False
        self._busy = False
        self._thread = threading.Thread(target=self._run, name="batcher", daemon=True)

    # -- admission ---------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def submit(self, request: EncodeRequest, rows: tuple[Row, ...], deadline: float | None = None) -> Ticket:
        ticket = Ticket(request, rows, deadline)
        with self._cond:
            if self._closed:
                raise Unavailable("server is shutting down; retry on another replica")
            if len(self._queue) >= self.max_queue_size:
                raise Overloaded(f"queue full: {len(self._queue)} requests waiting (max_queue_size={self.max_queue_size})")
            self._queue.append(ticket)
            self._queued_rows += len(rows)
            self._observe(queue_depth=len(self._queue))
            self._cond.notify_all()
        return ticket

    def queue_depth(self) -> int:
        return len(self._queue)

    # -- shutdown ----------------------------------------------------------------------------
    def close(self) -> None:
        """Stop admitting; what is queued still runs."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def drain(self, timeout: float | None = None) -> bool:
        """Waits until the queue is empty and no batch runs; True when drained in time."""
        end = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._queue or self._busy:
                remaining = None if end is None else end - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._cond.wait(remaining)
        return True

    def stop(self, timeout: float | None = None) -> None:
        self.close()
        self.drain(timeout)
        with self._cond:
            self._stopping = True
            for ticket in self._queue:
                ticket._finish(error=Unavailable("server stopped before the request ran"))
            self._queue.clear()
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # -- the worker --------------------------------------------------------------------------
    def _take(self) -> list[Ticket] | None:
        with self._cond:
            while not self._queue and not self._stopping:
                self._cond.wait()
            if self._stopping:
                return None
            until = self._queue[0].enqueued + self.max_queue_delay_s
            while not self._closed and self._queued_rows < self.max_batch_size:
                remaining = until - time.monotonic()
                if remaining <= 0:
                    break
                self._cond.wait(remaining)
            batch: list[Ticket] = []
            rows = length = 0
            now = time.monotonic()
            while self._queue:
                ticket = self._queue[0]
                if ticket.cancelled or (ticket.deadline is not None and now >= ticket.deadline):
                    self._queue.popleft()
                    self._queued_rows -= len(ticket.rows)
                    if ticket.cancelled:
                        ticket._finish(error=Cancelled("request cancelled by the client"))
                    else:
                        ticket._finish(error=DeadlineExceeded("deadline expired while queued; request dropped"))
                    continue
                n, longest = len(ticket.rows), max(length, ticket.length)
                if batch and (rows + n > self.max_batch_size or (rows + n) * longest > self.max_batch_tokens):
                    break
                self._queue.popleft()
                self._queued_rows -= n
                batch.append(ticket)
                rows, length = rows + n, longest
            self._busy = bool(batch)
            self._observe(queue_depth=len(self._queue))
            self._cond.notify_all()
            return batch

    def _run(self) -> None:
        while True:
            batch = self._take()
            if batch is None:
                return
            try:
                if batch:
                    self._run_batch(batch)
            except BaseException as error:  # never leave a ticket waiting
                logs.event(log, "batch_failed", logging.ERROR, error=f"{type(error).__name__}: {error}",
                           requests=len(batch))
                self._isolate([t for t in batch if not t.done()], error)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _isolate(self, batch: list[Ticket], error: BaseException) -> None:
        """After a failed batch, runs each request alone: only the one that fails gets the error."""
        if len(batch) == 1:
            batch[0]._finish(error=_wrap(error))
            return
        for ticket in batch:
            try:
                self._run_batch([ticket])
            except BaseException as alone:  # this request fails by itself: it alone gets INTERNAL
                logs.event(log, "request_failed_alone", logging.ERROR, error=f"{type(alone).__name__}: {alone}")
                if not ticket.done():
                    ticket._finish(error=_wrap(alone))

    def _run_batch(self, batch: list[Ticket]) -> None:
        rows = [row for ticket in batch for row in ticket.rows]
        length = max(t.length for t in batch)
        feeds = pad_batch(rows, length, self.config)
        started = time.monotonic()
        hidden, pooled = self.backend.encode(feeds)
        inference_s = time.monotonic() - started
        provider = self.backend.info.execution_provider
        self._observe(batch_size=len(rows), batch_tokens=len(rows) * length, inference_s=inference_s)
        index = 0
        for ticket in batch:
            outputs = []
            for i, row in enumerate(ticket.rows):
                if not (np.isfinite(hidden[index, : row.length]).all() and np.isfinite(pooled[index]).all()):
                    # finite but extreme raw features can overflow inside the model: never answer NaN
                    bad = f"sequences[{i}]: the model's output is NaN or infinite for this input"
                    if row.inputs.dtype.kind == "f":
                        bad += f" (largest |feature| {float(np.abs(row.inputs).max()):.3g}); scale the features"
                    outputs = None
                    break
                outputs.append(postprocess(ticket.request, hidden[index, : row.length], pooled[index]))
                index += 1
            if outputs is None:
                index += len(ticket.rows) - i
                ticket._finish(error=ValidationError(bad))
                continue
            ticket._finish(EncodeResult(
                request_id=ticket.request.request_id,
                outputs=tuple(outputs),
                queue_s=started - ticket.enqueued,
                inference_s=inference_s,
                batch_size=len(rows),
                batch_length=length,
                execution_provider=provider,
                token_counts=tuple(row.length for row in ticket.rows),
            ))


def _wrap(error: BaseException) -> ServeError:
    return error if isinstance(error, ServeError) else ServeError(f"{type(error).__name__}: {error}")


def postprocess(request: EncodeRequest, hidden: np.ndarray, mean_pooled: np.ndarray) -> SequenceOutput:
    embedding = None
    if request.pooling == "mean":
        embedding = mean_pooled
    elif request.pooling == "first":
        embedding = hidden[0]
    if embedding is not None and request.normalize:
        embedding = embedding / max(float(np.linalg.norm(embedding)), 1e-12)
    return SequenceOutput(hidden if request.hidden_states else None, embedding)
