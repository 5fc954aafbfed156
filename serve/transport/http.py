"""The HTTP transport: uvicorn (an ASGI server: HTTP/1.1 parsing, keep-alive, TLS) on its own port
(`--http-port`, default 8000; -1: off), in the serving process, on its own thread and event loop.

Why uvicorn and a bare ASGI app: uvicorn is the maintained ASGI server the Python HTTP serving world
runs on (FastAPI's, infinity's), with h11 or httptools parsing the bytes; the app below only routes
a handful of paths, so a web framework would add a layer per request and nothing we use.

Each request becomes an `Rpc` (serve/transport/rpc.py) that the same adapters and core answer as on
gRPC: the bearer token (`TokenCheck`, health exempt), admission and drain (503 + Retry-After),
validation, batching, metrics. Which route a method and path are, and which error body a refusal takes, is
the protocols' router's (serve/protocols/routing.py over the one route table, serve/protocols/routes.py): this
transport knows no path. Errors become HTTP statuses through serve/protocols/status.py's one mapping, in the
body of the family the path belongs to. The body limit is max_request_bytes: a larger Content-Length is
refused 413 before the body is read, and a body that grows past it while read is cut off with 413.

Refusals reach the client: a request refused before its body was read (401, 404, 405, 413) has the
rest of its body read and dropped first (for at most DISCARD_S, as nginx's lingering close), since
clients that send a whole body without `Expect: 100-continue` (urllib, requests, httpx) would
otherwise see the server's close as a reset and never read the answer. The connection stays open.

Impatience: a client that disconnects has its queued request dropped (counted CANCELLED, never run),
as a cancelled gRPC call's is; `X-Request-Timeout: <seconds>` is the HTTP request's deadline, which
admission and the queue honour as gRPC's, answered 504 when it passes. A body that pauses longer
than http_body_timeout_s is answered 408 and the connection closed. The connection-level rules
(TCP_NODELAY, header timeout, connection cap, keep-alive) are in serve/transport/http_connections.py.
"""

from __future__ import annotations

import asyncio
import logging
import math
import resource
import socket
import ssl
import threading
import time
from typing import Callable

import grpc

from serve import logs
from serve.core import express
from serve.errors import ServeError, ValidationError, clip
from serve.protocols.status import RETRY_AFTER_S, http_status, to_status
from serve.transport import security
from serve.transport.http_connections import protocol_class
from serve.transport.rpc import Rpc

log = logging.getLogger("serve.transport.http")

DEADLINE_HEADER = "x-request-timeout"  # seconds (a decimal number > 0): the request's deadline
DISCARD_S = 30.0  # an early refusal reads and drops the rest of the body for at most this long
# uvicorn's fast paths, kept for what they measured here (docs/serving.md "HTTP connections")
PARSER, LOOP = "httptools", "uvloop"


class HttpRpc(Rpc):
    """One HTTP request; its answer resolves an asyncio future on the transport's loop."""

    def __init__(self, loop, method: str, headers, remaining: float | None = None) -> None:
        super().__init__(method, headers, remaining)
        self._loop = loop
        self.future = loop.create_future()
        # payload -> (body, extra headers, content type): a route whose adapter answers in another form
        # (KServe v2 REST: its JSON or binary body with its headers)
        self.render: Callable[[bytes], tuple[bytes, list, bytes]] | None = None
        self.status: int | None = None  # an answer's HTTP status other than 200 (a health route's 503)

    def reply_http(self, status: int, payload: bytes) -> None:
        """Answers `payload` with HTTP status `status` (a probe's 503 carries its body, not an error's)."""
        self.status = status
        self.reply(payload)

    def _send(self, payload: bytes) -> None:
        raise NotImplementedError("HTTP answers once")

    def _close(self, code: grpc.StatusCode, message: str, payload: bytes | None) -> None:
        self._loop.call_soon_threadsafe(self._resolve, (code, message, payload))

    def _resolve(self, outcome) -> None:
        if not self.future.done():
            self.future.set_result(outcome)


