"""The native transport: gRPC C++ (native/transport.cc) carries the bytes, Python does the rest.

Why: grpcio's Python server costs ~0.34 ms of CPU per unary call here before any of our code runs
(bench/bare_server.py, docs/performance.md) and wakes a handler thread per request; Triton's C++ front
end costs ~0.26 ms in all. Here gRPC C++ owns HTTP/2, TLS and the call objects, and hands Python every
event that arrived since the last look in ONE wake-up (`Transport.next`): one pump thread routes them
(serve/transport/rpc.py Router), so a burst of requests is parsed, validated and queued for the batcher
in one go, and each is answered from the batcher's thread when its batch has run: the answer is handed to
C++'s writer thread (`Transport.finish`), which runs gRPC's write path without the GIL (an answer the pump made
itself is sent on the pump, the GIL released: no writer to wake). C++ holds no request rule, no limit but
gRPC's own receive size, no status text: every check lives once, in Python, and
the grpcio transport (serve/transport/grpcio.py) runs the very same Router where this module is not
built (`python -m tools.native_build`, `make native`).
"""

from __future__ import annotations

import importlib
import logging
import threading

import grpc

from serve import logs
from serve.core import express
from serve.errors import Unavailable
from serve.transport.rpc import Router, Rpc

log = logging.getLogger("serve.transport.native")

POLL_S = 0.25  # how often the idle pump looks up (to notice a stop)


def load_module():
    """The compiled transport; Unavailable naming the build command when it is missing."""
    try:
        return importlib.import_module("serve._native._transport")
    except ImportError as error:
        raise Unavailable(f"the native transport is not built ({error}); run `python -m tools.native_build` "
                          f"(make native)") from None


def missing_reason() -> str | None:
    """Why the native transport cannot run here, or None."""
    try:
        load_module()
    except Unavailable as error:
        return error.message
    return None


class NativeRpc(Rpc):
    def __init__(self, owner: "NativeTransport", call_id: int, method: str, metadata, remaining,
                 arrived: float) -> None:
        super().__init__(method, metadata, remaining, received=arrived)
        self._owner, self._id = owner, call_id

    def _send(self, payload: bytes) -> None:
        self._owner._t.write(self._id, payload)

    def _close(self, code: grpc.StatusCode, message: str, payload: bytes | None) -> None:
        # sent by C++, never under the GIL: on the answering thread when it answers alone (express.answering_alone:
        # the pump, for an express run or a refusal, has nothing else to do, and waking the writer would cost more
        # than the send; a front end's link with one answer), else handed to C++'s writer thread (the batcher's
        # answers: no hop through the pump, the batcher goes on)
        self._owner._t.finish(self._id, code.value[0], message, payload, express.alone())

    def _end(self) -> bool:
        ended = super()._end()
        if ended:
            self._owner._calls.pop(self._id, None)
            self._owner._unary.pop(self._id, None)
        return ended


class NativeTransport:
    name = "native"

    def __init__(self, address: str, router: Router, streaming: list[str], max_receive_bytes: int,
                 tls: tuple[bytes, bytes, bytes] | None, streams: list[str] = ()) -> None:
        module = load_module()
        self._m = module
        self._t = module.Transport()
        pem = None if tls is None else tuple(x.decode() for x in tls)
        self.port = self._t.start(address, max_receive_bytes, pem, streaming)
        self._router = router
        self._calls: dict[int, NativeRpc] = {}  # open calls the router may still hear of (streams, cancels)
        # the open calls among them that are one message each way (a stream such as Watch may stay open); `streams`:
        # the methods where either side streams (Registry.streams)
        self._unary: dict[int, NativeRpc] = {}
        self._streams = frozenset(streams)
        self._stopping = False
        self._thread = threading.Thread(target=self._pump, name="transport-pump", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _pump(self) -> None:
        logs.name_thread("transport-pump")
        with express.answering_alone(True):  # what the pump answers itself, it sends itself (NativeRpc._close)
            self._route()

    def _route(self) -> None:
        m, t, router, calls, unary, streams = (self._m, self._t, self._router, self._calls, self._unary,
                                                self._streams)
        START, MESSAGE, HALF_CLOSE = m.START, m.MESSAGE, m.HALF_CLOSE
        while not self._stopping:
            events = t.next(POLL_S)
            last = events[-1] if events else None
            for event in events:
                kind, call_id = event[0], event[1]
                try:
                    if kind == START:
                        _, _, method, payload, metadata, remaining, arrived = event
                        rpc = calls[call_id] = NativeRpc(self, call_id, method, metadata, remaining, arrived)
                        alone = method not in streams
                        if alone:
                            unary[call_id] = rpc
                        # a unary call with no other open and none read behind it may run here (serve/core/express.py)
                        with express.granted(alone and event is last and len(unary) == 1):
                            router.start(rpc, payload)
                        continue
                    rpc = calls.get(call_id)
                    if rpc is None:  # ended meanwhile
                        continue
                    if kind == MESSAGE:
                        router.message(rpc, event[2])
                    elif kind == HALF_CLOSE:
                        router.half_close(rpc)
                    else:
                        router.cancel(rpc)
                except Exception as error:  # the pump must survive anything a call does
                    logs.event(log, "pump_error", logging.ERROR, error=repr(error))

    def stop(self, grace: float) -> None:
        """Stops listening; what is still open after `grace` s is cancelled by gRPC."""
        self._t.stop(grace)
        self._stopping = True
        self._thread.join(timeout=5)
