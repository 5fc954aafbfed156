"""What the HTTP transport (serve/transport/http.py) does per connection, below the requests: uvicorn's
protocol class with four rules added. Each is a setting of ServerConfig (serve/config.py) and is
explained in docs/serving.md "HTTP connections".

- Answers leave at once: TCP_NODELAY on every accepted connection. uvicorn writes an answer's head
  and body as two writes; with Nagle's algorithm on, the second waits for the client's delayed ACK
  (40 ms on Linux) on every keep-alive request of a pooled client (openai, requests.Session, httpx).
- A header timeout (`http_header_timeout_s`, nginx's client_header_timeout): from the connection's
  start, and from the first byte of each later request, its headers must be whole within it, else
  the connection is closed. uvicorn has none: a client sending half a request line held its
  connection (and a file descriptor) for as long as it liked.
- A cap on open connections (`http_max_connections`): a connection past it is answered 503 with
  Retry-After at once and closed gracefully (its request, if any, is read and dropped for a moment,
  so the 503 is not lost to a reset). It never waits unanswered.
- Keep-alive (`http_keep_alive_s`, uvicorn's timeout_keep_alive) is set where the server is built;
  it is 75 s by default, longer than the idle timeouts of the balancers and client pools in front
  (nginx 75 s, AWS ALB and HAProxy setups 60 s), so the server never closes a connection a client
  is about to reuse.

`protocol_class(base)` makes the class for either of uvicorn's parsers (h11 or httptools); uvicorn
takes it as `Config(http=...)`.
"""

from __future__ import annotations

import socket

from serve.protocols.status import RETRY_AFTER_S

LINGER_S = 2.0  # a refused connection: how long its request is read and dropped before it is closed


def _over_cap_answer(body: bytes) -> bytes:
    """The whole 503 a connection past the cap gets, written before any request is read."""
    return (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
            b"connection: close\r\nretry-after: " + str(RETRY_AFTER_S).encode() +
            b"\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


def protocol_class(base: type, *, header_timeout_s: float, max_connections: int, refusal_body: bytes) -> type:
    """uvicorn's HTTP protocol `base` (H11Protocol or HttpToolsProtocol) with the module's rules;
    `refusal_body`: the 503's body past the cap (serve/transport/http.py's error_body, the one shape)."""
    refusal = _over_cap_answer(refusal_body)

    class Protocol(base):
        _header_timer = None
        _timer_cycle = None
        _refused = False

        def connection_made(self, transport) -> None:
            sock = transport.get_extra_info("socket")
            if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                self._refuse()
                return
            self._start_header_timer()

        def data_received(self, data: bytes) -> None:
            if self._refused:
                return  # read and dropped until the linger ends
            if self._header_timer is None and (self.cycle is None or self.cycle.response_complete):
                self._start_header_timer()  # the first byte of a new request on a kept-alive connection
            super().data_received(data)
            if self._header_timer is not None and self.cycle is not self._timer_cycle:
                self._stop_header_timer()  # its headers are whole: the request is the app's now

        def connection_lost(self, exc) -> None:
            self._stop_header_timer()
            super().connection_lost(exc)

        def eof_received(self):
            if self._refused:
                self.transport.close()
                return None
            return super().eof_received()

        # -- the rules ---------------------------------------------------------------------
        def _start_header_timer(self) -> None:
            self._timer_cycle = self.cycle
            self._header_timer = self.loop.call_later(header_timeout_s, self._header_timeout)

        def _stop_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _header_timeout(self) -> None:
            self._header_timer = None
            if self.cycle is self._timer_cycle and not self.transport.is_closing():
                self.transport.close()  # as nginx: no answer to a request that never arrived whole

        def _refuse(self) -> None:
            """Past the cap: 503 now, then a graceful close (module docstring)."""
            self._refused = True
            self.connections.discard(self)  # the cap counts the connections being served
            self.transport.write(refusal)
            if self.transport.can_write_eof():
                self.transport.write_eof()
            self.loop.call_later(LINGER_S, self.transport.close)

    Protocol.__name__ = Protocol.__qualname__ = f"Capped{base.__name__}"
    return Protocol
