"""Admission: which engine a call runs on (by model name), the calls in flight (what a drain waits for), and
whether the server is ready (`ready`: the one answer every health surface gives).

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
from serve.errors import NotFound, Unavailable, ValidationError, listing, quote

NOT_SERVING = "; not serving (health NOT_SERVING), retry later or on another replica"
LIST_NAMES = 8  # model names a message lists before "and N more"


def names(engines) -> str:
    """The served model names for a message: sorted, at most LIST_NAMES of them."""
    return listing(sorted(engines), LIST_NAMES)


class Admission:
    def __init__(self, default_model: str = "") -> None:
        self.state = "starting"
        # the served models by name (serve/assembly/repository.py); one assignment per change, so a
        # call sees a model's old engine or its new one, never a mix
        self._engines: dict[str, Engine] = {}
        self._changing: dict[str, str] = {}  # name -> "loading" | "unloading": refused UNAVAILABLE meanwhile
        self.default_model = default_model  # what an empty model name means beside others (--default-model)
        self._calls = threading.Condition(threading.Lock())
        self._in_flight = 0
        self._per_engine: dict[Engine, int] = {}  # admitted calls per engine (an unload waits for its own)
        self._last_arrival = float("-inf")
        self.refused_draining = 0
        self._drain_hooks: set[Callable[[], None]] = set()  # streams: end once answered (EncodeStream)
        self._leaving = False  # SIGTERM's drain delay: still admitting, but no longer ready (`leave`)
        # called after every change of the state or of the served models (the engine process tells its front
        # ends: serve/assembly/front_ends.py); None: nobody listens
        self.on_change: Callable[[], None] | None = None

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    def snapshot(self) -> tuple[str, bool, dict[str, Engine], dict[str, str]]:
        """(state, leaving, the served engines, the models loading or unloading), as one consistent view."""
        with self._calls:
            return self.state, self._leaving, dict(self._engines), dict(self._changing)

    def mirror(self, leaving: bool, engines: dict[str, Engine], changing: dict[str, str]) -> None:
        """Takes another process's view (a front end's, of the engine's `snapshot`): the models it serves and
        their changes, and `leaving`. The state stays this process's own (its load and its drain set it)."""
        with self._calls:
            if self.state == "serving":  # before: its load takes them (`serving`)
                self._engines = dict(engines)
            self._changing = dict(changing)
            self._leaving = self._leaving or leaving

    # -- readiness ---------------------------------------------------------------------------
    def ready(self) -> bool:
        """The one readiness every surface reports (gRPC health, KServe v2 ServerReady/ModelReady over gRPC
        and REST, HTTP /health): serving, and not leaving."""
        return self.state == "serving" and not self._leaving

    def leave(self) -> None:
        """Reports not ready from now on while still admitting calls (the drain delay before a drain, so
        balancers take this replica out before it refuses anything)."""
        self._leaving = True
        self._changed()

    # -- the engines -------------------------------------------------------------------------
    def engine(self, model: str = "") -> Engine:
        """The engine serving `model` ("": the only one, else --default-model). Unavailable unless the
        server is serving or while that model loads or unloads; NotFound naming the served models."""
        self._serving()
        engines = self._engines
        name = model or self.default_model
        if not name:
            if len(engines) == 1:
                return next(iter(engines.values()))
            if not engines:
                raise NotFound("no model is loaded on this server (load one: POST /v2/repository/models/{name}/load)")
            raise ValidationError(f"model: this server serves {len(engines)} models ({names(engines)}); name one "
                                  "(or start the server with --default-model)")
        engine = engines.get(name)
        if engine is not None:
            return engine
        if name in self._changing:
            raise Unavailable(f"model {quote(name)} is {self._changing[name]}; retry shortly")
        served = f"this server serves {names(engines)}" if engines else "no model is loaded on this server"
        raise NotFound(f"model {quote(name)} is not served here; {served}")

    def _serving(self) -> None:
        """Unavailable (retry-safe) unless the server is serving."""
        state = self.state
        if state != "serving":
            reason = {"draining": "server is shutting down", "stopped": "server stopped"}.get(
                state, "model is loading")
            raise Unavailable(f"{reason}{NOT_SERVING}")

    def engines(self) -> dict[str, Engine]:
        """The served engines by name (a copy)."""
        return dict(self._engines)

    def current(self) -> list[Engine]:
        """Every engine admitted calls may run on (none before the first load)."""
        return list(self._engines.values())

    def loading(self) -> None:
        self.state = "loading"

    def serving(self, engines: dict[str, Engine]) -> bool:
        """Serves `engines`; False when a drain began while they loaded (nothing changes then)."""
        with self._calls:
            if self.state != "loading":
                return False
            self._engines, self.state = dict(engines), "serving"
        self._changed()
        return True

    def changing(self, name: str, what: str | None) -> None:
        """Marks `name` as loading or unloading (its calls get UNAVAILABLE saying so); None: done."""
        with self._calls:
            if what is None:
                self._changing.pop(name, None)
            else:
                self._changing[name] = what
        self._changed()

    def add(self, name: str, engine: Engine) -> bool:
        """Serves `engine` as `name` beside the others; False when not serving (nothing changes)."""
        with self._calls:
            if self.state != "serving" or name in self._engines:
                return False
            self._engines = {**self._engines, name: engine}
        self._changed()
        return True

    def remove(self, name: str) -> Engine | None:
        """Stops admitting calls to `name` (they get UNAVAILABLE "unloading" until `changing(name, None)`);
        its engine, whose admitted calls still finish (`wait_engine`)."""
        with self._calls:
            engines = dict(self._engines)
            engine = engines.pop(name, None)
            self._engines = engines
        self._changed()
        return engine

    def swap(self, old: Engine, new: Engine) -> bool:
        """Replaces `old` by `new` under the name it serves (one assignment: a call sees one or the
        other, never a mix); False when not serving `old` any more."""
        with self._calls:
            name = next((n for n, e in self._engines.items() if e is old), None)
            if self.state != "serving" or name is None:
                return False
            self._engines = {**self._engines, name: new}
        self._changed()
        return True

    # -- calls -------------------------------------------------------------------------------
    def admit(self, context=None, on_drain: Callable[[], None] | None = None,
              model: str | None = "") -> Engine | None:
        """The engine for a call to `model`, counted as in flight until the call ends (`context`'s end
        callback). Unavailable (retry-safe) while loading or draining. `on_drain` (streams) is called
        once when a drain starts; without `context`, nothing is counted. `model` None (a stream, whose
        messages each name theirs): the call is counted, and no engine is returned."""
        with self._calls:
            self._last_arrival = time.monotonic()
            try:
                engine = self.engine(model) if model is not None else self._serving()
            except Unavailable:
                if context is not None and self.state == "draining":
                    self.refused_draining += 1
                raise
            if context is None:
                return engine
            self._in_flight += 1
            if engine is not None:
                self._per_engine[engine] = self._per_engine.get(engine, 0) + 1
            if on_drain is not None:
                self._drain_hooks.add(on_drain)

        def ended() -> None:
            with self._calls:
                self._in_flight -= 1
                if engine is not None:
                    left = self._per_engine[engine] - 1
                    if left:
                        self._per_engine[engine] = left
                    else:
                        del self._per_engine[engine]
                self._drain_hooks.discard(on_drain)
                self._calls.notify_all()

        if not context.add_callback(ended):  # the call already ended
            ended()
        return engine

    def wait_engine(self, engine: Engine, until: float) -> bool:
        """Waits until no call admitted to `engine` is in flight; False when `until` came first."""
        with self._calls:
            while self._per_engine.get(engine):
                remaining = until - time.monotonic()
                if remaining <= 0:
                    return False
                self._calls.wait(remaining)
        return True

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
            hooks = list(self._drain_hooks)
        self._changed()
        return hooks

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


class Held:
    """A call with no transport context of its own (an EncodeStream message, a front end's request in the
    engine), as `admit` counts it: in flight until `end()`."""

    __slots__ = ("_callbacks",)

    def __init__(self) -> None:
        self._callbacks: list = []

    def add_callback(self, callback) -> bool:
        self._callbacks.append(callback)
        return True

    def end(self) -> None:
        callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback()
