"""The server on every core (`--front-ends N`, N >= 1; docs/serving.md "Front ends"): one engine process holds
the models (their ONNX Runtime sessions, batchers, the scheduler, the memory budget and the repository) and
serves /metrics; N front-end processes each run the whole request path (the gRPC and HTTP transports on the
server's ports, shared with SO_REUSEPORT, the protocols, tokenization, every request check, rendering the
answers) and send the checked rows to the engine over the wire (serve/core/ipc.py), as arrays.

  EngineProcess  the server's main process with front ends: loads the models, starts the front ends
                 (`FrontEnds`) once they can be told what to serve, writes the port file once every one
                 listens, drains them on SIGTERM, reloads on SIGHUP; it takes no request itself
  EngineService  the engine's end of the wire: each front end's work into the model's batcher (admitted as a
                 call: a drain or an unload waits for it), each answer back to the front end that asked (by
                 its outbox thread, in bursts: one message per front end for all the answers finished since
                 its last send, written off the batcher's thread; a lone request at an idle model is run and
                 answered by the receiving thread itself, serve/core/express.py), their repository calls run on a few
                 threads, the served models and state told to every front end
  FrontEnds      the front-end processes: started with this server's settings, the ports reserved for them,
                 and a pipe whose end tells them the engine is gone; one that dies is started again (its own
                 calls in flight fail UNAVAILABLE at its clients: their connection broke)

An engine that dies takes the server down: the front ends see their pipe close, answer every call they hold
UNAVAILABLE, and exit 1, the last of them removing the engine's folder (serve/assembly/front_end.py
EngineFolder), and so does the server's process (the orchestrator restarts it). Metrics: each front end counts
its requests in prometheus_client's multiprocess files, which the engine's /metrics adds up beside its own
(serve/core/metrics.py).
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent import futures

import orjson

from serve import logs
from serve.assembly.app import drain_delay, reload_on_sighup, run_until_signalled, write_port_file
from serve.assembly.loading import default_backend
from serve.assembly.repository import ModelRepository
from serve.config import ServerConfig, config_environment
from serve.core import express, ipc
from serve.core.admission import Admission, Held
from serve.core.bursts import BurstQueue
from serve.core.metrics import ENGINE, Metrics
from serve.core.remote import model_spec
from serve.errors import ServeError, Unavailable

log = logging.getLogger("serve.assembly.front_ends")

CALL_THREADS = 4  # repository calls at once (a second load is refused at once anyway)
RESTART_S = (0.2, 10.0)  # a dead front end's restart delay: first, and at most (doubling)
LISTEN_TIMEOUT_S = 300.0  # a front end's start: imports, its tokenizers, its transports
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
# Linux (>= 5.14): 1 hands the connections waiting at a closing listener (its accept queue, its handshakes) to
# another listener of the same SO_REUSEPORT port; 0, the kernel's default, resets them. A front end killed while
# clients connect (the OOM killer) holds its listener open until its teardown ends, some ms: with 0 the
# connections that reach it meanwhile fail too (measured: docs/serving.md "Front ends", Failures)
MIGRATE_SYSCTL = "net.ipv4.tcp_migrate_req"
MIGRATE_SYSCTL_PATH = "/proc/sys/" + MIGRATE_SYSCTL.replace(".", "/")


class EngineService:
    def __init__(self, folder: str, count: int, admission: Admission, calls: dict, events: dict) -> None:
        import zmq

        self._zmq = zmq
        self._admission = admission
        self._calls, self._events = calls, events
        self._context = zmq.Context()
        self._inbox = ipc.receiver(self._context, ipc.address(folder, ipc.ENGINE_SOCKET))
        self._to = [ipc.Sender(self._context, ipc.address(folder, ipc.front_end_socket(i))) for i in range(count)]
        self._tickets: dict[tuple[int, int], object] = {}
        self._pool = futures.ThreadPoolExecutor(CALL_THREADS, thread_name_prefix="engine-call",
                                                initializer=logs.name_thread, initargs=("engine-call",))
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="engine-service", daemon=True)
        # (front end, call id, ticket) of each answer not yet sent, sent in bursts
        self._outbox = BurstQueue("engine-outbox", self._send_finished)

    def start(self) -> None:
        self._thread.start()
        self._outbox.start()

    def send(self, front_end: int, header: dict) -> None:
        self._send(front_end, [orjson.dumps(header)])

    def broadcast(self, header: dict) -> None:
        for front_end in range(len(self._to)):
            self.send(front_end, header)

    def _send(self, front_end: int, frames: list) -> None:
        try:
            self._to[front_end].send(frames)
        except Exception as error:  # a front end gone for good (its queue full): its callers are gone too
            logs.event(log, "send_failed", logging.WARNING, front_end=front_end, error=repr(error))

    def stop(self) -> None:
        self._stopping = True
        self._thread.join(timeout=5)
        self._outbox.stop()  # what is left is sent first
        self._pool.shutdown(wait=False, cancel_futures=True)
        for sender in self._to:
            sender.close()
        self._inbox.close(linger=0)
        self._context.term()

    def _loop(self) -> None:
        ipc.receive_loop(self._inbox, lambda: self._stopping, self._handle, log, "engine-service")

    def _handle(self, header: dict, body) -> None:
        kind = header.get("k")
        if kind == "work":
            items = header["items"]
            # one request and none other in flight from any front end: it may run on this thread (express.py)
            alone = len(items) == 1 and not self._tickets
            for item in items:
                with express.granted(alone):
                    self._work(header["fe"], item, body)
        elif kind == "cancel":
            for call_id in header["ids"]:
                ticket = self._tickets.get((header["fe"], call_id))
                if ticket is not None:
                    ticket.cancel()
        elif kind == "call":
            self._pool.submit(self._call, header)
        elif kind in self._events:
            self._events[kind](header)

    def _work(self, front_end: int, item: dict, body) -> None:
        call_id, key, held = item["id"], (front_end, item["id"]), Held()
        try:
            engine = self._admission.admit(held, model=item["model"])
            work, rows = ipc.read_work(item, body)
            ticket = engine.batcher.submit(work, rows, item["deadline"])
        except Exception as error:
            held.end()
            self._send(front_end, ipc.error_frames(call_id, error))
            return
        if ticket.done():  # finished already (an express run): sent from here, no outbox to wake
            held.end()
            self._send_finished([(front_end, call_id, ticket)])
            return
        self._tickets[key] = ticket

        def done(ticket) -> None:  # on the thread that finished it (a batcher's): only hand it to the outbox
            self._tickets.pop(key, None)
            held.end()
            self._outbox.put((front_end, call_id, ticket))

        ticket.add_done_callback(done)

    def _send_finished(self, finished: list) -> None:
        """The outbox's pass (serve/core/bursts.py): every answer finished since the last, one message per front
        end; under load a run's answers leave together."""
        by_front_end: dict[int, list] = {}
        for front_end, call_id, ticket in finished:
            try:
                outcome = ticket.outcome()
            except BaseException as error:  # its error is its answer
                outcome = error
            by_front_end.setdefault(front_end, []).append((call_id, outcome))
        for front_end, outcomes in by_front_end.items():
            try:
                frames = ipc.results_frames(outcomes)
            except Exception as error:  # never leave a caller waiting: each gets the error
                logs.event(log, "answers_unsendable", logging.ERROR, error=repr(error), calls=len(outcomes))
                frames = ipc.results_frames([(call_id, error) for call_id, _ in outcomes])
            self._send(front_end, frames)

    def _call(self, header: dict) -> None:
        reply = {"k": "reply", "id": header["id"]}
        try:
            reply["value"] = self._calls[header["op"]](**header.get("args", {}))
        except Exception as error:
            reply = ipc.error_header(header["id"], error, "reply")
        self.send(header["fe"], reply)


