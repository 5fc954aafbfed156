"""Running one formed batch (serve/core/batcher.py forms it): how its requests' rows are cut into
session.runs (by the attention path each row was given at admission, then by length where splitting
saves work: serve/core/batch_plan.py), the graph inputs (serve/backend/feeds.py, the one place that
pads), the backend call, and each request's result as its rows complete (serve/core/pooling.py).
The batcher owns the queue and the workers; this module owns a run.

A batch that runs alone (no other batch running or queued) may take every CPU. Where the server's run slots
split the CPUs (--instances: each slot's session runs on its share), that is one run on the wide session (every
CPU), or, when the batch splits into several runs, `parallel_runs` of them at once on the narrow session, each
on its share: on 2 cores, a ColBERT request's 6 runs (32 documents of 50-170 tokens, 12 layers of 384) took
0.88-0.91x the time as 2 runs of 1 thread at once than one after another on 2 threads (docs/performance.md
"Late interaction against PyLate"). Their outputs go to the tickets on the batch's own thread, in the order the
runs complete.

A run's outputs are one padded array per output; a request that ran as one whole piece of one run
(the common case: no split) is answered with views of them, others gather their pieces once.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor, as_completed, wait
from typing import Callable, NamedTuple

import numpy as np

from model.attention_paths import DENSE, PATHS, SPARSE
from model.config import EncoderConfig
from model.mask_kinds import MaskKind
from model.projection import Dense
from serve import logs
from serve.backend.feeds import Rows, pad_batch, run_lengths
from serve.backend.session import Backend
from serve.core.batch_plan import RunCost, plan_runs
from serve.core.pooling import reads_hidden, request_outputs
from serve.core.requests import EncodeResult
from serve.errors import ServeError, ValidationError

log = logging.getLogger("serve.core.runs")
RATE_WEIGHT = 0.25  # the newest run's weight in BatchRunner.seconds_per_token


class _Ran(NamedTuple):
    """One session.run's outputs and measures (BatchRunner._execute)."""
    path: str
    pieces: list
    length: int
    lengths: np.ndarray
    tokens: int
    wants_hidden: bool
    hidden: np.ndarray | None
    pooled: np.ndarray
    started: float
    inference_s: float
    cpu_s: float


