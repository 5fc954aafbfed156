"""One scheduler for the machine: which model's batch runs next, and how many run at once.

Every model keeps its own queue, limits and batcher (serve/core/batcher.py); before a batcher's
worker forms a batch it asks the scheduler for a run slot, with the arrival time of the oldest request
it holds. There are `slots` run slots for the whole server (ServerConfig.instances), whatever the
number of models, so two models never run more batches at once than one model may: each session's
intra-op pool is sized for its share of the CPUs (serve/backend/session.py), and the slots keep those
shares from adding up past the machine. A freed slot goes to the waiter holding the OLDEST request,
so a flooded model cannot starve a quiet one: the quiet model's request is older than everything the
flooded model queued after it, and runs next. On CUDA the models share the device the same way.

A worker forms its batch only once it holds a slot, so requests that arrive while it waits join it.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from typing import Callable


class Scheduler:
    def __init__(self, slots: int = 1) -> None:
        self.slots = max(1, slots)
        self._cond = threading.Condition()
        self._running = 0
        self._waiting: list[tuple[float, int]] = []  # heap of (oldest request's arrival, ticket number)
        self._numbers = itertools.count()

    def acquire(self, oldest: float, give_up: Callable[[], bool] = lambda: False) -> bool:
        """Blocks until a slot is free and no waiter holds an older request; True with the slot held,
        False when `give_up()` became true first (checked whenever `wake` is called)."""
        entry = (oldest, next(self._numbers))
        with self._cond:
            heapq.heappush(self._waiting, entry)
            try:
                while self._running >= self.slots or self._waiting[0] != entry:
                    if give_up():
                        return False
                    self._cond.wait()
                self._running += 1
                return True
            finally:
                self._waiting.remove(entry)
                heapq.heapify(self._waiting)
                self._cond.notify_all()

    def release(self) -> None:
        with self._cond:
            self._running -= 1
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