class HttpTransport:
    name = "http"

    def __init__(self, host: str, port: int, router, *, auth_token: str, max_body_bytes: int, reuse_port: bool = False,
                 tls_files: tuple[str, str, str] | None, keep_alive_s: float = 75.0, header_timeout_s: float = 60.0,
                 body_timeout_s: float = 60.0, max_connections: int = 1024) -> None:
        import uvicorn

        # the protocols' router (serve/protocols/routing.py HttpRoutes, over the one route table): which route
        # a method and path are, the error body of the family a path belongs to; this transport knows no path
        self._router, self._max = router, max_body_bytes
        self._body_timeout = body_timeout_s
        self._token = security.TokenCheck(auth_token) if auth_token else None
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets made so (http_connections sets it too)
        self._socket = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:  # front-end processes share the port (serve/assembly/front_ends.py): the kernel spreads them
            self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            self._socket.bind((host, port))
        except OSError as error:
            self._socket.close()
            raise RuntimeError(f"--http-port: cannot listen on {host}:{port} ({error.strerror or error})") from None
        self.port = self._socket.getsockname()[1]
        _allow_descriptors(max_connections)
        options = {}
        if tls_files is not None:
            cert, key, ca = tls_files
            options = {"ssl_certfile": cert, "ssl_keyfile": key}
            if ca:
                options.update(ssl_ca_certs=ca, ssl_cert_reqs=ssl.CERT_REQUIRED)
        over_cap = router.fallback_error_body(503, f"too many open connections (http_max_connections="
                                                   f"{max_connections}); retry")
        protocol = protocol_class(_parser(), header_timeout_s=header_timeout_s, max_connections=max_connections,
                                  refusal_body=over_cap)
        config = uvicorn.Config(self.app, interface="asgi3", log_level="warning", access_log=False, lifespan="off",
                                server_header=False, http=protocol, loop=_loop(), timeout_keep_alive=keep_alive_s,
                                backlog=max(2048, max_connections), **options)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._run, name="http", daemon=True)
        self._in_flight = 0  # requests between their hand-off to the router and their answer (on the loop's thread)

    def _run(self) -> None:
        logs.name_thread("http")
        self._server.run(sockets=[self._socket])

    def start(self) -> None:
        self._thread.start()

    def stop(self, grace: float) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=max(grace, 1.0) + 5)

    # -- the ASGI app --------------------------------------------------------------------------
    async def app(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        method = f"{scope['method']} {scope['path']}"
        headers = [(k.decode("latin-1").lower(), v.decode("latin-1")) for k, v in scope["headers"]]
        request = _Request(scope, receive, headers)
        match = self._router.match(scope["method"], scope["path"])
        error_body = match.error_body
        if self._token is not None and not match.open:
            refusal = self._token.refusal(method, headers)
            if refusal is not None:
                await request.refuse(send, 401, error_body(401, security.DENIED["http"]),
                                     [(b"www-authenticate", security.WWW_AUTHENTICATE[refusal].encode())])
                return
        if match.route is None:
            await request.refuse(send, match.status, error_body(match.status, match.message))
            return
        try:
            remaining = _timeout(request.header(DEADLINE_HEADER))
        except ServeError as error:
            await request.refuse(send, 400, error_body(400, error.message))
            return
        rpc = HttpRpc(asyncio.get_running_loop(), method, headers, remaining)
        body = b""
        if match.reads_body:
            body = await self._read(request, send, error_body)
            if body is None:
                return
        self._in_flight += 1
        try:
            # the only request in flight: it may run on this thread (serve/core/express.py)
            with express.granted(self._in_flight == 1):
                try:
                    self._router.call(match, rpc, body, headers)
                except ServeError as error:  # refused before an adapter's edge (a body that is no JSON object)
                    rpc.fail(*to_status(error))
                except Exception as error:  # a route raising anything else is a bug: INTERNAL, never a trace
                    logs.event(log, "unexpected_error", logging.ERROR, method=method, error=repr(error))
                    rpc.fail(grpc.StatusCode.INTERNAL, f"internal error: {type(error).__name__}")
            answered = await self._answered(rpc, receive)
        finally:
            self._in_flight -= 1
        if not answered:
            return  # the client left: nothing to send
        code, message, payload = rpc.future.result()
        status = http_status(code)
        if status == 200:
            extra, content_type = [], b"application/json"
            if rpc.render is not None:
                try:
                    payload, extra, content_type = rpc.render(payload)
                except Exception as error:
                    logs.event(log, "unexpected_error", logging.ERROR, method=method, error=repr(error))
                    await request.reply(send, 500, error_body(500, "internal error: the answer could not be "
                                                                   "rendered"))
                    return
            await request.reply(send, rpc.status or 200, payload, extra, content_type)
        else:
            retry = [(b"retry-after", str(RETRY_AFTER_S).encode())] if status in (429, 503) else []
            await request.reply(send, status, error_body(status, message), retry)

    @staticmethod
    async def _answered(rpc: HttpRpc, receive) -> bool:
        """Waits for the answer; False when the client disconnected first (the call is cancelled:
        a queued request is dropped, never run). At the deadline the call fails DEADLINE_EXCEEDED."""
        left = asyncio.ensure_future(_disconnect(receive))
        try:
            timeout = None if rpc.deadline is None else max(0.0, rpc.deadline - time.monotonic())
            await asyncio.wait((rpc.future, left), timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            if rpc.future.done():
                return True
            if left.done():
                rpc.cancelled()
                return False
            rpc.fail(grpc.StatusCode.DEADLINE_EXCEEDED,
                     f"deadline exceeded: the {DEADLINE_HEADER} header's time passed before the answer")
            await asyncio.wait((rpc.future, left), return_when=asyncio.FIRST_COMPLETED)
            return rpc.future.done()
        finally:
            left.cancel()

    async def _read(self, request: "_Request", send, error_body) -> bytes | None:
        """The request body, or None after answering it (413: declared or grown past the limit; 408:
        it stopped arriving; or the client left)."""
        declared = request.header("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self._max:
            await request.refuse(send, 413, error_body(413, f"request body: {declared} bytes exceed "
                                                            f"max_request_bytes={self._max}"))
            return None
        chunks, size = [], 0
        while True:
            try:
                message = await asyncio.wait_for(request.receive(), self._body_timeout)
            except asyncio.TimeoutError:
                await request.reply(send, 408, error_body(408, f"request body: nothing arrived for "
                                                               f"http_body_timeout_s={self._body_timeout:g} s"),
                                    [(b"connection", b"close")])
                return None
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self._max:
                await request.refuse(send, 413, error_body(413, f"request body: over max_request_bytes={self._max}"))
                return None
            chunks.append(chunk)
            if not message.get("more_body"):
                request.body_read = True
                return b"".join(chunks)


class _Request:
    """One HTTP request's reading side, for the answers that must reach its client (module docstring)."""

    def __init__(self, scope, receive, headers: list[tuple[str, str]]) -> None:
        self._receive, self._headers = receive, headers
        self.body_read = scope["method"] in ("GET", "HEAD") and self.header("content-length") in (None, "0") \
            and self.header("transfer-encoding") is None

    def header(self, name: str) -> str | None:
        return next((v for k, v in self._headers if k == name), None)

    async def receive(self):
        message = await self._receive()
        if message["type"] == "http.request" and not message.get("more_body"):
            self.body_read = True
        return message

    async def refuse(self, send, status: int, body: bytes, extra: list | None = None) -> None:
        """An answer before the body was read: the rest of the body is read and dropped first (for at
        most DISCARD_S), so the client reads the answer instead of a reset; past that, or when the
        client waits for `100 Continue` (and so never sends the body), the connection closes after it."""
        extra = list(extra or [])
        if not self.body_read and (self.header("expect") or "").lower() != "100-continue":
            try:
                await asyncio.wait_for(self._discard(), DISCARD_S)
            except asyncio.TimeoutError:
                pass
        if not self.body_read:
            extra.append((b"connection", b"close"))
        await self.reply(send, status, body, extra)

    async def _discard(self) -> None:
        while not self.body_read:
            message = await self._receive()
            if message["type"] == "http.disconnect" or not message.get("more_body"):
                self.body_read = True

    @staticmethod
    async def reply(send, status: int, body: bytes, extra: list | None = None,
                    content_type: bytes = b"application/json") -> None:
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", content_type),
                                (b"content-length", str(len(body)).encode()), *(extra or [])]})
        await send({"type": "http.response.body", "body": body})


