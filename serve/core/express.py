"""The express run's permission: a transport's word that nothing waits behind the call it is starting.

An idle model (nothing queued or running, a run slot free) gains nothing from handing a lone request to its
batcher's thread: the batch would be that request alone. Where the caller may also run it (it has no other
call waiting to be read), the batcher runs it on the caller's thread instead (serve/core/batcher.py
`Batcher.submit`): one thread for the whole call, no wake-up of another, no batch to form. Measured on the
tiny export, one gRPC client back to back: p50 -3 to -17 % (median -11 %) and 2-20 % less CPU per call, eleven
pairs of servers (docs/performance.md "The express run").

Who gives it: the transports whose one thread reads every call, to a call that is the only one in flight on them,
so no other call's reading waits behind the run: the native gRPC transport's pump (no other unary call open, none
read behind it: serve/transport/native.py) and the HTTP transport's event loop (no other request between its
hand-off and its answer: serve/transport/http.py). Under load some call is always in flight, so batches form as
before. The grpcio fallback does not give it (its calls run on a pool). A call is granted at most one express run:
a verb that submits twice queues the second.

Behind front ends (--front-ends, serve/assembly/front_ends.py), the same grant carries the call across: a front end's
granted call is sent to the engine on the pump's thread (no wake-up of the link's sender thread, serve/core/remote.py),
the engine grants a message of one request, with none other in flight from any front end, an express run on the
thread that read it, and sends its answer from there (no outbox thread); the front end's link, given one answer with no
other call in flight, answers it alone (`answering_alone`): the transport sends it on the link's thread instead of
waking its writer. Measured with one front end, one gRPC client, tiny export: five pairs of servers, p50 2.39 -> 2.12 ms
(medians), the engine's and the front end's CPU per call 2,325 -> 1,955 µs (docs/performance.md "Behind front ends").
"""

from __future__ import annotations

import contextvars

_ALLOWED: contextvars.ContextVar[bool] = contextvars.ContextVar("express_allowed", default=False)
_ALONE: contextvars.ContextVar[bool] = contextvars.ContextVar("answering_alone", default=False)


class _Scope:
    """`with Scope(on):` sets its flag for what the block does on this thread when `on`, and restores it after (a
    class, not a generator: the transports wrap every unary call in one)."""

    __slots__ = ("on", "token")
    flag: contextvars.ContextVar[bool]

    def __init__(self, on: bool) -> None:
        self.on = on
        self.token: contextvars.Token | None = None

    def __enter__(self) -> None:
        if self.on:
            self.token = self.flag.set(True)

    def __exit__(self, *exception) -> None:
        if self.token is not None:
            self.flag.reset(self.token)


class granted(_Scope):
    """`with granted(allowed):` grants the express run to what the block starts on this thread, when `allowed`."""

    __slots__ = ()
    flag = _ALLOWED


def take() -> bool:
    """True once per grant: the caller may run its request on this thread."""
    if not _ALLOWED.get():
        return False
    _ALLOWED.set(False)
    return True


class answering_alone(_Scope):
    """`with answering_alone(alone):` says, when `alone`, that the answers made in the block are the only work of
    this thread meanwhile (the native transport's pump, for as long as it runs; a front end's link with one answer in
    hand and no other call in flight), so a transport may send them on it instead of waking a writer thread
    (serve/transport/native.py)."""

    __slots__ = ()
    flag = _ALONE


def alone() -> bool:
    """Whether this thread answers alone (`answering_alone`)."""
    return _ALONE.get()
