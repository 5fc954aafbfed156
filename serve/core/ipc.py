"""The wire between the front-end processes and the engine process (`--front-ends N`, docs/serving.md "Front
ends"): what crosses it and how, never pickled.

Sockets: pyzmq over Unix domain sockets in one private folder. The engine binds `engine.sock` (a PULL socket
every front end pushes into); front end i binds `front-end-i.sock` (a PULL socket the engine pushes to). A
socket is used by one thread at a time (a lock around each PUSH: any thread of a process may send).

Messages: at most two frames, an orjson header and one body holding the raw bytes of every array the header
lists ("a": [[dtype, shape, offset], ...], each array 8-byte aligned in the body): a request's rows leave as the
bytes of its padded block and lengths (its custom mask, token types and path indices where it has them), a result
as the bytes of its hidden states, embeddings and head scores. numpy views the received body in place
(np.frombuffer). One body, not a frame per array: each frame is a send and a receive of its own in pyzmq, and
for the small arrays of an embedding those calls, not the bytes, were the cost (docs/serving.md "Front ends").
Both ends send in bursts. A front end's sender thread sends every request its transports checked since its
last send as ONE message (serve/core/remote.py), and the engine's outbox thread sends the results its runs
finished since its last send to each front end as ONE message (serve/assembly/front_ends.py): under load, a
message per burst each way instead of one per request, each a receive, a header to decode and a GIL hand-off in
the engine, whose one interpreter is the server's limit on a GPU host (docs/performance.md).

  front end -> engine   {"k": "work", "fe", "items": [{"id", "model", "deadline", "out": [hidden, pooling,
                         normalize, scores, chunked], "rows": {...}}, ...]}   every request the front end's sender
                                                             took at once; rows already checked there (to_rows)
                        {"k": "cancel", "fe", "ids"}         callers that left: their queued requests are dropped
                        {"k": "call", "id", "op", "args"}    a repository or lifecycle call (load, unload, ...)
                        {"k": "hello" | "listening", ...}    a front end started / listens
  engine -> front end   {"k": "done", "items": [{"id", ...result} or {"id", "error": [class, message]}, ...]}
                        {"k": "reply", "id", "value" | "error"}
                        {"k": "models", ...}, {"k": "state", ...}  the served models and the server's state
"""

from __future__ import annotations

import logging
import math
import threading
from pathlib import Path

import numpy as np
import orjson

from serve.backend.feeds import Rows
from serve.core.requests import EncodeResult, MaskChoice, Work
from serve.errors import ServeError, by_name

ENGINE_SOCKET = "engine.sock"
HIGH_WATER = 100_000  # messages a socket holds for a peer that is slow or restarting
POLL_S = 0.25  # how often a receiving thread looks up from its socket (to notice a stop)


def front_end_socket(index: int) -> str:
    return f"front-end-{index}.sock"


def address(folder: str | Path, name: str) -> str:
    return f"ipc://{Path(folder) / name}"


# -- arrays ------------------------------------------------------------------------------------------

ALIGN = 8  # every array starts at a multiple of this in the body (numpy reads unaligned arrays slowly)


def _pack(arrays: list[np.ndarray], pieces: list | None = None, at: int = 0) -> tuple[list, list, int]:
    """(their [dtype, shape, offset] list, the buffers to join into the body after `pieces`, the body's size):
    `at` is where the body already ends (several results share one body)."""
    specs, pieces = [], [] if pieces is None else pieces
    for array in arrays:
        array = np.ascontiguousarray(array)
        if array.dtype.hasobject:  # its buffer holds this process's pointers
            raise TypeError(f"an array of {array.dtype} cannot cross the wire")
        if at % ALIGN:
            pad = ALIGN - at % ALIGN
            pieces.append(bytes(pad))
            at += pad
        specs.append([array.dtype.str, list(array.shape), at])
        if array.nbytes:
            pieces.append(memoryview(array).cast("B"))
            at += array.nbytes
    return specs, pieces, at


def _frames(header: dict, pieces: list) -> list:
    return [orjson.dumps(header), b"".join(pieces)] if pieces else [orjson.dumps(header)]


