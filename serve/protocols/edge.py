"""The edge of every RPC, shared by Encode (serve/protocols/encoder_v1.py), KServe v2 (serve/protocols/kserve_v2.py) and Admin
(serve/protocols/admin.py): the call's deadline, its metrics, and its status.

    with Call(metrics, "Encode", context) as call:   # call.received: when the handler started
        ... raise any error ...
        return response

On leaving the block the call is counted (`Metrics.finished(method, code, seconds)`); an error is
mapped to its status by serve.protocols.status.to_status (the one place) and the call aborted with it. An
error that is not a ServeError is a bug: logged, and answered INTERNAL with its type, never UNKNOWN.
"""

from __future__ import annotations

import logging
import time

import grpc
import orjson

from serve import logs
from serve.errors import ServeError, ValidationError
from serve.protocols.status import to_status
from serve.core.metrics import Metrics

log = logging.getLogger("serve.protocols.edge")

NO_DEADLINE_S = 10 * 365 * 86400.0  # gRPC reports ~2**63 ns (not None) when the client set no deadline


def deadline_of(context: grpc.ServicerContext) -> float | None:
    """The call's deadline on time.monotonic()'s clock; None when the client set none."""
    if hasattr(context, "deadline"):  # serve/transport/rpc.py Rpc
        return context.deadline
    remaining = context.time_remaining()
    return None if remaining is None or remaining > NO_DEADLINE_S else time.monotonic() + remaining


class Call:
    """One RPC from its handler's start to its status (a context manager; see the module docstring)."""

    def __init__(self, metrics: Metrics | None, method: str, context: grpc.ServicerContext) -> None:
        self.metrics, self.method, self.context = metrics, method, context
        self.received = getattr(context, "received", None) or time.monotonic()

    def __enter__(self) -> "Call":
        return self

    def __exit__(self, kind, error, traceback) -> bool:
        if kind is not None and not issubclass(kind, Exception):  # GeneratorExit: a stream the client left
            return False
        self.finish(error)
        return False

    def finish(self, error: BaseException | None) -> None:
        """Counts the call with its status; with an error, aborts it with that status (raises)."""
        code, message = self._count(error)
        if error is not None:
            self.context.abort(code, message)

    def answer(self, error: BaseException | None, payload: bytes | None = None) -> None:
        """A started call's end (serve/transport/rpc.py): counts it, then replies `payload` or fails it
        with `error`'s status."""
        code, message = self._count(error)
        if error is None:
            self.context.reply(payload)
        else:
            self.context.fail(code, message)

    def _count(self, error: BaseException | None) -> tuple[grpc.StatusCode, str]:
        code, message = (grpc.StatusCode.OK, "") if error is None else to_status(error)
        if self.metrics is not None:
            self.metrics.finished(self.method, code.name, time.monotonic() - self.received)
        if error is not None and not isinstance(error, ServeError):
            logs.event(log, "unexpected_error", logging.ERROR, method=self.method, error=message)
        return code, message


def json_object(body: bytes) -> dict:
    """A request body that must be a JSON object (every HTTP protocol's); ValidationError otherwise."""
    try:
        doc = orjson.loads(body)  # orjson: the same JSON, parsed several times faster than json's
    except (ValueError, UnicodeDecodeError) as error:
        raise ValidationError(f"request body: not valid JSON ({error})") from None
    if not isinstance(doc, dict):
        raise ValidationError("request body: expected a JSON object")
    return doc


def start_call(metrics: Metrics | None, method: str, rpc, submit, render) -> None:
    """A started call (serve/transport/rpc.py): `submit()` admits, checks and queues it, returning
    (engine, ticket), here on the transport's thread; once its batch has run, on the batcher's
    thread, `render(engine, result, call)` makes the answer's bytes. Errors of either step are
    answered with their status; a call that ends unanswered (cancelled) takes its ticket off the queue."""
    call = Call(metrics, method, rpc)
    try:
        engine, ticket = submit()
    except Exception as error:
        call.answer(error)
        return
    rpc.add_callback(ticket.cancel)

    def done(ticket) -> None:
        try:
            result = engine.result(ticket)
            if metrics is not None:
                metrics.sequences.inc(len(result))
            payload = render(engine, result, call)
        except Exception as error:
            call.answer(error)
            return
        call.answer(None, payload)

    ticket.add_done_callback(done)
