"""A front-end process's view of the models the engine process serves (`--front-ends N`, docs/serving.md
"Front ends"): each is an ordinary Engine (the export's metadata and tokenizer, the limits, the attention
budget: everything a call is checked against, read here) whose batcher is a `RemoteBatcher`: the checked rows
go over the wire (serve/core/ipc.py) to the engine, which batches and runs them with every other front end's,
and the answer comes back on the link's receiver thread, where its ticket finishes as a batcher's would.

  EngineLink     a front end's end of the wire: work out (by its sender thread, in bursts: every request checked
                 since its last send in one message; a lone call granted an express run, by the caller's thread:
                 serve/core/express.py), answers in, control calls and their replies, and the
                 engine's news (the served models, the server's state) to the handlers registered for it
  RemoteBatcher  the batcher of a model in a front end: its tickets in flight to the engine
  remote_engine  an Engine for a model the engine describes (`spec`, the engine's `model_spec`)
  model_spec     what a front end needs of an engine's model to build its own
"""

from __future__ import annotations

import itertools
import logging
import random
import threading
from typing import Callable

from serve import logs
from serve.backend.export_dir import load_export
from serve.backend.feeds import Rows
from serve.backend.session import BackendInfo
from serve.config import ServerConfig
from serve.core import express, ipc
from serve.core.attention_budget import AttentionBudget
from serve.core.batcher import Ticket
from serve.core.bursts import BurstQueue
from serve.core.engine import Engine
from serve.core.requests import Work
from serve.errors import ServeError, Unavailable, by_name

log = logging.getLogger("serve.core.remote")

CALL_TIMEOUT_S = 600.0  # a control call (a load takes as long as the model's export is big)


class RemoteTicket(Ticket):
    """A ticket whose rows run in the engine process; cancelling it tells the engine."""

    __slots__ = ("link", "call_id")

    def cancel(self) -> None:
        if not self.cancelled and not self.done():
            self.link.cancel(self.call_id)
        super().cancel()


class EngineLink:
    def __init__(self, folder: str, index: int) -> None:
        import zmq

        self.index = index
        self._context = zmq.Context()
        self._out = ipc.Sender(self._context, ipc.address(folder, ipc.ENGINE_SOCKET))
        self._in = ipc.receiver(self._context, ipc.address(folder, ipc.front_end_socket(index)))
        self._ids = itertools.count(random.getrandbits(48))  # an earlier incarnation's answers match none
        self._pending: dict[int, Ticket] = {}
        self._replies: dict[int, list] = {}  # control call id -> [event, value or error]
        self._handlers: dict[str, Callable[[dict], None]] = {}
        self._stopping = False
        self._thread = threading.Thread(target=self._receive, name="engine-link", daemon=True)
        # work and cancels not sent yet, (ticket, model) or (None, call id), sent in bursts
        self._sender = BurstQueue("engine-send", self._send_outgoing)

    def start(self) -> None:
        self._thread.start()
        self._sender.start()

    def on(self, kind: str, handler: Callable[[dict], None]) -> None:
        """`handler(header)` for each message of `kind` the engine sends unasked (models, state)."""
        self._handlers[kind] = handler

    # -- out -----------------------------------------------------------------------------------------
    def send_work(self, ticket: RemoteTicket, model: str) -> None:
        """Queues the ticket's rows for the sender thread (its answer finishes the ticket), or sends them on this
        thread when the transport granted the call an express run (serve/core/express.py: it is the only call in
        flight there, so no burst would form; the engine may grant it one in turn)."""
        ticket.link, ticket.call_id = self, next(self._ids)
        self._pending[ticket.call_id] = ticket
        if express.take():
            self._send_outgoing([(ticket, model)])
        else:
            self._sender.put((ticket, model))

    def cancel(self, call_id: int) -> None:
        self._sender.put((None, call_id))  # behind its work, if that is not sent yet

    def _send_outgoing(self, outgoing: list) -> None:
        """The sender's pass (serve/core/bursts.py): every request queued since the last in one message, then
        the cancels; a pump's burst of calls leaves together."""
        works = [(ticket, model) for ticket, model in outgoing if ticket is not None and not ticket.done()]
        cancels = [call_id for ticket, call_id in outgoing if ticket is None]
        try:
            if works:
                self._out.send(ipc.work_frames(self.index, [
                    (ticket.call_id, model, ticket.request, ticket.rows, ticket.deadline) for ticket, model in works]))
            if cancels:
                self._out.send_json({"k": "cancel", "fe": self.index, "ids": cancels})
        except Exception as error:  # never leave a caller waiting: each of these gets the error
            logs.event(log, "work_unsendable", logging.ERROR, error=repr(error), calls=len(works))
            for ticket, _ in works:
                if self._pending.pop(ticket.call_id, None) is not None:
                    ticket._finish(error=ServeError(f"the request could not be sent to the engine process: "
                                                    f"{type(error).__name__}: {error}"))

    def tell(self, kind: str, **fields) -> None:
        """A message the engine needs no reply to (hello, listening)."""
        self._out.send_json({"k": kind, "fe": self.index, **fields})

    def call(self, op: str, timeout_s: float = CALL_TIMEOUT_S, **args):
        """A control call run by the engine (load, unload, index, reload, reload_all): its value, or its
        ServeError raised here."""
        call_id = next(self._ids)
        reply = self._replies[call_id] = [threading.Event(), None]
        self._out.send_json({"k": "call", "fe": self.index, "id": call_id, "op": op, "args": args})
        try:
            if not reply[0].wait(timeout_s):
                raise Unavailable(f"the engine process did not answer {op} within {timeout_s:g} s")
        finally:
            self._replies.pop(call_id, None)
        if isinstance(reply[1], ServeError):
            raise reply[1]
        return reply[1]

    def in_flight(self) -> int:
        return len(self._pending)

    def fail_all(self, error: ServeError) -> int:
        """Finishes every ticket still waiting for the engine with `error` (the engine is gone)."""
        pending, self._pending = self._pending, {}
        for reply in list(self._replies.values()):
            reply[1] = error
            reply[0].set()
        return sum(ticket._finish(error=error) for ticket in pending.values())

    def stop(self) -> None:
        self._stopping = True
        self._sender.stop()
        self._thread.join(timeout=5)
        self._out.close()
        self._in.close(linger=0)
        self._context.term()

    # -- in ------------------------------------------------------------------------------------------
    def _receive(self) -> None:
        ipc.receive_loop(self._in, lambda: self._stopping, self._handle, log, "engine-link")

    def _handle(self, header: dict, body) -> None:
        kind = header.get("k")
        if kind == "done":  # a burst: every answer the engine finished for this front end since its last
            items = header["items"]
            # one answer and no other call in flight: the transport may send it on this thread (express.py)
            with express.answering_alone(len(items) == 1 and len(self._pending) == 1):
                self._finish_burst(items, body)
        elif kind == "reply":
            reply = self._replies.get(header["id"])
            if reply is not None:
                reply[1] = by_name(*header["error"]) if "error" in header else header.get("value")
                reply[0].set()
        elif kind in self._handlers:
            self._handlers[kind](header)

    def _finish_burst(self, items: list, body) -> None:
        """Finishes the ticket of each answer in a burst from the engine."""
        for item in items:
            ticket = self._pending.pop(item["id"], None)
            if ticket is None:  # an answer to an earlier incarnation, or cancelled and dropped
                continue
            try:
                outcome = ipc.read_result(item, body, ticket.request, ticket.rows)
            except Exception as error:  # one unreadable answer fails its own call, not the burst's others
                outcome = ServeError(f"the engine's answer could not be read: {type(error).__name__}: {error}")
            if isinstance(outcome, ServeError):
                ticket._finish(error=outcome)
            else:
                ticket._finish(outcome)