def _unpack(specs: list, body) -> list[np.ndarray]:
    return [np.frombuffer(body, dtype, math.prod(shape), offset).reshape(shape)
            for dtype, shape, offset in specs]


# -- work: front end -> engine -------------------------------------------------------------------------

def work_frames(front_end: int, works: list[tuple[int, str, Work, Rows, float | None]]) -> list:
    """One message carrying a front end's requests, (call id, model, Work, Rows, deadline) each, their arrays in one
    body (`read_work` reads an item back)."""
    items, pieces, at = [], [], 0
    for call_id, model, work, rows, deadline in works:
        item, at = _work_item(call_id, model, work, rows, deadline, pieces, at)
        items.append(item)
    return _frames({"k": "work", "fe": front_end, "items": items}, pieces)


def _work_item(call_id: int, model: str, work: Work, rows: Rows, deadline: float | None, pieces: list,
               at: int) -> tuple[dict, int]:
    arrays = [rows.block, rows.lengths]
    optional = {}
    for name in ("custom", "types"):
        value = getattr(rows, name)
        if value is not None:
            optional[name] = len(arrays)
            arrays.append(value)
    paths = []
    for path, index in rows.paths:
        paths.append([path, len(arrays)])
        arrays.append(index)
    specs, _, at = _pack(arrays, pieces, at)
    return {"id": call_id, "model": model, "deadline": deadline,
            "out": [work.hidden_states, work.pooling, work.normalize, work.scores, bool(work.chunks)],
            "rows": {"mask": [rows.kind, rows.causal, rows.window, rows.step], "optional": optional, "paths": paths,
                     "attention_bytes": rows.attention_bytes, "row_elements": rows.row_elements,
                     "longest": rows.longest, "tokens": rows.tokens},
            "a": specs}, at


def read_work(item: dict, body) -> tuple[Work, Rows]:
    """The engine's Work and Rows of one item of a front end's work message (checked there: to_rows)."""
    arrays = _unpack(item["a"], body)
    r = item["rows"]
    kind, causal, window, step = r["mask"]
    optional = {name: arrays[at] for name, at in r["optional"].items()}
    rows = Rows(arrays[0], arrays[1], kind, causal, window, step, optional.get("custom"),
                tuple((path, arrays[at]) for path, at in r["paths"]), attention_bytes=r["attention_bytes"],
                types=optional.get("types"), row_elements=r["row_elements"], longest=r["longest"],
                tokens=r["tokens"])
    hidden, pooling, normalize, scores, chunked = item["out"]
    # chunked: the front end pools the windows of each text and normalises after; the engine leaves them be
    work = Work(rows.block, MaskChoice(), hidden, pooling, normalize, scores, chunks=(1,) if chunked else ())
    return work, rows


# -- results: engine -> front end ----------------------------------------------------------------------

OUTPUTS = ("hidden_states", "embeddings", "scores")


def result_item(call_id: int, result: EncodeResult, pieces: list, at: int) -> tuple[dict, int]:
    """One result of a burst (`results_frames`): its item, its arrays appended to `pieces` from body offset `at`;
    returns the item and where the body ends now."""
    arrays, present = [], []
    for name in OUTPUTS:
        value = getattr(result, name)
        if value is not None:
            present.append(name)
            arrays.append(value)
    mine: list = []  # joined to the burst's only once the whole result packed: a failure moves no offset
    specs, _, end = _pack(arrays, mine, at)
    pieces.extend(mine)
    return {"id": call_id, "outputs": present, "a": specs, "queue_s": result.queue_s,
            "inference_s": result.inference_s, "batch_size": result.batch_size, "batch_length": result.batch_length,
            "provider": result.execution_provider, "paths": list(result.attention_paths)}, end


def error_header(call_id: int, error: BaseException, kind: str | None = None) -> dict:
    """An error as the wire carries it: its ServeError class and message (anything else: BackendError); as a
    message of its own with `kind` ("reply"), else as an item of a burst of answers."""
    name = type(error).__name__ if isinstance(error, ServeError) else "BackendError"
    message = error.message if isinstance(error, ServeError) else f"{type(error).__name__}: {error}"
    return {"id": call_id, "error": [name, message], **({"k": kind} if kind else {})}


