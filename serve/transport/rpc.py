"""One call, whichever transport carries it, and the router that every call goes through.

A transport (serve/transport/native.py: gRPC C++; serve/transport/grpcio.py: grpcio, the fallback)
only moves bytes: it turns what arrived into an `Rpc` and calls the Router's `start` / `message` /
`half_close` / `cancel`; the Router answers through `Rpc.reply` / `write` / `fail`, which the
transport sends. Everything a call is checked against lives above this line, once: the bearer token
(serve/transport/security.py), bytes that are not the method's message (INVALID_ARGUMENT naming the method),
unknown methods (UNIMPLEMENTED), and then the protocol adapters (encoder.v1, KServe v2, Admin, health,
reflection), which admit, validate, batch and map errors to status codes through serve/protocols/edge.py and
serve/errors.py.

Methods come in two kinds:
  started   `start(rpc, payload)` returns at once and answers later (Encode, ModelInfer: the request
            is validated and queued on the transport's own thread, and answered from the batch that
            ran it; no thread waits per request)
  servicer  a grpcio-style servicer method `(request, context)` (or a request iterator for client
            streams), run on a worker thread with the Rpc as its context; what it returns or yields
            is sent. Health's Watch uses its non-blocking form (a send-response callback).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent import futures
from typing import Callable, Iterable

import grpc

from serve import logs
from serve.transport import security
from serve.protocols.edge import NO_DEADLINE_S
from serve.protocols.status import to_status

log = logging.getLogger("serve.transport")

_END = object()  # the end of a client stream


class Abort(Exception):
    """`Rpc.abort`: ends the servicer method with a status (as grpc.ServicerContext.abort)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class Rpc:
    """One call: what the protocol adapters answer through, and the subset of grpc.ServicerContext they
    use. A transport subclasses it with `_send(payload)`, `_close(code, message, payload)`."""

    def __init__(self, method: str, metadata: Iterable[tuple[str, bytes | str]], remaining: float | None,
                 received: float | None = None) -> None:
        """`remaining`: seconds to the call's deadline at `received` (None: none); `received`: when the call
        arrived, on time.monotonic()'s clock (None: now). The call's latency (encoder_request_seconds) and its
        deadline count from it."""
        self.method = method
        self.received = time.monotonic() if received is None else received
        self.deadline = None if remaining is None or remaining > NO_DEADLINE_S else self.received + remaining
        self._raw_metadata = metadata  # decoded when asked (the token check, a servicer): most calls never ask
        self._metadata: tuple | None = None
        self._lock = threading.Lock()
        self._ended = False
        self._callbacks: list[Callable[[], None]] = []
        self._code: grpc.StatusCode | None = None
        self._details = ""
        self.inbox: queue.SimpleQueue | None = None  # client streams: the messages, then _END

    # -- the grpc.ServicerContext subset ----------------------------------------------------
    def time_remaining(self) -> float | None:
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    def invocation_metadata(self) -> tuple:
        if self._metadata is None:
            self._metadata = tuple((k, v.decode("utf-8", "replace") if isinstance(v, bytes) and not k.endswith("-bin")
                                    else v) for k, v in self._raw_metadata)
        return self._metadata

    def add_callback(self, callback: Callable[[], None]) -> bool:
        """Runs `callback` once the call ends (answered or cancelled); False if it has ended already."""
        with self._lock:
            if self._ended:
                return False
            self._callbacks.append(callback)
            return True

    def is_active(self) -> bool:
        return not self._ended

    def abort(self, code: grpc.StatusCode, details: str):
        raise Abort(code, details)

    def set_code(self, code: grpc.StatusCode) -> None:
        self._code = code

    def set_details(self, details: str) -> None:
        self._details = details

    def peer(self) -> str:
        return ""

    # -- answering ---------------------------------------------------------------------------
    def reply(self, payload: bytes) -> None:
        """The unary answer: `payload` with status OK."""
        if self._end():
            self._close(grpc.StatusCode.OK, "", payload)

    def write(self, payload: bytes) -> None:
        """One response message of a server stream."""
        if not self._ended:
            self._send(payload)

    def fail(self, code: grpc.StatusCode, message: str) -> None:
        if self._end():
            self._close(code, message, None)

    def close(self) -> None:
        """Ends a stream with the status a servicer set (OK by default)."""
        if self._end():
            self._close(self._code or grpc.StatusCode.OK, self._details, None)

    def cancelled(self) -> None:
        """The client (or its deadline) ended the call: run the end callbacks; nothing more is sent."""
        if self._end():
            self._gone()

    def _gone(self) -> None:
        """A transport's hook: the call ended without an answer (cancelled)."""

    def _end(self) -> bool:
        """Marks the call ended and runs its callbacks; False when it had ended already."""
        with self._lock:
            if self._ended:
                return False
            self._ended = True
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            try:
                callback()
            except Exception as error:  # a callback's failure must not keep the answer from going out
                logs.event(log, "callback_failed", logging.ERROR, method=self.method, error=repr(error))
        return True

    def _send(self, payload: bytes) -> None:
        raise NotImplementedError

    def _close(self, code: grpc.StatusCode, message: str, payload: bytes | None) -> None:
        raise NotImplementedError


StartedMethod = Callable[[Rpc, bytes], None]


