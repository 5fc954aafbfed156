"""Dynamic batching: a bounded queue and worker threads that group concurrent requests into runs.

One worker by default; with ServerConfig.instances = N, N workers each form and run their own batch
on the one shared backend, so N batches run at once (each on its share of the intra-op threads).
A worker runs a batch only while it holds a run slot of the server's one Scheduler
(serve/core/scheduler.py), which every model's batcher shares: N runs at once in the whole server.

Admission: `submit` raises Overloaded when max_queue_size requests wait, Unavailable once closed.
The worker takes the oldest request, waits up to max_queue_delay for company, then takes requests
in arrival order (FIFO: no request is starved by shorter ones) while the batch stays within
max_batch_size rows and max_batch_tokens (rows x padded length). Each row carries its own mask
kind, since the graph takes per-row mask inputs, so requests with different masks batch together.
Padding is masked out of attention, so a row's result does not depend on its batch-mates.
How a formed batch runs (attention paths, length-sorted session.runs where splitting saves work,
padding, outputs) is serve/core/runs.py's. Cancelled and deadline-expired requests are dropped when
the batch is formed.
A batch whose inference fails is re-run request by request, so one bad request fails alone (INTERNAL).

The express run (serve/core/express.py): a request submitted with the express grant, to an idle batcher (nothing
queued or running, max_queue_delay 0, a run slot free at once), runs on the submitting thread when its run is
predicted to take at most express_run_s (the model's recent seconds per padded token, BatchRunner.seconds_per_token;
none before the first run): one batch of one request, as a worker would run it, holding the run slot meanwhile.

Answers: a run's completed tickets are answered (their outputs cut from the run's, `done` callbacks called) by
the worker itself when nothing waits in the queue (a lone request: no hand-off), else by the batcher's finisher
thread, so the worker forms and starts the next batch at once. On a GPU the device idles while the one
interpreter assembles answers; this overlaps that work with the next run (bench/engine_cost.py).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Callable

from model.config import EncoderConfig
from model.projection import Dense
from serve import logs
from serve.core import express
from serve.core.attention_budget import AttentionBudget
from serve.backend.session import Backend
from serve.core.batch_plan import RunCost
from serve.core.bursts import BurstQueue
from serve.core.scheduler import Scheduler
from serve.backend.feeds import Rows
from serve.core.requests import EncodeResult, Work
from serve.core.runs import BatchRunner
from serve.errors import Cancelled, DeadlineExceeded, Overloaded, ServeError, Unavailable

log = logging.getLogger("serve.core.batcher")
_FINISH = threading.Lock()  # a ticket is finished once: by its batch, or by a drain that abandons it
EXPRESS = -1  # the `_running` key of an express run (workers are 0..instances-1)
SCAN_S = 0.005  # a full queue is searched for cancelled and expired tickets at most this often


class Ticket:
    """A submitted request: `wait()` returns its EncodeResult or raises its ServeError; `add_done_callback`
    runs a callback once it is finished (the started calls' way: no thread waits)."""

    __slots__ = ("request", "rows", "length", "attention_bytes", "enqueued", "deadline", "cancelled", "_finished",
                 "_event", "_result", "_error", "_callbacks")

    def __init__(self, request: Work, rows: Rows, deadline: float | None) -> None:
        self.request = request
        self.rows = rows
        self.attention_bytes = rows.attention_bytes  # estimated at admission (serve/core/attention_budget.py)
        self.length = rows.longest
        self.enqueued = time.monotonic()
        self.deadline = deadline  # time.monotonic() value, or None
        self.cancelled = False
        self._finished = False
        self._event: threading.Event | None = None  # made by the first `wait`: most tickets are never waited on
        self._result: EncodeResult | None = None
        self._error: BaseException | None = None
        self._callbacks: list[Callable[["Ticket"], None]] = []

    def cancel(self) -> None:
        self.cancelled = True

    def done(self) -> bool:
        return self._finished

    def wait(self, timeout: float | None = None) -> EncodeResult:
        with _FINISH:
            event = None
            if not self._finished:
                event = self._event = self._event or threading.Event()
        if event is not None and not event.wait(timeout):
            raise DeadlineExceeded("deadline exceeded while waiting for the batch")
        return self.outcome()

    def outcome(self) -> EncodeResult:
        """The result of a finished ticket, or raises its error."""
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result

    def add_done_callback(self, callback: Callable[["Ticket"], None]) -> None:
        """Calls `callback(ticket)` once it is finished (at once if it is), on the finishing thread."""
        with _FINISH:
            if not self._finished:
                self._callbacks.append(callback)
                return
        callback(self)

    def _finish(self, result: EncodeResult | None = None, error: BaseException | None = None) -> bool:
        """Sets the outcome unless one was set already; True when this call set it."""
        with _FINISH:
            if self._finished:
                return False
            self._result, self._error = result, error
            self._finished = True
            callbacks, self._callbacks = self._callbacks, []
            event = self._event
        if event is not None:
            event.set()
        for callback in callbacks:
            try:
                callback(self)
            except Exception as failure:  # one answer's failure must not stop the batch's others
                logs.event(log, "done_callback_failed", logging.ERROR, error=repr(failure))
        return True


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
        express_run_s: float = 0.0,
        observe: Callable[..., None] | None = None,
        run_cost: RunCost | None = None,
        budget: AttentionBudget | None = None,
        instances: int = 1,
        scheduler: Scheduler | None = None,
        dense: tuple[Dense, ...] = (),
    ) -> None:
        self.backend = backend
        self.config = config
        self.max_batch_size = max_batch_size
        self.max_batch_tokens = max_batch_tokens
        self.max_queue_delay_s = max_queue_delay_s
        self.max_queue_size = max_queue_size
        self.express_run_s = express_run_s if not max_queue_delay_s else 0.0  # 0: no express runs
        self._observe = observe or (lambda **_: None)
        self.run_cost = run_cost
        # bounds a batch's attention memory (each row's path was picked at admission: Rows.paths)
        self.budget = budget
        # runs a formed batch: paths, runs, padding, the backend, outputs (serve/core/runs.py; `dense`: the
        # projection every pooled embedding passes through, serve/core/pooling.py)
        self.runner = BatchRunner(backend, config, observe=self._observe, run_cost=run_cost, dense=dense)
        # the server's run slots, shared by every model's batcher (serve/core/scheduler.py); alone: its own
        self.scheduler = scheduler or Scheduler(instances)
        self._queue: collections.deque[Ticket] = collections.deque()
        self._scanned = float("-inf")  # when a full queue was last searched for ended tickets
        self._queued_rows = 0
        lock = threading.RLock()
        self._cond = threading.Condition(lock)
        # the runs' completed tickets (_Progress lists) the finisher thread answers (module docstring); each pass
        # handled tells a drain, which waits on `_cond`
        self._finisher = BurstQueue("batcher-finish", self._answer, lock, handled=self._cond.notify_all)
        self._closed = False
        self._stopping = False
        self._draining = 0  # drains waiting for the queue and the runs to end
        self._running: dict[int, list[Ticket]] = {}  # worker -> the batch it runs
        self._alone: dict[int, bool] = {}  # worker -> its batch started with no other running or queued
        # one worker per batch that may run at once (ServerConfig.instances), all on the one backend
        self._threads = [threading.Thread(target=self._run, args=(worker,), name=f"batcher-{worker}", daemon=True)
                         for worker in range(max(1, instances))]

    # -- admission ---------------------------------------------------------------------------
    def start(self) -> None:
        for thread in self._threads:
            thread.start()
        self._finisher.start()

    def submit(self, request: Work, rows: Rows, deadline: float | None = None) -> Ticket:
        ticket = Ticket(request, rows, deadline)
        with self._cond:
            if self._closed:
                raise Unavailable("server is shutting down; retry on another replica")
            if len(self._queue) >= self.max_queue_size and time.monotonic() - self._scanned >= SCAN_S:
                self._drop_ended()
            if len(self._queue) >= self.max_queue_size:
                raise Overloaded(f"queue full: {len(self._queue)} requests waiting (max_queue_size={self.max_queue_size})")
            if self._express(ticket):
                self._running[EXPRESS] = [ticket]
            else:
                self._queue.append(ticket)
                self._queued_rows += len(rows)
                self._observe(queue_depth=len(self._queue))
                self._cond.notify_all()
                return ticket
        self._observe(express=True)
        self._run_batch([ticket], EXPRESS, alone=self.scheduler.alone(self))
        return ticket

    def _express(self, ticket: Ticket) -> bool:
        """Whether `ticket` runs on the submitting thread (module docstring); True with a run slot held. Under the
        condition's lock."""
        rate = self.runner.seconds_per_token
        return bool(self.express_run_s and rate is not None and not self._queue and not self._running
                    and rate * len(ticket.rows) * ticket.length <= self.express_run_s
                    and express.take() and self.scheduler.try_acquire(self))

    def _drop_ended(self) -> None:
        """Finishes and removes the queued tickets whose call ended (cancelled) or expired, so they
        hold no place in a full queue until the next batch forms. Under the condition's lock."""
        now, kept = time.monotonic(), collections.deque()
        self._scanned = now
        for ticket in self._queue:
            if not self._dropped(ticket, now):
                kept.append(ticket)
        self._queue = kept

    def _dropped(self, ticket: Ticket, now: float) -> bool:
        """Finishes `ticket` when it expired (DEADLINE_EXCEEDED) or its call ended (CANCELLED) while
        queued, and takes its rows off the count; False when it is still wanted. The caller removes it."""
        if ticket.deadline is not None and now >= ticket.deadline:
            ticket._finish(error=DeadlineExceeded("deadline expired while queued; request dropped"))
        elif ticket.cancelled:
            ticket._finish(error=Cancelled("request cancelled by the client"))
        else:
            return False
        self._queued_rows -= len(ticket.rows)
        return True

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
            self._draining += 1
            try:
                while self._queue or self._running or self._finisher.unhandled():
                    remaining = None if end is None else end - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        return False
                    self._cond.wait(remaining)
            finally:
                self._draining -= 1
        return True

    def abandon(self, error: ServeError) -> int:
        """Finishes every queued and running ticket with `error` (a drain whose grace period ran out);
        the running batch's results, if they come, are dropped. Returns how many were abandoned."""
        with self._cond:
            tickets = [*self._queue, *(t for batch in self._running.values() for t in batch),
                       *(progress.ticket for done in self._finisher.unhandled() for progress in done)]
            self._queue.clear()
            self._queued_rows = 0
            self._cond.notify_all()
        return sum(ticket._finish(error=error) for ticket in tickets)

    def stop(self, timeout: float | None = None) -> None:
        self.close()
        self.drain(timeout)
        with self._cond:
            self._stopping = True
            for ticket in self._queue:
                ticket._finish(error=Unavailable("server stopped before the request ran"))
            self._queue.clear()
            self._cond.notify_all()
        self.scheduler.wake()  # a worker waiting for a run slot gives up
        self.scheduler.forget(self)
        for thread in self._threads:
            if thread.is_alive():
                thread.join(timeout)
        self._finisher.stop(5.0 if timeout is None else timeout)  # what a drain left is answered first
        self.runner.close()

    # -- the worker --------------------------------------------------------------------------
    def _take(self, worker: int) -> list[Ticket] | None:
        """The next batch, formed once this worker holds one of the server's run slots (the
        Scheduler: oldest request first across models); None when stopping. The caller releases
        the slot after running it."""
        while True:
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
                if not self._queue:  # another worker took it meanwhile
                    continue
                oldest = self._queue[0].enqueued
            if not self.scheduler.acquire(oldest, lambda: self._stopping, model=self):
                return None
            batch = self._form(worker)
            if batch:
                return batch
            self.scheduler.release(self)  # everything queued had ended meanwhile

    def _form(self, worker: int) -> list[Ticket]:
        """Takes the batch from the head of the queue (the caller holds a run slot)."""
        with self._cond:
            batch: list[Ticket] = []
            rows = length = memory = 0
            memory_limit = self.budget.max_bytes if self.budget is not None else 0
            # CUDA: the run's largest attention tensor (every row padded to the run's longest; a row's
            # tensor grows at most as T²) stays within what the kernels index (attention_budget.py)
            elements_limit = self.budget.max_elements if self.budget is not None else 0
            elements_per_t2 = 0.0
            now = time.monotonic()
            while self._queue:
                ticket = self._queue[0]
                if self._dropped(ticket, now):
                    self._queue.popleft()
                    continue
                n, longest = len(ticket.rows), max(length, ticket.length)
                per_t2 = n * ticket.rows.row_elements / max(ticket.length, 1) ** 2 if elements_limit else 0.0
                if batch and (rows + n > self.max_batch_size or (rows + n) * longest > self.max_batch_tokens
                              or (memory_limit and memory + ticket.attention_bytes > memory_limit)
                              or (elements_limit and (elements_per_t2 + per_t2) * longest ** 2 > elements_limit)):
                    break
                self._queue.popleft()
                self._queued_rows -= n
                batch.append(ticket)
                rows, length, memory = rows + n, longest, memory + ticket.attention_bytes
                elements_per_t2 += per_t2
            if batch:
                self._running[worker] = batch
                # alone: no other batch runs or waits, in this model or another, so it may use every
                # CPU (Backend.has_wide)
                self._alone[worker] = len(self._running) == 1 and not self._queue and self.scheduler.alone(self)
            self._observe(queue_depth=len(self._queue))
            self._cond.notify_all()
            return batch

    def _run(self, worker: int = 0) -> None:
        logs.name_thread(f"batcher-{worker}")
        while True:
            batch = self._take(worker)
            if batch is None:
                return
            self._run_batch(batch, worker, self._alone.get(worker, False))

    def _run_batch(self, batch: list[Ticket], worker: int, alone: bool) -> None:
        """Runs a formed batch (a worker's, or an express run's) while its run slot is held, then gives the slot
        back. `alone`: no other batch runs or waits (it may use every CPU)."""
        try:
            self.runner.run(batch, wide=alone, finish=self._answer_run)
        except BaseException as error:  # never leave a ticket waiting
            logs.event(log, "batch_failed", logging.ERROR, error=f"{type(error).__name__}: {error}",
                       requests=len(batch))
            self._isolate([t for t in batch if not t.done()], error, worker)
        finally:
            self.scheduler.release(self)
            with self._cond:
                self._running.pop(worker, None)
                self._alone.pop(worker, None)
                # an express run's end concerns only a drain: the workers wait for the queue, not for it
                if worker != EXPRESS or self._draining:
                    self._cond.notify_all()

    def _answer_run(self, done: list) -> None:
        """Answers a run's completed tickets: here when nothing is queued, else on the finisher thread (module
        docstring)."""
        if self._queue and not self._stopping:
            self._finisher.put(done)
        else:
            self.runner.finish(done)

    def _answer(self, runs: list) -> None:
        """The finisher's pass: each run's completed tickets, in order."""
        for done in runs:
            self.runner.finish(done)

    def _isolate(self, batch: list[Ticket], error: BaseException, worker: int = 0) -> None:
        """After a failed batch, runs each request alone: only the one that fails gets the error."""
        if len(batch) == 1:
            batch[0]._finish(error=_wrap(error))
            return
        for ticket in batch:
            try:
                self.runner.run([ticket], wide=self._alone.get(worker, False))
            except BaseException as alone:  # this request fails by itself: it alone gets INTERNAL
                logs.event(log, "request_failed_alone", logging.ERROR, error=f"{type(alone).__name__}: {alone}")
                if not ticket.done():
                    ticket._finish(error=_wrap(alone))


def _wrap(error: BaseException) -> ServeError:
    return error if isinstance(error, ServeError) else ServeError(f"{type(error).__name__}: {error}")
