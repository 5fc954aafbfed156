"""The server's small typed error set, and the ONE place that maps it to gRPC status codes.

Every layer raises these; the servicer converts them at the edge (`to_status`). Anything else
that escapes is a bug and is reported as INTERNAL with its type, never as UNKNOWN.

Strings a client sent (a model, input or parameter name, a parameter value) appear in messages only
through `clip` / `quote`: at most QUOTE_CHARS characters, then "…(N bytes)". And `to_status` cuts
any message to MAX_MESSAGE_BYTES: gRPC sends it as percent-encoded trailing metadata, and over its
16 KiB metadata limit the client would get RESOURCE_EXHAUSTED instead of the real error.
"""

from __future__ import annotations

import grpc

QUOTE_CHARS = 200  # of a client-supplied string, in a message
MAX_MESSAGE_BYTES = 2048  # of any status message (UTF-8; percent-encoded by gRPC: at most 3x on the wire)


def clip(text: str | bytes, limit: int = QUOTE_CHARS) -> str:
    """A client-supplied string as a message may show it: whole when short, else its first `limit`
    characters and "…(N bytes)" with its full size."""
    if isinstance(text, bytes):
        size, text = len(text), text.decode("utf-8", "backslashreplace")
    else:
        size = None
    if len(text) <= limit:
        return text
    if size is None:
        size = len(text.encode("utf-8", "surrogatepass"))
    return f"{text[:limit]}…({size} bytes)"


def quote(value: object, limit: int = QUOTE_CHARS) -> str:
    """`repr(value)` for a client-supplied value, its string cut as `clip` does."""
    if isinstance(value, (str, bytes)) and len(value) > limit:
        size = len(value) if isinstance(value, bytes) else len(value.encode("utf-8", "surrogatepass"))
        return f"{value[:limit]!r}…({size} bytes)"
    text = repr(value)
    return text if len(text) <= limit else clip(text, limit)


def bounded(message: str, limit: int = MAX_MESSAGE_BYTES) -> str:
    """`message` cut to at most `limit` UTF-8 bytes (plus a note saying so)."""
    data = message.encode("utf-8", "backslashreplace")
    if len(data) <= limit:
        return message
    return data[:limit].decode("utf-8", "ignore") + f"…(message cut: {len(data)} bytes)"


class ServeError(Exception):
    """Base of the errors a request can end with; `message` is what the client reads."""

    code = grpc.StatusCode.INTERNAL

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class ValidationError(ServeError):
    """The request cannot be served as sent; the message names the field and the limit."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class Unsupported(ServeError):
    """A well-formed request for a feature this server does not implement (yet)."""

    code = grpc.StatusCode.UNIMPLEMENTED


class Overloaded(ServeError):
    """The admission queue is full; retry later."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class TooLarge(ServeError):
    """The request needs more of a resource (memory for attention) than this server allows at all;
    retrying the same request will not help, a smaller one will."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(ServeError):
    """Not ready yet, or shutting down."""

    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(ServeError):
    """The request's deadline passed before it ran; it was dropped from the queue."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Cancelled(ServeError):
    """The client went away before the request ran."""

    code = grpc.StatusCode.CANCELLED


class NotFound(ServeError):
    """What the request names (a model, over HTTP) is not served here."""

    code = grpc.StatusCode.NOT_FOUND


class ModelRefused(ServeError):
    """A model reload was refused (bad export, failed checks); the previous model keeps serving."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class BackendError(ServeError):
    """The inference backend failed (at start: it cannot serve this export or device)."""

    code = grpc.StatusCode.INTERNAL


def to_status(error: BaseException) -> tuple[grpc.StatusCode, str]:
    """The gRPC status for any exception that reaches the edge."""
    if isinstance(error, ServeError):
        return error.code, bounded(error.message)
    return grpc.StatusCode.INTERNAL, bounded(f"internal error: {type(error).__name__}: {error}")


# HTTP's status for each gRPC status (the HTTP transport, serve/transport/http.py, answers with it):
# errors are mapped to gRPC codes above and from there to HTTP here, so both protocols agree.
HTTP_STATUS = {
    grpc.StatusCode.OK: 200,
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.FAILED_PRECONDITION: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
RETRY_AFTER_S = 1  # Retry-After on 429 and 503: overloaded, loading or draining; a retry may succeed
OPENAI_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                      413: "invalid_request_error", 429: "rate_limit_error"}


def http_status(code: grpc.StatusCode) -> int:
    return HTTP_STATUS.get(code, 500)
