"""The wire between the front-end processes and the engine process (`--front-ends N`, docs/serving.md "Front
ends"): what crosses it and how, never pickled.

Sockets: pyzmq over Unix domain sockets in one private folder. The engine binds `engine.sock` (a PULL socket
every front end pushes into); front end i binds `front-end-i.sock` (a PULL socket the engine pushes to). A
socket is used by one thread at a time (a lock around each PUSH: any thread of a process may send).

Messages: a list of frames, an orjson header first, then the raw bytes of the arrays it lists ("a": [[dtype,
shape], ...], in order): a request's rows leave as the bytes of its padded block and lengths (its custom mask,
token types and path indices where it has them), a result as the bytes of its hidden states, embeddings and
head scores. numpy views the received frames in place (np.frombuffer).

  front end -> engine   {"k": "work", "fe", "id", "model", "deadline", "out": [hidden, pooling, normalize, scores,
                         chunked], "rows": {...}}            rows already checked by the front end (to_rows)
                        {"k": "cancel", "id"}                the caller left: a queued request is dropped
                        {"k": "call", "id", "op", "args"}    a repository or lifecycle call (load, unload, ...)
                        {"k": "hello" | "listening", ...}    a front end started / listens
  engine -> front end   {"k": "done", "id", ...result}       or {"k": "done", "id", "error": [class, message]}
                        {"k": "reply", "id", "value" | "error"}
                        {"k": "models", ...}, {"k": "state", ...}  the served models and the server's state
"""

from __future__ import annotations

import logging
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

def _pack(arrays: list[np.ndarray]) -> tuple[list, list]:
    """(their [dtype, shape] list, their bytes): C-contiguous buffers, sent without a copy where they are."""
    specs, frames = [], []
    for array in arrays:
        array = np.ascontiguousarray(array)
        specs.append([array.dtype.str, list(array.shape)])
        frames.append(array)
    return specs, frames


def _unpack(specs: list, frames: list) -> list[np.ndarray]:
    return [np.frombuffer(frame, np.dtype(dtype)).reshape(shape) for (dtype, shape), frame in zip(specs, frames)]


# -- work: front end -> engine -------------------------------------------------------------------------

def work_frames(front_end: int, call_id: int, model: str, work: Work, rows: Rows, deadline: float | None) -> list:
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
    specs, frames = _pack(arrays)
    header = {"k": "work", "fe": front_end, "id": call_id, "model": model, "deadline": deadline,
              "out": [work.hidden_states, work.pooling, work.normalize, work.scores, bool(work.chunks)],
              "rows": {"mask": [rows.kind, rows.causal, rows.window, rows.step], "optional": optional, "paths": paths,
                       "attention_bytes": rows.attention_bytes, "row_elements": rows.row_elements,
                       "longest": rows.longest, "tokens": rows.tokens},
              "a": specs}
    return [orjson.dumps(header), *frames]


def read_work(header: dict, frames: list) -> tuple[Work, Rows]:
    """The engine's Work and Rows of a front end's request (checked there: to_rows)."""
    arrays = _unpack(header["a"], frames)
    r = header["rows"]
    kind, causal, window, step = r["mask"]
    optional = {name: arrays[at] for name, at in r["optional"].items()}
    rows = Rows(arrays[0], arrays[1], kind, causal, window, step, optional.get("custom"),
                tuple((path, arrays[at]) for path, at in r["paths"]), attention_bytes=r["attention_bytes"],
                types=optional.get("types"), row_elements=r["row_elements"], longest=r["longest"],
                tokens=r["tokens"])
    hidden, pooling, normalize, scores, chunked = header["out"]
    # chunked: the front end pools the windows of each text and normalises after; the engine leaves them be
    work = Work(rows.block, MaskChoice(), hidden, pooling, normalize, scores, chunks=(1,) if chunked else ())
    return work, rows


# -- results: engine -> front end ----------------------------------------------------------------------

OUTPUTS = ("hidden_states", "embeddings", "scores")


def result_frames(call_id: int, result: EncodeResult) -> list:
    arrays, present = [], []
    for name in OUTPUTS:
        value = getattr(result, name)
        if value is not None:
            present.append(name)
            arrays.append(value)
    specs, frames = _pack(arrays)
    header = {"k": "done", "id": call_id, "outputs": present, "a": specs, "queue_s": result.queue_s,
              "inference_s": result.inference_s, "batch_size": result.batch_size, "batch_length": result.batch_length,
              "provider": result.execution_provider, "paths": list(result.attention_paths)}
    return [orjson.dumps(header), *frames]


def error_header(call_id: int, error: BaseException, kind: str = "done") -> dict:
    """An error as the wire carries it: its ServeError class and message (anything else: BackendError)."""
    name = type(error).__name__ if isinstance(error, ServeError) else "BackendError"
    message = error.message if isinstance(error, ServeError) else f"{type(error).__name__}: {error}"
    return {"k": kind, "id": call_id, "error": [name, message]}


def error_frames(call_id: int, error: BaseException) -> list:
    return [orjson.dumps(error_header(call_id, error))]


def read_result(header: dict, frames: list, work: Work, rows: Rows) -> EncodeResult | ServeError:
    """A front end's EncodeResult of the engine's answer (its request's own facts from `work` and `rows`)."""
    if "error" in header:
        return by_name(*header["error"])
    outputs = dict(zip(header["outputs"], _unpack(header["a"], frames)))
    return EncodeResult(
        request_id=work.request_id, hidden_states=outputs.get("hidden_states"), embeddings=outputs.get("embeddings"),
        queue_s=header["queue_s"], inference_s=header["inference_s"], batch_size=header["batch_size"],
        batch_length=header["batch_length"], execution_provider=header["provider"],
        token_counts=tuple(rows.lengths.tolist()), truncated=work.truncated,
        attention_paths=tuple(header["paths"]), scores=outputs.get("scores"))


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
            self._socket.send_multipart(frames, copy=len(frames) == 1)

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


def receive(socket, timeout_s: float) -> tuple[dict, list] | None:
    """The next message as (header, array frames), or None after `timeout_s` with none."""
    if not socket.poll(int(timeout_s * 1000)):
        return None
    frames = socket.recv_multipart(copy=False)
    return orjson.loads(frames[0].bytes), [frame.buffer for frame in frames[1:]]


def receive_loop(socket, stopping, handle, log, thread: str) -> None:
    """Hands each message of `socket` to `handle(header, frames)` until `stopping()`; a message that fails is
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
