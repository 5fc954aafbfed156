"""The ONE place errors become statuses: each error kind (serve/errors.py) its gRPC status, and each
gRPC status its HTTP status (the HTTP transport answers with it), so every protocol agrees.

`to_status` also cuts any message to MAX_MESSAGE_BYTES (serve/errors.py `bounded`). Anything that is
not a ServeError is a bug: INTERNAL with its type, never UNKNOWN. Each HTTP protocol writes its own
error body from (status, message): OpenAI's object (serve/protocols/openai.py `error_body`), KServe v2
REST's {"error": message} (serve/protocols/kserve_rest.py `error_body`).
"""

from __future__ import annotations

import grpc

from serve.errors import ServeError, bounded

GRPC_STATUS = {
    "internal": grpc.StatusCode.INTERNAL,
    "invalid_argument": grpc.StatusCode.INVALID_ARGUMENT,
    "unimplemented": grpc.StatusCode.UNIMPLEMENTED,
    "resource_exhausted": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "unavailable": grpc.StatusCode.UNAVAILABLE,
    "deadline_exceeded": grpc.StatusCode.DEADLINE_EXCEEDED,
    "cancelled": grpc.StatusCode.CANCELLED,
    "not_found": grpc.StatusCode.NOT_FOUND,
    "failed_precondition": grpc.StatusCode.FAILED_PRECONDITION,
}

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


def to_status(error: BaseException) -> tuple[grpc.StatusCode, str]:
    """The gRPC status for any exception that reaches the edge."""
    if isinstance(error, ServeError):
        return GRPC_STATUS[error.kind], bounded(error.message)
    return grpc.StatusCode.INTERNAL, bounded(f"internal error: {type(error).__name__}: {error}")


def http_status(code: grpc.StatusCode) -> int:
    return HTTP_STATUS.get(code, 500)
