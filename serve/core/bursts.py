"""A queue that its own thread empties in bursts: items are put from any thread, and the thread hands everything
put since its last pass to `handle(items)` at once. A lone item leaves alone and at once; under load, what
gathers while the thread works leaves together, so a cost paid per pass (a message on the wire, a wake-up, a
hand-off of the GIL) is paid per burst instead of per item.

Its users: a front end's sender (serve/core/remote.py: its requests to the engine), the engine's outbox
(serve/assembly/front_ends.py: the answers to each front end), and a batcher's finisher (serve/core/batcher.py:
the answers of a run, assembled while the next one starts).
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

from serve import logs

log = logging.getLogger("serve.core.bursts")


class BurstQueue:
    def __init__(self, name: str, handle: Callable[[list], None], lock: threading.RLock | None = None,
                 handled: Callable[[], None] | None = None) -> None:
        """`handle(items)` runs on the thread `name`; `lock`: its owner's (under which `handled()` is called
        after each pass, and `unhandled` may be read), so that a wait on the owner's condition sees the queue
        emptied."""
        self._cond = threading.Condition(lock)
        self._handle, self._handled = handle, handled
        self._items: list = []
        self._taken: list = []  # the pass in hand
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def put(self, item) -> None:
        with self._cond:
            self._items.append(item)
            if len(self._items) == 1:  # else the thread was woken already and has not taken them yet
                self._cond.notify()

    def unhandled(self) -> list:
        """What was put and is not handled yet (the pass in hand included), oldest first."""
        with self._cond:
            return [*self._taken, *self._items]

    def stop(self, timeout: float = 5.0) -> None:
        """Ends the thread once it has handed over everything put before."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _loop(self) -> None:
        logs.name_thread(self._thread.name)
        while True:
            with self._cond:
                while not self._items and not self._stopping:
                    self._cond.wait()
                if not self._items:
                    return
                self._taken, self._items = self._items, []
            try:
                self._handle(self._taken)
            except Exception as error:  # the thread outlives any one pass; `handle` answers its own failures
                logs.event(log, "burst_failed", logging.ERROR, thread=self._thread.name, error=repr(error),
                           items=len(self._taken))
            finally:
                with self._cond:
                    self._taken = []
                    if self._handled is not None:
                        self._handled()
