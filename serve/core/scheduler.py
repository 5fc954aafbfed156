"""One scheduler for the machine: which model's batch runs next, and how many run at once.

Every model keeps its own queue, limits and batcher (serve/core/batcher.py); before a batcher's
worker forms a batch it asks the scheduler for a run slot, naming its model and the arrival time of
the oldest request it holds. There are `slots` run slots for the whole server (ServerConfig.instances),
whatever the number of models: each session's intra-op pool is sized for one slot's share of the CPUs
(serve/backend/session.py), and the slots keep those shares from adding up past the machine, where
two processes would each size their pool for all of it and fight.

Two rules decide who runs:
  - a model with waiting work and no batch running may always start one, even past the slots: a
    quiet model's request never waits for a flooded model's batches to end (the express run: at
    most one per model, so the machine is over-committed by at most one short run per other model);
  - past that, a freed slot goes to the eligible waiter holding the OLDEST request, so a flooded
    model cannot starve another.
On CUDA the models share the device the same way.

A worker forms its batch only once it holds a slot, so requests that arrive while it waits join it.
"""

from __future__ import annotations

import itertools
import threading
from typing import Callable


class Scheduler:
    def __init__(self, slots: int = 1) -> None:
        self.slots = max(1, slots)
        self._cond = threading.Condition()
        self._running = 0
        self._by_model: dict[object, int] = {}  # runs going per model
        self._waiting: list[tuple[float, int, object]] = []  # (oldest request's arrival, number, model)
        self._numbers = itertools.count()

    def _eligible(self, model: object) -> bool:
        return self._running < self.slots or not self._by_model.get(model)

    def acquire(self, oldest: float, give_up: Callable[[], bool] = lambda: False, model: object = None) -> bool:
        """Blocks until `model` may run (module docstring) and no eligible waiter holds an older
        request; True with the slot held (`release(model)` gives it back), False when `give_up()`
        became true first (checked whenever `wake` is called)."""
        entry = (oldest, next(self._numbers), model)
        with self._cond:
            self._waiting.append(entry)
            try:
                while not (self._eligible(model) and
                           min(w for w in self._waiting if self._eligible(w[2]))[:2] == entry[:2]):
                    if give_up():
                        return False
                    self._cond.wait()
                self._running += 1
                self._by_model[model] = self._by_model.get(model, 0) + 1
                return True
            finally:
                self._waiting.remove(entry)
                self._cond.notify_all()

    def release(self, model: object = None) -> None:
        with self._cond:
            self._running -= 1
            left = self._by_model[model] - 1
            if left:
                self._by_model[model] = left
            else:
                del self._by_model[model]
            self._cond.notify_all()

    def wake(self) -> None:
        """Lets waiters re-check their `give_up` (a batcher stopping)."""
        with self._cond:
            self._cond.notify_all()

    def alone(self) -> bool:
        """One batch runs (the caller's) and no other waits: it may use every CPU (Backend.has_wide)."""
        return self._running == 1 and not self._waiting

    def busy(self) -> tuple[int, int]:
        """(runs going, workers waiting for a slot): for logs and tests."""
        with self._cond:
            return self._running, len(self._waiting)