class Registry:
    """What grpcio's generated `add_*Servicer_to_server(servicer, server)` and grpc_reflection register
    into (it stands where a grpc.Server would), plus the started methods: the Router's method table."""

    def __init__(self) -> None:
        self.handlers: dict[str, grpc.RpcMethodHandler] = {}
        self.started: dict[str, tuple[StartedMethod, Callable[[bytes], object]]] = {}
        self.services: list[str] = []

    def add_registered_method_handlers(self, service: str, handlers: dict) -> None:
        self.services.append(service)
        for name, handler in handlers.items():
            self.handlers[f"/{service}/{name}"] = handler

    def add_generic_rpc_handlers(self, generic_handlers) -> None:
        """The generated code registers each service both ways; the registered handlers are the ones used."""

    def add_started(self, method: str, start: StartedMethod, parse: Callable[[bytes], object]) -> None:
        """`start(rpc, request)` for `method`, the request parsed with `parse`."""
        self.started[method] = (start, parse)

    def streaming(self) -> list[str]:
        """Methods whose client sends a stream (the transport keeps reading them)."""
        return [m for m, h in self.handlers.items() if h.request_streaming]

    def streams(self) -> list[str]:
        """Methods where either side sends a stream: a call of one may stay open (grpc.health's Watch)."""
        return [m for m, h in self.handlers.items() if h.request_streaming or h.response_streaming]

    def unary(self, method: str) -> bool:
        handler = self.handlers.get(method)
        return handler is None or not handler.request_streaming

    def answers_once(self, method: str) -> bool:
        """Methods whose server sends one message at most (grpc.health's Watch, EncodeStream do not)."""
        handler = self.handlers.get(method)
        return handler is None or not handler.response_streaming


class Router:
    """Routes every call of every transport (module docstring)."""

    def __init__(self, registry: Registry, auth_token: str = "", workers: int = 32) -> None:
        self._registry = registry
        self._token = security.TokenCheck(auth_token) if auth_token else None
        self._pool = futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="rpc",
                                                initializer=logs.name_thread, initargs=("rpc-worker",))

    def known(self, method: str) -> bool:
        return method in self._registry.handlers or method in self._registry.started

    def start(self, rpc: Rpc, payload: bytes | None) -> None:
        """A new call; `payload`: its request (unary methods), None for client streams."""
        method = rpc.method
        if not self.known(method):
            rpc.fail(grpc.StatusCode.UNIMPLEMENTED, f"method {method} is not served here")
            return
        if self._token is not None and not self._token.allowed(method, rpc.invocation_metadata()):
            rpc.fail(grpc.StatusCode.UNAUTHENTICATED, security.DENIED["grpc"])  # the body is never parsed
            return
        started = self._registry.started.get(method)
        if started is not None:
            start, parse = started
            request = self._parse(rpc, parse, payload)
            if request is not None:
                start(rpc, request)
            return
        handler = self._registry.handlers[method]
        if handler.request_streaming:
            rpc.inbox = queue.SimpleQueue()
            self._pool.submit(self._run, rpc, handler, self._requests(rpc, handler))
            return
        request = self._parse(rpc, handler.request_deserializer, payload)
        if request is not None:
            if getattr(handler.unary_stream, "experimental_non_blocking", False):
                self._watch(rpc, handler, request)  # health Watch: no thread held per watcher
            else:
                self._pool.submit(self._run, rpc, handler, request)

    def message(self, rpc: Rpc, payload: bytes) -> None:
        if rpc.inbox is not None:
            rpc.inbox.put(payload)

    def half_close(self, rpc: Rpc) -> None:
        if rpc.inbox is not None:
            rpc.inbox.put(_END)

    def cancel(self, rpc: Rpc) -> None:
        rpc.cancelled()
        if rpc.inbox is not None:
            rpc.inbox.put(_END)

    def stop(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- helpers -----------------------------------------------------------------------------
    @staticmethod
    def _parse(rpc: Rpc, parse, payload: bytes | None):
        try:
            if payload is None:
                raise ValueError("no request message")
            return parse(payload)
        except Exception:  # DecodeError and friends: the method's name, never a parser trace
            rpc.fail(*to_status(security.malformed(rpc.method)))
            return None

    def _requests(self, rpc: Rpc, handler: grpc.RpcMethodHandler):
        while True:
            item = rpc.inbox.get()
            if item is _END:
                return
            try:
                request = handler.request_deserializer(item)
            except Exception:  # the call ends here, whatever the servicer makes of the stream's end
                rpc.fail(*to_status(security.malformed(rpc.method)))
                return
            yield request

    def _run(self, rpc: Rpc, handler: grpc.RpcMethodHandler, request) -> None:
        """A servicer method on a worker thread: its return value or each yielded message is sent."""
        serialize = handler.response_serializer
        try:
            behaviour = (handler.unary_unary or handler.unary_stream or handler.stream_unary
                         or handler.stream_stream)
            result = behaviour(request, rpc)
            if handler.response_streaming:
                for response in result:
                    if not rpc.is_active():
                        close = getattr(result, "close", None)
                        if close is not None:
                            close()  # the client left: end the servicer's generator (GeneratorExit)
                        return
                    rpc.write(serialize(response))
                rpc.close()
            elif rpc._code not in (None, grpc.StatusCode.OK):
                rpc.fail(rpc._code, rpc._details)
            else:
                rpc.reply(serialize(result))
        except Abort as abort:
            rpc.fail(abort.code, abort.details)
        except Exception as error:  # not through a servicer's edge: INTERNAL with its type (serve/errors.py)
            code, message = to_status(error)
            logs.event(log, "unexpected_error", logging.ERROR, method=rpc.method, error=message)
            rpc.fail(code, message)

    @staticmethod
    def _watch(rpc: Rpc, handler: grpc.RpcMethodHandler, request) -> None:
        serialize = handler.response_serializer

        def send(response) -> None:
            if response is not None:
                rpc.write(serialize(response))

        handler.unary_stream(request, rpc, send_response_callback=send)