def reserve_port(host: str, port: int) -> tuple[socket.socket | None, int]:
    """A port for the front ends to share (SO_REUSEPORT): `port` itself, or with 0 one the OS chooses, held
    by a socket that never listens (so the kernel hands it no connection) until the server stops."""
    if port < 0:
        return None, port
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    held = socket.socket(family, socket.SOCK_STREAM)
    held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        held.bind((host, port))
    except OSError as error:
        held.close()
        raise RuntimeError(f"cannot listen on {host}:{port} ({error.strerror or error})") from None
    return held, held.getsockname()[1]


def queued_connections_migrate() -> bool | None:
    """Whether the kernel hands the connections waiting at a closing listener to the port's other listeners
    (MIGRATE_SYSCTL); None where it cannot tell (not Linux, a kernel before 5.14)."""
    try:
        with open(MIGRATE_SYSCTL_PATH) as value:
            return value.read().strip() != "0"
    except OSError:
        return None


class FrontEnds:
    def __init__(self, config: ServerConfig, folder: str, multiproc_dir: str) -> None:
        self.config = config
        self.count = config.front_ends
        self.folder, self.multiproc_dir = folder, multiproc_dir
        held, self.port = reserve_port(config.host, config.port)
        held_http, self.http_port = reserve_port(config.host, config.http_port)  # -1 (no HTTP): none held
        self._held = [held, held_http]
        self._processes: list[subprocess.Popen | None] = [None] * self.count
        self._listening: dict[int, dict] = {}
        self._all_listening = threading.Event()
        self._stopping = False
        self._lock = threading.Lock()
        self.restarts = 0

    def environment(self, index: int) -> dict[str, str]:
        """A front end's environment: this server's settings, its own role, the ports reserved for it."""
        fields = config_environment(self.config, role="front-end", front_end_index=index, ipc_dir=self.folder,
                                    port=self.port, http_port=self.http_port, metrics_port=-1, port_file="",
                                    front_ends=0)
        return {**os.environ, **fields, MULTIPROC_ENV: self.multiproc_dir}

    def start(self) -> None:
        if queued_connections_migrate() is False:
            logs.event(log, "front_end_queue_not_migrated", logging.WARNING, sysctl=f"{MIGRATE_SYSCTL}=0",
                       effect="a front end that dies resets the connections still waiting at its listener",
                       fix=f"{MIGRATE_SYSCTL}=1 (docker-compose.yml sets it)")
        for index in range(self.count):
            self._spawn(index)
            threading.Thread(target=self._watch, args=(index,), name=f"front-end-{index}", daemon=True).start()

    def _spawn(self, index: int) -> None:
        # stdin is a pipe this process never writes: its end (EOF) tells the front end the engine is gone
        process = subprocess.Popen([sys.executable, "-m", "serve"], env=self.environment(index),
                                   stdin=subprocess.PIPE)
        self._processes[index] = process
        logs.event(log, "front_end_started", index=index, pid=process.pid)

    def _watch(self, index: int) -> None:
        delay = RESTART_S[0]
        while True:
            process = self._processes[index]
            code = process.wait()
            with self._lock:
                if self._stopping:
                    return
                self._listening.pop(index, None)
            logs.event(log, "front_end_died", logging.ERROR, index=index, pid=process.pid, code=code,
                       restart_in_s=f"{delay:g}")
            time.sleep(delay)  # a deliberate pause before a restart (a front end failing at start would spin)
            with self._lock:
                if self._stopping:
                    return
                self.restarts += 1
                self._spawn(index)
            delay = min(delay * 2, RESTART_S[1])

    def listening(self, header: dict) -> None:
        """A front end serves: `header` its transport and ports. Once all do, the server is up."""
        with self._lock:
            self._listening[header["fe"]] = header
            if len(self._listening) == self.count:
                self._all_listening.set()

    def wait_listening(self, timeout: float) -> bool:
        return self._all_listening.wait(timeout)

    def transport(self) -> str:
        return next(iter(self._listening.values()), {}).get("transport", "")

    def pids(self) -> list[int]:
        return [p.pid for p in self._processes if p is not None]

    def stop(self, grace: float) -> bool:
        """Waits up to `grace` s for every front end to end (a drain told them to), then kills what is left.
        True when all ended by themselves."""
        with self._lock:
            self._stopping = True
        end, clean = time.monotonic() + grace, True
        for process in self._processes:
            if process is None:
                continue
            try:
                process.wait(max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                clean = False
                process.kill()
                process.wait()
            if process.stdin is not None:
                process.stdin.close()
        for held in self._held:
            if held is not None:
                held.close()
        return clean


class EngineProcess:
    """The server's process with front ends (module docstring)."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.metrics = Metrics(parts=(ENGINE,))
        self.metrics_port: int | None = None
        self.admission = Admission(config.default_model)
        self.repository = ModelRepository(config, self.admission, self.metrics, default_backend)
        self.folder = tempfile.mkdtemp(prefix="encoder-front-ends-")
        self.multiproc_dir = os.path.join(self.folder, "metrics")
        os.makedirs(self.multiproc_dir)
        self.front_ends = FrontEnds(config, self.folder, self.multiproc_dir)
        calls = {"index": lambda: [e.__dict__ for e in self.repository.index()],
                 "load": lambda name: self.repository.load(name).__dict__,
                 "unload": lambda name: self.repository.unload(name),
                 "reload": lambda model="", export_dir="", graph="": self.repository.reload(model, export_dir,
                                                                                           graph).__dict__,
                 "reload_all": lambda: [r.__dict__ for r in self.repository.reload_all()]}
        events = {"hello": lambda header: self.service.send(header["fe"], self.models_message()),
                  "listening": self.front_ends.listening}
        try:
            self.service = EngineService(self.folder, self.front_ends.count, self.admission, calls, events)
        except BaseException:  # its sockets could not be bound: the folder would outlive a server that never ran
            shutil.rmtree(self.folder, ignore_errors=True)
            raise
        self.admission.on_change = lambda: self.service.broadcast(self.models_message())

    def models_message(self) -> dict:
        """The served models and the server's state, as every front end mirrors them."""
        state, leaving, engines, changing = self.admission.snapshot()
        return {"k": "models", "state": state, "leaving": leaving, "changing": changing,
                "models": [model_spec(engine) for engine in engines.values()]}

    def start(self) -> None:
        """Loads every model, then starts the front ends and waits until each listens (and serves)."""
        self.service.start()
        self.admission.loading()
        started = time.monotonic()
        engines = self.repository.load_all()
        if not self.admission.serving(engines):
            raise Unavailable("the server stopped while its models loaded")
        self.metrics.ready.set(1)
        if self.config.metrics_port >= 0:
            self.metrics_port = self.metrics.serve_http(self.config.metrics_host, self.config.metrics_port,
                                                        front_ends_dir=self.multiproc_dir)
        self.front_ends.start()
        if not self.front_ends.wait_listening(LISTEN_TIMEOUT_S):
            raise Unavailable(f"the front ends did not all listen within {LISTEN_TIMEOUT_S:g} s")
        write_port_file(self.config.port_file, port=self.front_ends.port, metrics_port=self.metrics_port,
                        transport=self.front_ends.transport(),
                        http_port=self.front_ends.http_port if self.config.http_port >= 0 else None,
                        front_ends=self.front_ends.pids())
        logs.event(log, "serving", models=",".join(sorted(engines)), front_ends=self.front_ends.count,
                   port=self.front_ends.port, http_port=self.front_ends.http_port, metrics_port=self.metrics_port,
                   sha256=",".join(e.export.sha256[:12] for _, e in sorted(engines.items())),
                   load_s=f"{time.monotonic() - started:.3f}")

    def leave(self, delay: float) -> None:
        """The drain delay: every front end reports not ready while still admitting (told by `admission.leave`,
        on_change), for `delay` s."""
        drain_delay(self.admission, self.metrics, delay)

    def shutdown(self, grace: float | None = None) -> bool:
        """The drain: every front end stops admitting, answers what it admitted and exits; the engine answers
        what they sent, then stops. True when everything admitted was answered in time."""
        grace = self.config.grace_s if grace is None else grace
        if self.admission.drain() is None:  # told to every front end (on_change): each drains itself
            return True
        self.metrics.ready.set(0)
        engines = self.admission.current()
        started, end = time.monotonic(), time.monotonic() + grace
        logs.event(log, "draining", front_ends=self.front_ends.count, in_flight=self.admission.in_flight(),
                   grace_s=grace)
        clean = self.front_ends.stop(grace + 5.0)  # their own drain takes up to grace_s
        for engine in engines:
            engine.batcher.close()
        drained = self.admission.wait_calls(end) and clean
        for engine in engines:
            engine.batcher.stop(0)
        self.service.stop()
        self.metrics.close()
        self.admission.stopped()
        shutil.rmtree(self.folder, ignore_errors=True)
        logs.event(log, "stopped", drained=drained, restarts=self.front_ends.restarts,
                   drain_s=f"{time.monotonic() - started:.3f}")
        return drained


def serve_engine(config: ServerConfig, stop) -> int:
    """`python -m serve --front-ends N`: runs until SIGTERM/SIGINT (`stop`); the process's exit code."""
    try:
        server = EngineProcess(config)
    except (RuntimeError, ServeError) as error:
        logs.event(log, "startup_failed", logging.ERROR, error=getattr(error, "message", str(error)))
        return 1

    reload_on_sighup(server.repository)  # each front end is told what changed (Admission.on_change)
    return run_until_signalled(server, server.start, stop, config)

