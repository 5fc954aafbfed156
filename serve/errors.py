"""The server's small typed error set, and the ONE place that maps it to gRPC status codes.

Every layer raises these; the servicer converts them at the edge (`to_status`). Anything else
that escapes is a bug and is reported as INTERNAL with its type, never as UNKNOWN.
"""

from __future__ import annotations

import grpc


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


class ModelRefused(ServeError):
    """A model reload was refused (bad export, failed checks); the previous model keeps serving."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class BackendError(ServeError):
    """The inference backend failed (at start: it cannot serve this export or device)."""

    code = grpc.StatusCode.INTERNAL


def to_status(error: BaseException) -> tuple[grpc.StatusCode, str]:
    """The gRPC status for any exception that reaches the edge."""
    if isinstance(error, ServeError):
        return error.code, error.message
    return grpc.StatusCode.INTERNAL, f"internal error: {type(error).__name__}: {error}"