async def _disconnect(receive) -> None:
    """Returns when the client disconnects (its body has been read: receive() waits for that alone)."""
    while (await receive())["type"] != "http.disconnect":
        pass


def _timeout(value: str | None) -> float | None:
    """The X-Request-Timeout header's value in seconds, None without one; ValidationError when malformed."""
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not (seconds > 0 and math.isfinite(seconds)):
        raise ValidationError(f"{DEADLINE_HEADER}: expected a number of seconds > 0, got {clip(value)!r}")
    return seconds


def _parser() -> type:
    """uvicorn's protocol class for PARSER (h11 where httptools is not installed)."""
    if PARSER == "httptools":
        try:
            from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

            return HttpToolsProtocol
        except ImportError:
            pass
    from uvicorn.protocols.http.h11_impl import H11Protocol

    return H11Protocol


def _loop() -> str:
    if LOOP == "uvloop":
        try:
            import uvloop  # noqa: F401

            return "uvloop"
        except ImportError:
            pass
    return "asyncio"


def _allow_descriptors(max_connections: int) -> None:
    """Raises this process's open-file limit (soft, up to the hard one) so max_connections fit beside
    everything else the server holds; a host that allows fewer is logged, not refused."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = max_connections + 512
    if soft == resource.RLIM_INFINITY or soft >= want:
        return
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if target > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    if target < want:
        logs.event(log, "http_connections_limited", logging.WARNING, max_connections=max_connections,
                   open_files_limit=target)