def results_frames(outcomes: list[tuple[int, EncodeResult | BaseException]]) -> list:
    """One message answering several calls of one front end: (call id, its result or error) each."""
    items, pieces, at = [], [], 0
    for call_id, outcome in outcomes:
        if isinstance(outcome, BaseException):
            items.append(error_header(call_id, outcome))
            continue
        try:
            item, at = result_item(call_id, outcome, pieces, at)
        except Exception as error:  # a result the wire cannot carry fails its own call only
            item = error_header(call_id, error)
        items.append(item)
    return _frames({"k": "done", "items": items}, pieces)


def error_frames(call_id: int, error: BaseException) -> list:
    return results_frames([(call_id, error)])


def read_result(item: dict, body, work: Work, rows: Rows) -> EncodeResult | ServeError:
    """A front end's EncodeResult of one item of the engine's answer (its request's own facts from `work` and
    `rows`)."""
    if "error" in item:
        return by_name(*item["error"])
    outputs = dict(zip(item["outputs"], _unpack(item["a"], body)))
    return EncodeResult(
        request_id=work.request_id, hidden_states=outputs.get("hidden_states"), embeddings=outputs.get("embeddings"),
        queue_s=item["queue_s"], inference_s=item["inference_s"], batch_size=item["batch_size"],
        batch_length=item["batch_length"], execution_provider=item["provider"],
        token_counts=tuple(rows.lengths.tolist()), truncated=work.truncated,
        attention_paths=tuple(item["paths"]), scores=outputs.get("scores"))


# -- sockets -------------------------------------------------------------------------------------------

class Sender:
    """A PUSH socket any thread may send on (one at a time)."""

    def __init__(self, context, target: str) -> None:
        import zmq

        self._socket = context.socket(zmq.PUSH)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.SNDHWM, HIGH_WATER)
        self._socket.connect(target)
        self._lock = threading.Lock()

    def send(self, frames: list) -> None:
        with self._lock:
            self._socket.send_multipart(frames, copy=False)  # a body under copy_threshold is copied anyway

    def send_json(self, header: dict) -> None:
        self.send([orjson.dumps(header)])

    def close(self) -> None:
        with self._lock:
            self._socket.close(linger=0)


def receiver(context, bind: str):
    """A PULL socket bound at `bind` (a stale socket file of an earlier process is replaced)."""
    import zmq

    path = Path(bind.removeprefix("ipc://"))
    path.unlink(missing_ok=True)
    socket = context.socket(zmq.PULL)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.RCVHWM, HIGH_WATER)
    socket.bind(bind)
    return socket


def receive(socket, timeout_s: float) -> tuple[dict, object] | None:
    """The next message as (header, its body or None), or None after `timeout_s` with none."""
    import zmq

    try:  # under load a message is waiting: no poll before it
        frames = socket.recv_multipart(zmq.NOBLOCK, copy=False)
    except zmq.Again:
        if not socket.poll(int(timeout_s * 1000)):
            return None
        frames = socket.recv_multipart(copy=False)
    return orjson.loads(frames[0].bytes), frames[1].buffer if len(frames) > 1 else None


def receive_loop(socket, stopping, handle, log, thread: str) -> None:
    """Hands each message of `socket` to `handle(header, body)` until `stopping()`; a message that fails is
    logged and the loop goes on (one process's wire must survive anything one message does)."""
    from serve import logs

    logs.name_thread(thread)
    while not stopping():
        try:
            message = receive(socket, POLL_S)
        except Exception as error:  # the socket was closed under us: stopping
            if not stopping():
                logs.event(log, "wire_failed", logging.ERROR, thread=thread, error=repr(error))
            return
        if message is None:
            continue
        try:
            handle(*message)
        except Exception as error:
            logs.event(log, "wire_message_failed", logging.ERROR, thread=thread, kind=message[0].get("k"),
                       error=repr(error))