class BatchRunner:
    def __init__(self, backend: Backend, config: EncoderConfig, *, observe: Callable[..., None],
                 run_cost: RunCost | None = None, dense: tuple[Dense, ...] = ()) -> None:
        self.backend = backend
        self.config = config
        self.dense = dense  # the projection after pooling (serve/core/pooling.py project)
        self._observe = observe
        self.run_cost = run_cost  # None: one session.run per path; else length-sorted runs (batch_plan)
        # a session on every CPU for a batch that runs alone (Backend.has_wide; test doubles have none)
        self.has_wide = bool(getattr(backend, "has_wide", False))
        # how many runs of the narrow session fill every CPU (Backend.parallel_runs): a lone batch of several
        # runs runs that many at once (module docstring)
        self.parallel_runs = int(getattr(backend, "parallel_runs", 1))
        # the recent runs' seconds per padded token (a moving average; None before the first run): what the batcher
        # predicts an express run's time with (serve/core/batcher.py)
        self.seconds_per_token: float | None = None
        # its threads start with the first such batch
        self._pool = (ThreadPoolExecutor(self.parallel_runs, thread_name_prefix="runs") if self.parallel_runs > 1
                      else None)

    def run(self, batch: list, wide: bool = False, finish: Callable[[list], None] | None = None) -> None:
        """Runs the batch's rows: one session.run per attention path, or length-sorted runs
        (serve/core/batch_plan.py) when a RunCost is set and splitting saves work. Each ticket finishes
        as soon as its last row has run, so short requests in a mixed batch come back first. `wide`:
        the batch runs alone on the machine, so its dense runs may take every CPU: one run on the wide
        session, or several at once on the narrow one (`parallel_runs`, module docstring).
        `finish(done)`: answers the tickets a run completed (`BatchRunner.finish`, the default, or the batcher's
        finisher thread)."""
        progress = {ticket: _Progress(ticket) for ticket in batch}
        finish = finish or self.finish
        runs = self._runs(batch)
        if wide and self.parallel_runs > 1 and len(runs) > 1 and all(path == DENSE for path, _ in runs):
            self._run_at_once(runs, progress, finish)
            return
        for number, (path, pieces) in enumerate(runs):
            self._account(number, self._execute(path, pieces, wide), progress, finish)

    def _execute(self, path: str, pieces: list, wide: bool) -> _Ran:
        """One session.run of `pieces` (a ticket and its rows in the run): its inputs, the backend call, its
        outputs. Touches no ticket: several may run at once (`_run_at_once`)."""
        length = _length(pieces)
        pieces_rows = [(t.rows, i) for t, i in pieces]
        lengths, tokens = run_lengths(pieces_rows)
        feeds = pad_batch(pieces_rows, length, self.config, path, lengths)
        # hidden states only where a caller of the run reads them (on a GPU, [rows, T, D] copied back per run)
        wants_hidden = any(reads_hidden(t.request) for t, _ in pieces)
        started, cpu = time.monotonic(), time.thread_time()
        if path != DENSE:
            hidden, pooled = self.backend.encode(feeds, path, hidden=wants_hidden)
        elif wide and self.has_wide:
            hidden, pooled = self.backend.encode(feeds, wide=True, hidden=wants_hidden)
        else:
            hidden, pooled = self.backend.encode(feeds, hidden=wants_hidden)
        return _Ran(path, pieces, length, lengths, tokens, wants_hidden, hidden, pooled, started,
                    time.monotonic() - started, time.thread_time() - cpu)

    def _account(self, number: int, ran: _Ran, progress: dict, finish: Callable[[list], None]) -> None:
        """A run's outputs to its tickets' progress (on the batch's own thread); answers those it completed."""
        rows, length, lengths, hidden = len(ran.lengths), ran.length, ran.lengths, ran.hidden
        rate, last = self.seconds_per_token, ran.inference_s / (rows * length)
        self.seconds_per_token = last if rate is None else rate + RATE_WEIGHT * (last - rate)
        self._observe(batch_size=rows, batch_tokens=rows * length, inference_s=ran.inference_s,
                      padding_tokens=rows * length - ran.tokens, path=ran.path, run_cpu_s=ran.cpu_s)
        if ran.wants_hidden and ran.tokens < rows * length:
            hidden[np.arange(length) >= lengths[:, None]] = 0  # answered zeros past each row's length
        # the run's answers are finite (else: each row is checked); hidden states only where answered
        finite = bool(np.isfinite(ran.pooled).all()) and (not ran.wants_hidden or bool(np.isfinite(hidden).all()))
        at = 0
        for ticket, index in ran.pieces:
            count = len(ticket.rows) if index is None else len(index)
            progress[ticket].add(index, hidden, ran.pooled, at, count, run=number, started=ran.started,
                                 inference_s=ran.inference_s, batch_size=rows, batch_length=length,
                                 path=ran.path, finite=finite)
            at += count
        complete = [progress[ticket] for ticket, _ in ran.pieces
                    if progress[ticket].complete and not ticket.done()]
        if complete:  # every method alike; before the answers
            self._observe(queue_s=[done.queue_s for done in complete])
            finish(complete)

    def _run_at_once(self, runs: list, progress: dict, finish: Callable[[list], None]) -> None:
        """A lone batch's dense runs, `parallel_runs` at a time on the narrow session, the most work first (so the
        last to start are the shortest); each accounted here as it completes. A failed run fails the batch once
        every run has ended (the batcher then runs its requests one by one)."""
        order = sorted(range(len(runs)), key=lambda n: -_rows(runs[n][1]) * _length(runs[n][1]))
        futures = {self._pool.submit(self._execute, *runs[n], False): n for n in order}
        try:
            for future in as_completed(futures):
                self._account(futures[future], future.result(), progress, finish)
        finally:
            wait(futures)  # nothing of this batch still runs once it returns or fails

    def close(self) -> None:
        """Ends the threads of `_run_at_once` once idle (after the batcher's last batch)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False)

    def finish(self, done: list) -> None:
        """Answers each completed ticket of `done` (its _Progress): its outputs, or the error assembling them
        raised (INTERNAL), which fails it alone."""
        provider = self.backend.info.execution_provider
        for progress in done:
            try:
                progress.finish(provider, self.dense)
            except Exception as error:
                logs.event(log, "answer_failed", logging.ERROR, error=f"{type(error).__name__}: {error}")
                progress.ticket._finish(error=error if isinstance(error, ServeError)
                                        else ServeError(f"{type(error).__name__}: {error}"))

    def _runs(self, batch: list) -> list[tuple[str, list[tuple[object, np.ndarray | None]]]]:
        """The session.runs for `batch`: (path, pieces), a piece being a ticket and the indices of its
        rows in the run (None: all of them, in order). Dense first. A sparse run's strided rows share
        one step (window-only rows run apart, so they never pay for a strided layout)."""
        groups: dict[tuple[str, int], list] = {}
        for ticket in batch:
            rows = ticket.rows
            paths = rows.paths or ((DENSE, None),)  # (): every row dense
            for path, index in paths:
                groups.setdefault((path, _step(rows, path)), []).append(
                    (ticket, None if len(paths) == 1 else index))
        runs = []
        for key in sorted(groups, key=lambda key: (PATHS.index(key[0]), key[1])):
            pieces = groups[key]
            length = pieces[0][0].length
            if self.run_cost is None or all(index is None and ticket.rows.full and ticket.length == length
                                            for ticket, index in pieces):
                runs.append((key[0], pieces))  # every row one length: no split saves padding (plan_runs)
                continue
            owners, lengths = [], []
            for k, (ticket, index) in enumerate(pieces):
                row_lengths = ticket.rows.lengths if index is None else ticket.rows.lengths[index]
                owners.append(np.full(len(row_lengths), k))
                lengths.append(row_lengths)
            owner, length = np.concatenate(owners), np.concatenate(lengths)
            plan = plan_runs(length.tolist(), self.run_cost)
            if len(plan) == 1:
                runs.append((key[0], pieces))
                continue
            starts = np.concatenate([[0], np.cumsum([len(x) for x in lengths])])
            for run in plan:
                run = np.asarray(run)
                split = []
                for k in dict.fromkeys(owner[run].tolist()):  # each piece once, in arrival order
                    ticket, index = pieces[k]
                    at = np.sort(run[owner[run] == k]) - starts[k]
                    whole = index is None and len(at) == len(ticket.rows)
                    split.append((ticket, None if whole else (at if index is None else index[at])))
                runs.append((key[0], split))
        return runs


def _length(pieces: list) -> int:
    """The padded length of a run of `pieces`: its longest row."""
    return max(t.length if i is None else int(t.rows.lengths[i].max()) for t, i in pieces)


def _rows(pieces: list) -> int:
    return sum(len(t.rows) if i is None else len(i) for t, i in pieces)


def _step(rows: Rows, path: str) -> int:
    """The step a sparse run of these rows is laid out for (0: not a sparse run)."""
    if path != SPARSE:
        return 0
    kind = MaskKind(rows.kind)
    # bidirectional/causal rows on a plan's sparse graph are step-1 rows on its global layers
    return rows.step if kind.uses_step else 1 if kind in (MaskKind.BIDIRECTIONAL, MaskKind.CAUSAL) else 0


class _Progress:
    """One ticket's rows as their runs complete; `finish` answers it once all have run."""

    __slots__ = ("ticket", "pieces", "paths", "left", "first_start", "inference_s", "last_run", "batch_size",
                 "batch_length", "error")

    def __init__(self, ticket) -> None:
        self.ticket = ticket
        self.pieces: list[tuple] = []  # (row indices or None, the run's hidden, pooled, first row in the run)
        self.paths: list[str] = [DENSE] * len(ticket.rows)
        self.left = len(ticket.rows)
        self.first_start: float | None = None
        self.inference_s = 0.0
        self.last_run = -1  # the latest run this ticket took part in (its time counts once per run)
        self.batch_size = self.batch_length = 0
        self.error: ValidationError | None = None

    @property
    def complete(self) -> bool:
        return self.left == 0 or self.error is not None

    @property
    def queue_s(self) -> float:
        """Admitted -> the start of its first run."""
        return self.first_start - self.ticket.enqueued

    def add(self, index: np.ndarray | None, hidden: np.ndarray | None, pooled: np.ndarray, at: int, count: int, *,
            run: int, started: float, inference_s: float, batch_size: int, batch_length: int,
            path: str = DENSE, finite: bool = False) -> None:
        """Takes the rows `index` (None: all) of this ticket, rows at..at+count of the run's outputs;
        `finite`: the whole run's outputs are known finite (no row check)."""
        if self.error is not None:
            return
        rows = self.ticket.rows
        if index is None:
            self.paths = [path] * len(rows)
        else:
            for i in index.tolist():
                self.paths[i] = path
        if self.first_start is None or started < self.first_start:
            self.first_start = started
        if run != self.last_run:
            self.last_run = run
            self.inference_s += inference_s
        # report the run that held its longest row (runs may complete in any order: BatchRunner._run_at_once)
        if batch_length >= self.batch_length:
            self.batch_size, self.batch_length = batch_size, batch_length
        self.left -= count
        if not finite:
            ok = np.isfinite(pooled[at:at + count]).all(axis=1)
            if reads_hidden(self.ticket.request):
                ok &= np.isfinite(hidden[at:at + count]).all(axis=(1, 2))
            if not ok.all():
                # finite but extreme raw features can overflow inside the model: never answer NaN
                k = int(np.flatnonzero(~ok)[0])
                i = k if index is None else int(index[k])
                bad = f"sequences[{i}]: the model's output is NaN or infinite for this input"
                if rows.block.dtype.kind == "f":
                    bad += (f" (largest |feature| {float(np.abs(rows.block[i, : rows.lengths[i]]).max()):.3g});"
                            " scale the features")
                self.error = ValidationError(bad)
                return
        self.pieces.append((index, hidden, pooled, at))

    def _gathered(self) -> tuple[np.ndarray | None, np.ndarray]:
        """The ticket's rows of hidden states [n, T, D] (None: it reads none, and its runs may not have fetched
        them) and pooled [n, D]: views of the run's outputs when all its rows ran as one piece, else gathered
        from its pieces."""
        rows, wants = self.ticket.rows, reads_hidden(self.ticket.request)
        n, longest = len(rows), rows.longest
        if len(self.pieces) == 1 and self.pieces[0][0] is None:
            _, hidden, pooled, at = self.pieces[0]
            return (hidden[at:at + n, :longest] if wants else None), pooled[at:at + n]
        first_hidden, first_pooled = self.pieces[0][1], self.pieces[0][2]
        hidden = np.zeros((n, longest, first_hidden.shape[-1]), first_hidden.dtype) if wants else None
        pooled = np.empty((n, first_pooled.shape[-1]), first_pooled.dtype)
        for index, run_hidden, run_pooled, at in self.pieces:
            count = n if index is None else len(index)
            target = slice(None) if index is None else index
            if hidden is not None:
                width = min(longest, run_hidden.shape[1])
                hidden[target, :width] = run_hidden[at:at + count, :width]
            pooled[target] = run_pooled[at:at + count]
        return hidden, pooled

    def finish(self, provider: str, dense: tuple[Dense, ...] = ()) -> None:
        """Answers the ticket: its outputs (serve/core/pooling.py, `dense` the model's projection) or its error."""
        ticket = self.ticket
        if self.error is not None:
            ticket._finish(error=self.error)
            return
        hidden, pooled = self._gathered()
        hidden_states, embeddings, scores = request_outputs(ticket.request, hidden, pooled, ticket.rows.lengths, dense)
        ticket._finish(EncodeResult(
            request_id=ticket.request.request_id,
            hidden_states=hidden_states,
            embeddings=embeddings,
            scores=scores,
            queue_s=self.queue_s,
            inference_s=self.inference_s,
            batch_size=self.batch_size,
            batch_length=self.batch_length,
            execution_provider=provider,
            token_counts=tuple(ticket.rows.lengths.tolist()),
            truncated=ticket.request.truncated,
            attention_paths=tuple(self.paths),
        ))
