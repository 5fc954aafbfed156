"""Admission: which engine a call runs on, and the calls in flight (what a drain waits for).

Every protocol's calls come through `admit` (serve/protocols/), on every transport: it refuses with
UNAVAILABLE (retry-safe) unless the server is serving, and counts the call in flight until the call
ends (its context's end callback), so a drain answers everything admitted before it stops. The
server (serve/assembly/app.py) moves the state: starting -> loading -> serving -> draining -> stopped.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

from serve.core.engine import Engine
from serve.errors import Unavailable

NOT_SERVING = "; not serving (health NOT_SERVING), retry later or on another replica"


class Admission:
    def __init__(self) -> None:
        self.state = "starting"
        self._engine: Engine | None = None
        self._calls = threading.Condition(threading.Lock())
        self._in_flight = 0
        self._last_arrival = float("-inf")
        self.refused_draining = 0
        self._drain_hooks: set[Callable[[], None]] = set()  # streams: end once answered (EncodeStream)

    # -- the engine --------------------------------------------------------------------------
    def engine(self) -> Engine:
        engine, state = self._engine, self.state
        if state != "serving" or engine is None:
            reason = {"draining": "server is shutting down", "stopped": "server stopped"}.get(
                state, "model is loading")
            raise Unavailable(f"{reason}{NOT_SERVING}")
        return engine

    def current(self) -> Engine | None:
        """The engine admitted calls run on (None before the first load)."""
        return self._engine

    def loading(self) -> None:
        self.state = "loading"

    def serving(self, engine: Engine) -> bool:
        """Serves `engine`; False when a drain began while it loaded (nothing changes then)."""
        with self._calls:
            if self.state != "loading":
                return False
            self._engine, self.state = engine, "serving"
            return True

    def swap(self, old: Engine, new: Engine) -> bool:
        """Replaces `old` by `new` in one assignment (a call sees one or the other, never a mix);
        False when not serving `old` any more."""
        with self._calls:
            if self.state != "serving" or self._engine is not old:
                return False
            self._engine = new
            return True

    # -- calls -------------------------------------------------------------------------------
    def admit(self, context=None, on_drain: Callable[[], None] | None = None) -> Engine:
        """The engine for a call, which counts as in flight until the call ends (`context`'s end
        callback). Unavailable (retry-safe) while loading or draining. `on_drain` (streams) is called
        once when a drain starts; without `context`, nothing is counted."""
        with self._calls:
            self._last_arrival = time.monotonic()
            try:
                engine = self.engine()
            except Unavailable:
                if context is not None and self.state == "draining":
                    self.refused_draining += 1
                raise
            if context is None:
                return engine
            self._in_flight += 1
            if on_drain is not None:
                self._drain_hooks.add(on_drain)

        def ended() -> None:
            with self._calls:
                self._in_flight -= 1
                self._drain_hooks.discard(on_drain)
                self._calls.notify_all()

        if not context.add_callback(ended):  # the call already ended
            ended()
        return engine

    def in_flight(self) -> int:
        with self._calls:
            return self._in_flight

    # -- draining ----------------------------------------------------------------------------
    def drain(self) -> list[Callable[[], None]] | None:
        """Stops admitting (state draining); the open streams' drain hooks, to call. None when a
        drain had begun already."""
        with self._calls:
            if self.state in ("draining", "stopped"):
                return None
            self.state = "draining"
            return list(self._drain_hooks)

    def wait_calls(self, until: float) -> bool:
        """Waits until no admitted call is in flight; False when `until` (monotonic) came first."""
        with self._calls:
            while self._in_flight:
                remaining = until - time.monotonic()
                if remaining <= 0:
                    return False
                self._calls.wait(remaining)
        return True

    def wait_quiet(self, quiet: float, until: float) -> None:
        """Waits until no call has arrived for `quiet` s (late callers meanwhile get UNAVAILABLE from
        us, not CANCELLED from a stopping transport), or until `until`."""
        with self._calls:
            while True:
                now = time.monotonic()
                wake = min(self._last_arrival + quiet, until)
                if now >= wake:
                    return
                self._calls.wait(wake - now)

    def stopped(self) -> None:
        self.state = "stopped"
