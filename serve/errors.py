"""The server's small typed error set. Each error has a `kind` and knows no transport: the protocols
map kinds to their statuses in ONE place (serve/protocols/status.py: the gRPC status, and from it the
HTTP status; each HTTP protocol writes its own error body). Every layer raises these. Anything else
that escapes is a bug and is reported as INTERNAL with its type, never as UNKNOWN.

Strings a client sent (a model, input or parameter name, a parameter value) appear in messages only
through `clip` / `quote`: at most QUOTE_CHARS characters, then "…(N bytes)". And `to_status` cuts
any message to MAX_MESSAGE_BYTES: gRPC sends it as percent-encoded trailing metadata, and over its
16 KiB metadata limit the client would get RESOURCE_EXHAUSTED instead of the real error.
"""

from __future__ import annotations

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


def listing(names, most: int) -> str:
    """Names for a message: each as `quote` shows it, at most `most` of them, then "and N more"."""
    names = list(names)
    shown = ", ".join(quote(n) for n in names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


def bounded(message: str, limit: int = MAX_MESSAGE_BYTES) -> str:
    """`message` cut to at most `limit` UTF-8 bytes (plus a note saying so)."""
    data = message.encode("utf-8", "backslashreplace")
    if len(data) <= limit:
        return message
    return data[:limit].decode("utf-8", "ignore") + f"…(message cut: {len(data)} bytes)"


class ServeError(Exception):
    """Base of the errors a request can end with; `message` is what the client reads."""

    kind = "internal"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class ValidationError(ServeError):
    """The request cannot be served as sent; the message names the field and the limit."""

    kind = "invalid_argument"


class Unsupported(ServeError):
    """A well-formed request for a feature this server does not implement (yet)."""

    kind = "unimplemented"


class Overloaded(ServeError):
    """The admission queue is full; retry later."""

    kind = "resource_exhausted"


class TooLarge(ServeError):
    """The request needs more of a resource (memory for attention) than this server allows at all;
    retrying the same request will not help, a smaller one will."""

    kind = "resource_exhausted"


class Unavailable(ServeError):
    """Not ready yet, or shutting down."""

    kind = "unavailable"


class DeadlineExceeded(ServeError):
    """The request's deadline passed before it ran; it was dropped from the queue."""

    kind = "deadline_exceeded"


class Cancelled(ServeError):
    """The client went away before the request ran."""

    kind = "cancelled"


class NotFound(ServeError):
    """What the request names (a model, over HTTP) is not served here."""

    kind = "not_found"


class ModelRefused(ServeError):
    """A model reload was refused (bad export, failed checks); the previous model keeps serving."""

    kind = "failed_precondition"


class BackendError(ServeError):
    """The inference backend failed (at start: it cannot serve this export or device)."""

    kind = "internal"


def by_name(name: str, message: str) -> ServeError:
    """The ServeError of class `name` (as another process of this server sent it: any subclass of ServeError),
    else a plain one."""
    classes = [ServeError]
    while classes:
        cls = classes.pop()
        if cls.__name__ == name:
            return cls(message)
        classes.extend(cls.__subclasses__())
    return ServeError(message)
