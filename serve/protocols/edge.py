"""The edge of every call, on every protocol: what the server lends the adapters (`Api`), how a task call
starts and is answered (`start_task`: admit, check the route fits the model's task, submit the task verb,
render its result on the batcher's thread), a call answered at once (`answer_now`), and the call's deadline,
metrics and status (`Call`):

    with Call(metrics, "Encode", context) as call:   # call.received: when the call arrived (Rpc.received)
        ... raise any error ...
        return response

On leaving the block the call is counted (`Metrics.finished(method, code, seconds)`); an error is
mapped to its status by serve.protocols.status.to_status (the one place) and the call aborted with it. An
error that is not a ServeError is a bug: logged, and answered INTERNAL with its type, never UNKNOWN.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Mapping

import grpc
import orjson

from serve import logs
from serve.core import tasks
from serve.core.admission import Admission
from serve.core.engine import Engine
from serve.core.metrics import Metrics
from serve.core.model_index import Repository
from serve.core.tasks import Pending
from serve.errors import ServeError, ValidationError
from serve.protocols.status import to_status

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


@dataclass(frozen=True)
class Api:
    """What the server lends its protocol adapters (serve/assembly/app.py makes it once)."""

    # admission (serve/core/admission.py): `admit(context, model=name)` the engine a call runs on, counted in
    # flight until the call ends; `engine(model)` the same without counting (metadata); `engines()` every
    # served model by name; `ready()` the one readiness every surface reports (serving, and not leaving)
    admission: Admission
    metrics: Metrics | None = None
    repository: Repository | None = None  # the model repository's calls (serve/core/model_index.py)

    def admit(self, context=None, model: str | None = "", on_drain=None) -> Engine:
        return self.admission.admit(context, on_drain=on_drain, model=model)

    def engine(self, model: str = "") -> Engine:
        return self.admission.engine(model)

    def ready(self) -> bool:
        return self.admission.ready()


def start_task(api: Api, method: str, rpc, model: str, verb: str, routes: Mapping[str, str | None],
               submit: Callable[[Engine], Pending], render: Callable[[Engine, object, Call], bytes],
               route: str | None = None) -> None:
    """A started call of task `verb` (serve/transport/rpc.py): here, on the transport's thread, the call is
    admitted on `model`, refused unless `verb` serves the model's task (naming the routes of `routes`, its
    protocol's table, that do), and `submit(engine)` queues it (a task verb: serve/core/tasks/); once its rows
    have run, on the batcher's thread, `render(engine, result, call)` makes the answer's bytes. Errors of
    either step are answered with their status; a call that ends unanswered (cancelled) leaves the queue."""
    call = Call(api.metrics, method, rpc)
    try:
        engine = api.admit(rpc, model=model)
        tasks.check(engine.task, verb, model=engine.name, route=route or rpc.method, routes=routes)
        pending = submit(engine)
    except Exception as error:
        call.answer(error)
        return
    rpc.add_callback(pending.cancel)

    def done(pending: Pending) -> None:
        try:
            result = pending.result()
            if api.metrics is not None:
                api.metrics.sequences.inc(len(result))
            payload = render(engine, result, call)
        except Exception as error:
            call.answer(error)
            return
        call.answer(None, payload)

    pending.add_done_callback(done)


def answer_now(api: Api, method: str, rpc, work: Callable[[], bytes]) -> None:
    """A call answered at once on the calling thread (tokenize, metadata, listings): `work()` makes the
    answer's bytes, or raises; counted and mapped to its status like every call."""
    call = Call(api.metrics, method, rpc)
    try:
        payload = work()
    except Exception as error:
        call.answer(error)
        return
    call.answer(None, payload)
