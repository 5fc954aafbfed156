"""Running one formed batch (serve/core/batcher.py forms it): which attention path each row takes,
how the rows are cut into session.runs (serve/core/batch_plan.py), padding them (serve/backend/feeds.py,
the one place that pads), the backend call, and each request's outputs as its rows complete
(serve/core/pooling.py). The batcher owns the queue and the workers; this module owns a run.
"""

from __future__ import annotations

import time
from typing import Callable

import numpy as np

from model.attention_paths import DENSE, PATHS, SPARSE
from model.config import EncoderConfig
from model.mask_kinds import MaskKind
from serve.backend.feeds import Row, pad_batch
from serve.backend.session import Backend
from serve.core.attention_budget import AttentionBudget
from serve.core.batch_plan import RunCost, plan_runs
from serve.core.pooling import row_output
from serve.core.requests import EncodeResult, SequenceOutput
from serve.errors import ValidationError


class BatchRunner:
    def __init__(self, backend: Backend, config: EncoderConfig, *, observe: Callable[..., None],
                 run_cost: RunCost | None = None, budget: AttentionBudget | None = None) -> None:
        self.backend = backend
        self.config = config
        self._observe = observe
        self.run_cost = run_cost  # None: one session.run per batch; else length-sorted runs (batch_plan)
        # picks each row's attention path and bounds a batch's attention memory; None: dense, unbounded
        self.budget = budget
        # a session on every CPU for a batch that runs alone (Backend.has_wide; test doubles have none)
        self.has_wide = bool(getattr(backend, "has_wide", False))

    def run(self, batch: list, wide: bool = False) -> None:
        """Runs the batch's rows: as one session.run, or as length-sorted runs (serve/core/batch_plan.py)
        when a RunCost is set and splitting saves work. Each ticket finishes as soon as its last row
        has run, so short requests in a mixed batch come back first. `wide`: the batch runs alone on
        the machine, so its dense runs may take the backend's session on every CPU."""
        slots = [(ticket, i) for ticket in batch for i in range(len(ticket.rows))]
        runs = []
        for path, group in self._by_path(slots):
            if self.run_cost is None:
                runs.append((path, group))
            else:
                plan = plan_runs([slots[k][0].rows[slots[k][1]].length for k in group], self.run_cost)
                runs += [(path, [group[k] for k in run]) for run in plan]
        progress = {ticket: _Progress(ticket) for ticket in batch}
        provider = self.backend.info.execution_provider
        for number, (path, run) in enumerate(runs):
            members = [slots[k] for k in run]
            rows = [ticket.rows[i] for ticket, i in members]
            length = max(row.length for row in rows)
            feeds = pad_batch(rows, length, self.config, path)
            started, cpu = time.monotonic(), time.thread_time()
            if path != DENSE:
                hidden, pooled = self.backend.encode(feeds, path)
            elif wide and self.has_wide:
                hidden, pooled = self.backend.encode(feeds, wide=True)
            else:
                hidden, pooled = self.backend.encode(feeds)
            inference_s, run_cpu_s = time.monotonic() - started, time.thread_time() - cpu
            # the run's answers are finite (else: row by row); hidden states only where one is answered
            finite = bool(np.isfinite(pooled).all()) and (
                not any(t.request.hidden_states or t.request.pooling == "first" for t, _ in members)
                or bool(np.isfinite(hidden).all()))
            tokens = sum(row.length for row in rows)
            self._observe(batch_size=len(rows), batch_tokens=len(rows) * length, inference_s=inference_s,
                          padding_tokens=len(rows) * length - tokens, path=path, run_cpu_s=run_cpu_s)
            for index, (ticket, i) in enumerate(members):
                row = rows[index]
                progress[ticket].add(i, row, hidden[index, : row.length], pooled[index],
                                     run=number, started=started, inference_s=inference_s,
                                     batch_size=len(rows), batch_length=length, path=path, finite=finite)
            for ticket in dict.fromkeys(ticket for ticket, _ in members):  # each once, in order
                if progress[ticket].complete and not ticket.done():
                    self._observe(queue_s=progress[ticket].queue_s)  # every method alike; before the answer
                    progress[ticket].finish(provider)


    def _by_path(self, slots: list[tuple]) -> list[tuple[str, list[int]]]:
        """Slot indices grouped by the attention path each row runs on, dense first. Sparse rows are
        grouped by their step too (a sparse run's strided rows share one step; window-only rows run
        apart, so they never pay for a strided layout)."""
        if self.budget is None:
            return [(DENSE, list(range(len(slots))))]
        groups: dict[tuple[str, int], list[int]] = {}
        for k, (ticket, i) in enumerate(slots):
            row = ticket.rows[i]
            path = self.budget.path(row)
            kind = MaskKind(row.kind)
            # bidirectional/causal rows on a plan's sparse graph are step-1 rows on its global layers
            step = (row.step if kind.uses_step else 1 if kind in (MaskKind.BIDIRECTIONAL, MaskKind.CAUSAL) else 0) \
                if path == SPARSE else 0
            groups.setdefault((path, step), []).append(k)
        order = sorted(groups, key=lambda key: (PATHS.index(key[0]), key[1]))
        return [(key[0], groups[key]) for key in order]


class _Progress:
    """One ticket's rows as their runs complete; `finish` answers it once all have run."""

    __slots__ = ("ticket", "outputs", "paths", "left", "first_start", "inference_s", "last_run", "batch_size",
                 "batch_length", "error")

    def __init__(self, ticket) -> None:
        self.ticket = ticket
        self.outputs: list[SequenceOutput | None] = [None] * len(ticket.rows)
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

    def add(self, i: int, row: Row, hidden: np.ndarray, pooled: np.ndarray, *, run: int, started: float,
            inference_s: float, batch_size: int, batch_length: int, path: str = DENSE,
            finite: bool = False) -> None:
        """Takes row `i`'s outputs; `finite`: the whole run's outputs are known finite (no row check)."""
        if self.error is not None:
            return
        self.paths[i] = path
        if self.first_start is None:
            self.first_start = started
        if run != self.last_run:
            self.last_run = run
            self.inference_s += inference_s
        # runs go shortest first, so the last run a ticket is in holds its longest row: report that one
        self.batch_size, self.batch_length = batch_size, batch_length
        self.left -= 1
        if not finite and not (np.isfinite(hidden).all() and np.isfinite(pooled).all()):
            # finite but extreme raw features can overflow inside the model: never answer NaN
            bad = f"sequences[{i}]: the model's output is NaN or infinite for this input"
            if row.inputs.dtype.kind == "f":
                bad += f" (largest |feature| {float(np.abs(row.inputs).max()):.3g}); scale the features"
            self.error = ValidationError(bad)
            return
        self.outputs[i] = row_output(self.ticket.request, hidden, pooled)

    def finish(self, provider: str) -> None:
        ticket = self.ticket
        if self.error is not None:
            ticket._finish(error=self.error)
            return
        ticket._finish(EncodeResult(
            request_id=ticket.request.request_id,
            outputs=tuple(self.outputs),
            queue_s=self.queue_s,
            inference_s=self.inference_s,
            batch_size=self.batch_size,
            batch_length=self.batch_length,
            execution_provider=provider,
            token_counts=tuple(row.length for row in ticket.rows),
            truncated=ticket.request.truncated,
            attention_paths=tuple(self.paths),
        ))
