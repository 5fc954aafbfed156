"""Server assembly and lifecycle: `create_server(config) -> (server, port)` and `serve(config)`.

Lifecycle: bind and start (health NOT_SERVING; Encode answers UNAVAILABLE) -> load the export,
check the backend, warm up -> SERVING. On SIGTERM/SIGINT (`EncoderServer.shutdown`): NOT_SERVING;
calls that arrive from then on are refused UNAVAILABLE by our own handlers (retry-safe); every call
admitted before finishes (counted in flight until gRPC reports it ended, not guessed with sleeps);
streams end UNAVAILABLE once they have answered what they sent before; if the grace period runs out,
what is still running is answered UNAVAILABLE and counted in the log. Only then, once no call has
arrived for `drain_quiet_ms`, `server.stop()`: gRPC cancels the calls it holds unanswered when it
stops, so it must hold none. Exit 0 when everything admitted was answered in time.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Callable

from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from serve import logs
from serve.assembly.loading import BackendFactory, default_backend
from serve.assembly.front_end import RemoteRepository
from serve.assembly.repository import ModelRepository
from serve.config import ServerConfig, front_end_count
from serve.core.admission import Admission
from serve.core.engine import Engine, Reloaded
from serve.core.metrics import REQUESTS, Metrics
from serve.errors import ServeError, Unavailable
from serve.protocols import kserve_v2 as kserve
from serve.protocols import routes
from serve.protocols.admin import ADMIN_SERVICE_NAME, add_admin_to_server
from serve.protocols.edge import Api
from serve.protocols.encoder_v1 import SERVICE as SERVICE_NAME, add_encoder_to_server
from serve.protocols.repository_api import add_repository_to_server
from serve.transport import native, security
from serve.transport.grpcio import GrpcioTransport
from serve.transport.http import HttpTransport
from serve.transport.rpc import Registry, Router

log = logging.getLogger("serve.assembly.app")

ABANDON_S = 2.0  # after the grace period: for the UNAVAILABLE answers of abandoned calls to go out


class EncoderServer:
    """The gRPC server plus the model it serves; `load()` makes it ready, `reload()` swaps the model
    without downtime, `shutdown()` drains it."""

    def __init__(self, config: ServerConfig, backend_factory: BackendFactory | None = None, *,
                 link=None, mirror=None) -> None:
        self.config = config
        # a front-end process (`link`: its wire to the engine process, serve/assembly/front_end.py) counts its
        # requests only; the engine keeps the rest (serve/core/metrics.py)
        self.metrics = Metrics(parts=(REQUESTS,)) if link is not None else Metrics()
        self.metrics_port: int | None = None
        self._backend_factory = backend_factory or default_backend
        # the state, the served engines, the calls in flight and readiness (serve/core/admission.py)
        self.admission = Admission(config.default_model)
        self.admit = self.admission.admit
        self.engine = self.admission.engine
        # the models: the repository's folders, or the one --export-dir (serve/assembly/repository.py); in a
        # front end, the engine process's
        self.repository = RemoteRepository(link, mirror) if link is not None else ModelRepository(
            config, self.admission, self.metrics, self._backend_factory,
            swap=lambda old, new: self._swap_engine(old, new))
        # what every protocol adapter is lent (serve/protocols/edge.py)
        api = Api(self.admission, self.metrics, self.repository)
        # gRPC's own hard limit sits above ours, so most oversized requests reach our check and
        # get INVALID_ARGUMENT naming the limit; only gross ones get gRPC's RESOURCE_EXHAUSTED.
        hard_limit = 2 * config.max_request_bytes + (1 << 20)
        # Every gRPC service registers into one method table; one Router takes every call of the
        # transport (serve/transport/): token, malformed bytes, unknown methods, then the adapters.
        registry = Registry()
        self.health = health.HealthServicer(experimental_non_blocking=True)
        add_encoder_to_server(api, config.max_request_bytes, registry)
        # KServe v2 / Open Inference Protocol on the same engine (serve/protocols/kserve_v2.py, docs/deployment.md)
        kserve.add_kserve_to_server(api, registry)
        # Triton's model repository extension, v2 gRPC (serve/protocols/repository_api.py)
        add_repository_to_server(api, registry)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, registry)
        services = [SERVICE_NAME, kserve.SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME]
        if config.admin:  # ReloadModel (serve/protocols/admin.py); SIGHUP reloads without it
            add_admin_to_server(api, self.reload, registry)
            services.append(ADMIN_SERVICE_NAME)
        # the v2 messages live in their own pool (serve/protocols/kserve_v2.py): reflection reads both
        reflection.enable_server_reflection(tuple(services), registry, pool=kserve.ReflectionPool())
        self._set_health(False)
        self.router = Router(registry, config.auth_token, config.workers)
        tls = security.tls_material(config)  # None: plaintext (bind 127.0.0.1)
        address = f"{config.host}:{config.port}"
        self.transport = self._transport(config, address, registry, hard_limit, tls)
        self.port = self.transport.port
        # every HTTP route of every family (serve/protocols/routes.py, the one route table)
        self.http: HttpTransport | None = None
        if config.http_port >= 0:
            self.http = HttpTransport(config.host, config.http_port, routes.router(api), reuse_port=link is not None,
                                      auth_token=config.auth_token, max_body_bytes=config.max_request_bytes,
                                      tls_files=(config.tls_cert, config.tls_key, config.tls_client_ca)
                                      if config.tls_cert else None,
                                      keep_alive_s=config.http_keep_alive_s,
                                      header_timeout_s=config.http_header_timeout_s,
                                      body_timeout_s=config.http_body_timeout_s,
                                      max_connections=config.http_max_connections)

    def _transport(self, config: ServerConfig, address: str, registry: Registry, hard_limit: int, tls):
        """The native transport where it is built (serve/transport/native.py), else grpcio."""
        reason = native.missing_reason() if config.transport in ("auto", "native") else "--transport grpcio"
        if reason is None:
            return native.NativeTransport(address, self.router, registry.streaming(), hard_limit, tls,
                                          streams=registry.streams())
        if config.transport == "native":
            raise Unavailable(f"--transport native: {reason}")
        if config.transport == "auto":
            logs.event(log, "transport_fallback", logging.WARNING, transport="grpcio", reason=reason)
        return GrpcioTransport(address, self.router, registry, hard_limit, security.server_credentials(tls),
                               config.workers)

    def ready(self) -> bool:
        """What readiness reports on every surface (admission's one answer: serving, and not leaving)."""
        return self.admission.ready()

    def leave(self, delay: float) -> None:
        """The first step of a shutdown (`drain_delay`)."""
        drain_delay(self.admission, self.metrics, delay, lambda: self._set_health(False))

    def not_ready(self) -> None:
        """Reports not ready (a front end, told the engine's drain delay began): health NOT_SERVING."""
        self._set_health(False)

    def _set_health(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE_NAME):
            self.health.set(name, status)

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        self.transport.start()
        if self.http is not None:
            self.http.start()
        if self.config.metrics_port >= 0:
            self.metrics_port = self.metrics.serve_http(self.config.metrics_host, self.config.metrics_port)
        write_port_file(self.config.port_file, port=self.port, metrics_port=self.metrics_port,
                        transport=self.transport.name, http_port=self.http.port if self.http else None)
        logs.event(log, "listening", host=self.config.host, port=self.port, metrics_port=self.metrics_port,
                   transport=self.transport.name, http_port=self.http.port if self.http else None)

    def load(self) -> None:
        """Loads and checks every model (serve/assembly/repository.py), warms up, then reports SERVING.
        Raises ServeError on failure."""
        self.admission.loading()
        started = time.monotonic()
        engines = self.repository.load_all()
        if not self.admission.serving(engines):  # a shutdown arrived while loading
            for engine in engines.values():
                engine.batcher.stop(0)
            return
        self._set_health(True)
        self.metrics.ready.set(1)
        logs.event(log, "serving", models=",".join(sorted(engines)),
                   sha256=",".join(e.export.sha256[:12] for _, e in sorted(engines.items())),
                   load_s=f"{time.monotonic() - started:.3f}")

    def reload(self, export_dir: str = "", graph: str = "", model: str = "") -> Reloaded:
        """Swaps in a new build of `model` ("": the only or default one) without downtime: `export_dir`
        ("" re-reads the served one) is built and checked beside the old engine while the old keeps
        serving, then the engine reference is swapped (one assignment: a request sees the old engine or
        the new one, never a mix). The old engine answers what it holds (requests admitted before the
        swap answer from the old model, and say so in `metadata.model_sha256`), then stops. Any failure
        before the swap raises ModelRefused and changes nothing; a reload while another load, unload or
        reload runs raises Overloaded. Triggered by `encoder.v1.AdminService/ReloadModel` (`--admin`,
        serve/protocols/admin.py), Triton's repository load of a served model, or SIGHUP (every model)."""
        return self.repository.reload(model, export_dir, graph)

    def _swap_engine(self, old: Engine, new: Engine) -> bool:
        return self.admission.swap(old, new)

    def shutdown(self, grace: float | None = None) -> bool:
        """Stop admitting, let every admitted call finish, then stop gRPC. True when all finished in time.

        Never lets gRPC cancel an accepted call: calls arriving while draining get UNAVAILABLE from
        our handlers; calls admitted before finish within `grace`; the ones still running when it
        runs out get UNAVAILABLE (counted: event=drain_timeout abandoned=N); `server.stop()` comes
        last, after drain_quiet_ms without a new call."""
        grace = self.config.grace_s if grace is None else grace
        hooks = self.admission.drain()
        if hooks is None:
            return True
        in_flight = self.admission.in_flight()
        self._set_health(False)
        self.metrics.ready.set(0)
        engines = self.admission.current()
        logs.event(log, "draining", queued=sum(e.batcher.queue_depth() for e in engines), in_flight=in_flight,
                   grace_s=grace)
        started = time.monotonic()
        end = started + grace
        for engine in engines:
            engine.batcher.close()  # what is queued still runs
        for hook in hooks:  # open streams end (UNAVAILABLE) once they have answered what they sent
            hook()
        drained = self.admission.wait_calls(end)
        abandoned = 0
        if not drained:
            late = (f"server is shutting down and its grace period ({grace:g} s) ran out before this request "
                    f"finished; it was not answered, retry it on another replica")
            abandoned = self.admission.in_flight()
            logs.event(log, "drain_timeout", logging.WARNING, abandoned=abandoned, grace_s=grace)
            for engine in engines:
                engine.batcher.abandon(Unavailable(late))
            self.admission.wait_calls(time.monotonic() + ABANDON_S)  # their UNAVAILABLE answers go out
        self.admission.wait_quiet(self.config.drain_quiet_ms / 1e3, end)
        # Nothing we admitted is left running; stop() only closes the listener and the connections.
        self.transport.stop(ABANDON_S)
        if self.http is not None:
            self.http.stop(ABANDON_S)
        self.router.stop()
        for engine in engines:
            engine.batcher.stop(0)
        self.metrics.close()
        refused = self.admission.refused_draining
        self.admission.stopped()
        logs.event(log, "stopped", drained=drained, abandoned=abandoned, refused_while_draining=refused,
                   drain_s=f"{time.monotonic() - started:.3f}")
        return drained


def create_server(config: ServerConfig, *, backend_factory: BackendFactory | None = None, link=None,
                  mirror=None) -> tuple[EncoderServer, int]:
    """A bound, not yet started server and its port (port 0 in the config: the OS chooses). `link`, `mirror`: a
    front-end process's wire to its engine and its view of the engine's models (serve/assembly/front_end.py)."""
    server = EncoderServer(config, backend_factory, link=link, mirror=mirror)
    return server, server.port


class _StopSignals:
    """SIGTERM and SIGINT, for the main thread to wait on.

    The C-level signal handler writes the signal's number to a socket (`signal.set_wakeup_fd`) in
    whichever thread the kernel hands the signal to, so the wait ends even when that is not the main
    thread. A Python handler that sets a threading.Event would run only once the main thread ran again,
    and could deadlock on the Event's own lock if it ran while the main thread held it. Once in 2 full
    suites on a busy machine a SIGTERMed server logged nothing and never drained."""

    STOP = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self._read, self._write = socket.socketpair()
        self._write.setblocking(False)
        signal.set_wakeup_fd(self._write.fileno(), warn_on_full_buffer=False)
        for sig in self.STOP:
            signal.signal(sig, lambda signum, frame: None)  # the wakeup byte is the message

    def wait(self) -> None:
        """Returns once SIGTERM or SIGINT has arrived (before or during the wait)."""
        while not any(byte in self.STOP for byte in self._read.recv(64)):
            pass  # another signal's byte (SIGHUP: its own handler reloads)


def drain_delay(admission: Admission, metrics: Metrics, delay: float, not_ready: Callable[[], None] = lambda: None
                ) -> None:
    """The first step of a shutdown (`drain_delay_s`): every surface reports not ready (`admission.leave`; a
    front end's too, told by the engine; `not_ready()`: gRPC health) while calls are still admitted, for `delay`
    seconds, so balancers take this replica out before it refuses a call."""
    if delay <= 0 or admission.state != "serving":
        return
    admission.leave()
    not_ready()
    metrics.ready.set(0)
    logs.event(log, "leaving", drain_delay_s=delay)
    threading.Event().wait(delay)  # a deliberate delay: nothing to wait for but the balancers


def write_port_file(path: str, **ports) -> None:
    """The server's ports (and its pid) as JSON at `path` ("": none), written whole: a reader never sees half."""
    if not path:
        return
    target = Path(path)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(json.dumps({**ports, "pid": os.getpid()}))
    os.replace(tmp, target)


def reload_on_sighup(repository) -> None:
    """SIGHUP re-reads every served model (on a thread of its own); a refusal keeps that model, logged."""
    def reload(signum, frame) -> None:
        def run() -> None:
            try:
                repository.reload_all()
            except ServeError as error:
                logs.event(log, "sighup_reload_failed", logging.ERROR, error=error.message)

        threading.Thread(target=run, name="sighup-reload", daemon=True).start()

    signal.signal(signal.SIGHUP, reload)


def serve(config: ServerConfig) -> int:
    """Runs until SIGTERM/SIGINT; returns the process exit code. With --front-ends N this process is the
    engine and starts the front ends (serve/assembly/front_ends.py); a front end is started with its role."""
    if config.role == "front-end":
        from serve.assembly.front_end import serve_front_end

        return serve_front_end(config)
    logs.setup(config.log_level)
    if config.model or config.models_file:  # models by id: resolved and exported before anything listens
        from serve.assembly.model_ids import ModelSourceError, prepare

        try:
            config = prepare(config)
        except ModelSourceError as error:
            logs.event(log, "startup_failed", logging.ERROR, error=str(error))
            return 1
    stop = _StopSignals()
    front_ends = front_end_count(config)  # the default: by device
    if front_ends:
        from serve.assembly.front_ends import serve_engine

        return serve_engine(dataclasses.replace(config, front_ends=front_ends), stop)
    try:
        server, _ = create_server(config)
    except RuntimeError as error:  # e.g. the port is taken
        logs.event(log, "startup_failed", logging.ERROR, error=str(error))
        return 1
    except ServeError as error:  # e.g. an unreadable TLS certificate
        logs.event(log, "startup_failed", logging.ERROR, error=error.message)
        return 1

    reload_on_sighup(server.repository)
    server.start()
    return run_until_signalled(server, server.load, stop, config)


def run_until_signalled(server, load: Callable[[], None], stop: "_StopSignals", config: ServerConfig) -> int:
    """`load()`, then serve until SIGTERM/SIGINT: the drain delay, then the drain. A failed load stops the
    server (health never said SERVING) and exits 1; a drain that answered everything exits 0."""
    try:
        load()
    except Exception as error:
        message = error.message if isinstance(error, ServeError) else f"{type(error).__name__}: {error}"
        logs.event(log, "startup_failed", logging.ERROR, error=message)
        server.shutdown(0)
        return 1
    stop.wait()
    logs.event(log, "signal_received")
    server.leave(config.drain_delay_s)
    return 0 if server.shutdown() else 1
