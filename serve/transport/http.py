"""The HTTP transport: uvicorn (an ASGI server: HTTP/1.1 parsing, keep-alive, TLS) on its own port
(`--http-port`, default 8000; -1: off), in the serving process, on its own thread and event loop.

Why uvicorn and a bare ASGI app: uvicorn is the maintained ASGI server the Python HTTP serving world
runs on (FastAPI's, infinity's), with h11 or httptools parsing the bytes; the app below only routes
a handful of paths, so a web framework would add a layer per request and nothing we use.

Each request becomes an `Rpc` (serve/transport/rpc.py) that the same adapters and core answer as on
gRPC: the bearer token (`TokenCheck`, health exempt), admission and drain (503 + Retry-After),
validation, batching, metrics. Errors become HTTP statuses through serve/errors.py's one table, with
OpenAI's error object as the body. The body limit is max_request_bytes: a larger Content-Length is
refused 413 before the body is read, and a body that grows past it while read is cut off with 413.
"""

from __future__ import annotations

import json
import logging
import socket
import ssl
import threading
from typing import Callable

import grpc

from serve import logs
from serve.errors import OPENAI_ERROR_TYPES, RETRY_AFTER_S, ServeError, http_status, to_status
from serve.protocols.edge import json_object
from serve.transport import security
from serve.transport.rpc import Rpc

log = logging.getLogger("serve.transport.http")

Route = Callable[[Rpc, object], None]  # (rpc, the JSON body or None); answers through rpc


class HttpRpc(Rpc):
    """One HTTP request; its answer resolves an asyncio future on the transport's loop."""

    def __init__(self, loop, method: str, headers) -> None:
        super().__init__(method, headers, None)
        self._loop = loop
        self.future = loop.create_future()
        self.kserve = False  # errors as KServe v2 REST's {"error": "..."}, not OpenAI's object
        # payload -> (body, extra headers, content type): a route whose adapter answers in another form
        # (KServe v2 REST: the gRPC adapter's protobuf answer, rendered as REST)
        self.render: Callable[[bytes], tuple[bytes, list, bytes]] | None = None

    def _send(self, payload: bytes) -> None:
        raise NotImplementedError("HTTP answers once")

    def _close(self, code: grpc.StatusCode, message: str, payload: bytes | None) -> None:
        self._loop.call_soon_threadsafe(self._resolve, (code, message, payload))

    def _resolve(self, outcome) -> None:
        if not self.future.done():
            self.future.set_result(outcome)


def error_body(status: int, message: str, kserve: bool = False) -> bytes:
    """OpenAI's error object (what its clients raise from), or KServe v2 REST's {"error": message}."""
    if kserve:
        return json.dumps({"error": message}).encode()
    return json.dumps({"error": {"message": message, "type": OPENAI_ERROR_TYPES.get(status, "server_error"),
                                 "param": None, "code": status}}).encode()


class HttpTransport:
    name = "http"

    def __init__(self, host: str, port: int, routes: dict[str, Route], ready: Callable[[], bool], *,
                 auth_token: str, max_body_bytes: int, tls_files: tuple[str, str, str] | None,
                 v2=None) -> None:
        import uvicorn

        self._routes, self._ready, self._max = routes, ready, max_body_bytes
        self._v2 = v2  # KServe v2 REST (serve/protocols/kserve_rest.py): every /v2/... path but health
        self._token = security.TokenCheck(auth_token) if auth_token else None
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._socket = socket.socket(family, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._socket.bind((host, port))
        except OSError as error:
            self._socket.close()
            raise RuntimeError(f"--http-port: cannot listen on {host}:{port} ({error.strerror or error})") from None
        self.port = self._socket.getsockname()[1]
        options = {}
        if tls_files is not None:
            cert, key, ca = tls_files
            options = {"ssl_certfile": cert, "ssl_keyfile": key}
            if ca:
                options.update(ssl_ca_certs=ca, ssl_cert_reqs=ssl.CERT_REQUIRED)
        config = uvicorn.Config(self.app, interface="asgi3", log_level="warning", access_log=False, lifespan="off",
                                server_header=False, **options)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._run, name="http", daemon=True)

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
        if scope["path"] in ("/v2/health/live", "/v2/health/ready", "/health"):  # open, as gRPC health
            ready = self._ready() if scope["path"] != "/v2/health/live" else True
            await self._reply(send, 200 if ready else 503, json.dumps({"live": True, "ready": ready}).encode())
            return
        if self._token is not None and not self._token.allowed(method, headers):
            await self._reply(send, 401, error_body(401, security.DENIED, scope["path"].startswith("/v2")))
            return
        import asyncio

        rpc = HttpRpc(asyncio.get_running_loop(), method, headers)
        v2 = self._v2 is not None and (scope["path"] == "/v2" or scope["path"].startswith("/v2/"))
        route = self._routes.get(method)
        if route is None and not v2:
            known = any(name.split(" ", 1)[1] == scope["path"] for name in self._routes)
            status = 405 if known else 404
            await self._reply(send, status, error_body(status, f"{method}: no such endpoint"
                                                       if not known else f"{method}: method not allowed"))
            return
        rpc.kserve = v2
        body = None
        if scope["method"] == "POST":
            body = await self._read(scope, receive, headers, send, v2)
            if body is None:
                return
            if not v2:
                try:
                    body = json_object(body)
                except ServeError as error:
                    await self._reply(send, 400, error_body(400, error.message))
                    return
        try:
            if v2:
                self._v2.route(rpc, scope["method"], scope["path"], body or b"", headers)
            else:
                route(rpc, body)
        except ServeError as error:  # refused before it reached an adapter's edge (KServe REST's parsing)
            rpc.fail(*to_status(error))
        except Exception as error:  # a route raising anything else is a bug: INTERNAL, never a trace
            logs.event(log, "unexpected_error", logging.ERROR, method=method, error=repr(error))
            rpc.fail(grpc.StatusCode.INTERNAL, f"internal error: {type(error).__name__}")
        code, message, payload = await rpc.future
        status = http_status(code)
        if status == 200:
            extra, content_type = [], b"application/json"
            if rpc.render is not None:
                try:
                    payload, extra, content_type = rpc.render(payload)
                except Exception as error:
                    logs.event(log, "unexpected_error", logging.ERROR, method=method, error=repr(error))
                    await self._reply(send, 500, error_body(500, "internal error: the answer could not be "
                                                                 "rendered", v2))
                    return
            await self._reply(send, 200, payload, extra, content_type)
        else:
            retry = [(b"retry-after", str(RETRY_AFTER_S).encode())] if status in (429, 503) else []
            await self._reply(send, status, error_body(status, message, v2), retry)

    async def _read(self, scope, receive, headers, send, kserve: bool = False) -> bytes | None:
        """The request body, or None after answering 413 (declared or grown past the limit)."""
        declared = next((v for k, v in headers if k == "content-length"), None)
        if declared is not None and declared.isdigit() and int(declared) > self._max:
            await self._reply(send, 413, error_body(413, f"request body: {declared} bytes exceed "
                                                         f"max_request_bytes={self._max}", kserve))
            return None
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self._max:
                await self._reply(send, 413, error_body(413, f"request body: over max_request_bytes={self._max}",
                                                        kserve))
                return None
            chunks.append(chunk)
            if not message.get("more_body"):
                return b"".join(chunks)

    @staticmethod
    async def _reply(send, status: int, body: bytes, extra: list | None = None,
                     content_type: bytes = b"application/json") -> None:
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", content_type),
                                (b"content-length", str(len(body)).encode()), *(extra or [])]})
        await send({"type": "http.response.body", "body": body})