class RemoteBatcher:
    """A model's batcher in a front end: each submitted request's rows go to the engine process (module
    docstring). `close` refuses new ones (a drain); `abandon` finishes the ones in flight."""

    def __init__(self, link: EngineLink, model: str, budget: AttentionBudget) -> None:
        self.link, self.model, self.budget = link, model, budget
        self._closed = False
        self._mine: set[RemoteTicket] = set()

    def submit(self, request: Work, rows: Rows, deadline: float | None = None) -> Ticket:
        if self._closed:
            raise Unavailable("server is shutting down; retry on another replica")
        ticket = RemoteTicket(request, rows, deadline)
        self._mine.add(ticket)
        ticket.add_done_callback(self._mine.discard)
        self.link.send_work(ticket, self.model)
        return ticket

    def queue_depth(self) -> int:
        return len(self._mine)

    def start(self) -> None:
        pass

    def close(self) -> None:
        self._closed = True

    def drain(self, timeout: float | None = None) -> bool:
        return True

    def abandon(self, error: ServeError) -> int:
        return sum(ticket._finish(error=error) for ticket in list(self._mine))

    def stop(self, timeout: float | None = None) -> None:
        self.close()


class _EngineBackend:
    """What a front end knows of a model's backend: its providers and graphs (BackendInfo), as the engine reported
    them; it runs nothing here."""

    def __init__(self, info: BackendInfo) -> None:
        self.info = info

    def health(self) -> None:
        pass


def model_spec(engine: Engine) -> dict:
    """What a front end needs of an engine's model to build its own view of it (`remote_engine`)."""
    export, info, budget = engine.export, engine.backend.info, engine.budget
    return {"name": engine.name, "path": str(export.path), "graph": export.graph, "sha256": export.sha256,
            "memory_bytes": engine.memory_bytes, "providers": list(info.providers),
            "available": list(info.available_providers), "paths": list(info.paths), "max_bytes": budget.max_bytes,
            "max_elements": budget.max_elements}


def remote_engine(spec: dict, link: EngineLink, server: ServerConfig) -> Engine:
    """An Engine for the engine's model `spec` whose rows run in the engine (its export read here, unverified:
    the engine checked its hashes; its tokenizer's checked again as it is read)."""
    export = load_export(spec["path"], spec["graph"], verify=False, long_paths=server.long_paths)
    info = BackendInfo(tuple(spec["providers"]), tuple(spec["available"]), tuple(spec["paths"]))
    budget = AttentionBudget(export.config, tuple(spec["paths"]), spec["max_bytes"], spec["max_elements"])
    return Engine(export, _EngineBackend(info), RemoteBatcher(link, spec["name"], budget), server,
                  name=spec["name"], memory_bytes=spec["memory_bytes"])
