"""One scheduler for the machine: which model's batch runs next, and how many run at once.

Every model keeps its own queue, limits and batcher (serve/core/batcher.py); before a batcher's
worker forms a batch it asks the scheduler for a run slot, naming its model and the arrival time of
the oldest request it holds. There are `slots` run slots for the whole server (ServerConfig.instances),
whatever the number of models: each session's intra-op pool is sized for one slot's share of the CPUs
(serve/backend/session.py), and the slots keep those shares from adding up past the machine, where
two processes would each size their pool for all of it and fight.

Three rules decide who runs:
  - while another model is active (it asked for a slot in the last ACTIVE_S), a model may hold at
    most `slots - 1` slots: one stays free for the other, so a quiet model's request finds a slot
    and its run does not share the cores with more runs than the slots allow; a model alone takes
    every slot (and a batch that runs alone, the wide session);
  - a model with waiting work and no batch running may always start one, even past the slots (the
    express run: the first request of a model that wakes while another holds every slot does not
    wait for its batches to end; at most one per model);
  - past that, a freed slot goes to the eligible waiter holding the OLDEST request, so a flooded
    model cannot starve another.
On CUDA the models share the device the same way.

A worker forms its batch only once it holds a slot, so requests that arrive while it waits join it.
"""

from __future__ import annotations

import itertools
import threading
import time
from typing import Callable

ACTIVE_S = 0.5  # a model that asked for a slot this recently is active: the others leave it one

class Scheduler:
    def __init__(self, slots: int = 1, active_s: float = ACTIVE_S) -> None:
        self.slots = max(1, slots)
        self.active_s = active_s
        self._cond = threading.Condition()
        self._running = 0
        self._by_model: dict[object, int] = {}  # runs going per model
        self._asked: dict[object, float] = {}  # when each model last asked for a slot (monotonic)
        self._waiting: list[tuple[float, int, object]] = []  # (oldest request's arrival, number, model)
        self._numbers = itertools.count()

    def _others_active(self, model: object, now: float) -> bool:
        return any(other is not model and (now - asked < self.active_s or self._by_model.get(other))
                   for other, asked in self._asked.items())

    def _eligible(self, model: object, now: float) -> bool:
        runs = self._by_model.get(model, 0)
        if not runs:
            return True  # the express run
        cap = self.slots - 1 if self.slots > 1 and self._others_active(model, now) else self.slots
        return self._running < self.slots and runs < cap

    def acquire(self, oldest: float, give_up: Callable[[], bool] = lambda: False, model: object = None) -> bool:
        """Blocks until `model` may run (module docstring) and no eligible waiter holds an older
        request; True with the slot held (`release(model)` gives it back), False when `give_up()`
        became true first (checked whenever `wake` is called)."""
        entry = (oldest, next(self._numbers), model)
        with self._cond:
            self._waiting.append(entry)
            self._asked[model] = time.monotonic()
            try:
                while True:
                    now = time.monotonic()
                    if self._eligible(model, now) and min(
                            w[:2] for w in self._waiting if self._eligible(w[2], now)) == entry[:2]:
                        break
                    if give_up():
                        return False
                    self._cond.wait(self.active_s)  # another model's activity may lapse meanwhile
                self._take(model)
                return True
            finally:
                self._waiting.remove(entry)
                self._cond.notify_all()

    def try_acquire(self, model: object = None) -> bool:
        """A run slot for `model` at once, or False: only while one is free, no one waits for a slot and the
        rules above let `model` run (an express run: serve/core/batcher.py)."""
        with self._cond:
            now = time.monotonic()
            if self._waiting or self._running >= self.slots or not self._eligible(model, now):
                return False
            self._asked[model] = now
            self._take(model)
            return True

    def _take(self, model: object) -> None:
        """Counts a run slot granted to `model` (`release` gives it back). Under the condition's lock."""
        self._running += 1
        self._by_model[model] = self._by_model.get(model, 0) + 1

    def release(self, model: object = None) -> None:
        with self._cond:
            self._running -= 1
            left = self._by_model[model] - 1
            if left:
                self._by_model[model] = left
            else:
                del self._by_model[model]
            self._cond.notify_all()

    def forget(self, model: object) -> None:
        """A model that will ask no more (its batcher stopped: unloaded or replaced)."""
        with self._cond:
            self._asked.pop(model, None)
            self._cond.notify_all()

    def wake(self) -> None:
        """Lets waiters re-check their `give_up` (a batcher stopping)."""
        with self._cond:
            self._cond.notify_all()

    def alone(self, model: object = None) -> bool:
        """One batch runs (the caller's), no other waits and no other model is active: it may use
        every CPU (Backend.has_wide)."""
        with self._cond:
            return (self._running == 1 and not self._waiting
                    and not self._others_active(model, time.monotonic()))

    def busy(self) -> tuple[int, int]:
        """(runs going, workers waiting for a slot): for logs and tests."""
        with self._cond:
            return self._running, len(self._waiting)
