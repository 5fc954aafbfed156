"""Transport security and authentication: TLS / mTLS server credentials, a bearer-token check,
and clean INVALID_ARGUMENT for request bytes that are not valid protobuf.

- TLS: `--tls-cert` + `--tls-key` (PEM) serve TLS; `--tls-client-ca` additionally *requires* a
  client certificate signed by that CA (mTLS). Without them the port is plaintext, which is why the
  default bind address is 127.0.0.1.
- Token: with `--auth-token` (better: the ENCODER_AUTH_TOKEN environment variable, which does not
  show in `ps`), every RPC except `grpc.health.v1.Health/*` must carry the metadata
  `authorization: Bearer <token>`; otherwise UNAUTHENTICATED. The comparison is constant-time
  (`hmac.compare_digest`). Health stays open so load balancers and orchestrators can probe.
"""

from __future__ import annotations

import hmac
from pathlib import Path

import grpc

from serve.config import ServerConfig
from serve.errors import BackendError

HEALTH_PREFIX = "/grpc.health.v1.Health/"
AUTH_HEADER = "authorization"


def _read_pem(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as error:
        raise BackendError(f"{what} {path!r}: cannot read ({error.strerror or error})") from None


def server_credentials(config: ServerConfig) -> grpc.ServerCredentials | None:
    """TLS credentials from the config, or None for plaintext. Raises BackendError naming the file."""
    if not config.tls_cert:
        return None
    cert = _read_pem(config.tls_cert, "tls_cert")
    key = _read_pem(config.tls_key, "tls_key")
    if b"-----BEGIN" not in cert or b"-----BEGIN" not in key:
        raise BackendError("tls_cert / tls_key must be PEM files (-----BEGIN ...)")
    ca = _read_pem(config.tls_client_ca, "tls_client_ca") if config.tls_client_ca else None
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca,
                                       require_client_auth=ca is not None)


def _deny(message: str) -> grpc.RpcMethodHandler:
    def abort(request, context):
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    def abort_stream(request_iterator, context):
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    return abort, abort_stream


class TokenAuthInterceptor(grpc.ServerInterceptor):
    """Refuses every RPC but health without `authorization: Bearer <token>` (constant-time compare)."""

    def __init__(self, token: str) -> None:
        if not token:
            raise ValueError("TokenAuthInterceptor needs a non-empty token")
        self._expected = f"Bearer {token}".encode()

    def _allowed(self, metadata) -> bool:
        for key, value in metadata or ():
            if key == AUTH_HEADER:
                got = value.encode() if isinstance(value, str) else bytes(value)
                return hmac.compare_digest(got, self._expected)
        return False

    def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method or ""
        if method.startswith(HEALTH_PREFIX) or self._allowed(handler_call_details.invocation_metadata):
            return continuation(handler_call_details)
        handler = continuation(handler_call_details)
        if handler is None:  # unknown method: keep gRPC's own UNIMPLEMENTED
            return None
        unary, stream = _deny("missing or wrong bearer token: send metadata 'authorization: Bearer <token>'")
        # No deserializers: an unauthenticated body is never parsed.
        if handler.request_streaming and handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(stream)
        if handler.request_streaming:
            return grpc.stream_unary_rpc_method_handler(stream)
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(unary)
        return grpc.unary_unary_rpc_method_handler(unary)


class _Malformed:
    """What a request that is not valid protobuf decodes to (instead of gRPC's bare INTERNAL)."""


MALFORMED = _Malformed()


def _tolerant(deserializer):
    def deserialize(data: bytes):
        try:
            return deserializer(data)
        except Exception:  # google.protobuf.message.DecodeError and friends
            return MALFORMED

    return deserialize


def malformed(method: str):
    """The error for bytes that do not parse as `method`'s request (also the native lane's, serve/native_lane.py)."""
    from serve.errors import ValidationError

    return ValidationError(f"request: the bytes are not a valid protobuf request for {method}")


class MalformedRequestInterceptor(grpc.ServerInterceptor):
    """Bytes that do not parse as the method's request message get INVALID_ARGUMENT naming the
    method (through serve.errors.to_status), not gRPC's generic INTERNAL "Exception deserializing"."""

    def __init__(self) -> None:
        # method -> (its handler, the wrapped one): built once per method, not once per call (this runs
        # on every request's hot path)
        self._wrapped: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        method = handler_call_details.method
        cached = self._wrapped.get(method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        wrapped = self._wrap(handler, method)
        self._wrapped[method] = (handler, wrapped)  # registered methods only: a bounded set
        return wrapped

    @staticmethod
    def _wrap(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        from serve.errors import to_status

        status = to_status(malformed(method))
        deserialize = _tolerant(handler.request_deserializer)
        if not handler.request_streaming:
            behaviour = handler.unary_unary or handler.unary_stream

            def unary(request, context):
                if request is MALFORMED:
                    context.abort(*status)
                return behaviour(request, context)

            factory = (grpc.unary_unary_rpc_method_handler if handler.unary_unary
                       else grpc.unary_stream_rpc_method_handler)
            return factory(unary, deserialize, handler.response_serializer)
        behaviour = handler.stream_unary or handler.stream_stream

        def stream(request_iterator, context):
            def requests():
                for request in request_iterator:
                    if request is MALFORMED:
                        context.abort(*status)
                    yield request

            return behaviour(requests(), context)

        factory = (grpc.stream_unary_rpc_method_handler if handler.stream_unary
                   else grpc.stream_stream_rpc_method_handler)
        return factory(stream, deserialize, handler.response_serializer)


def interceptors(config: ServerConfig) -> list[grpc.ServerInterceptor]:
    """The token check (when configured) runs first, so unauthenticated bytes are never parsed."""
    token = [TokenAuthInterceptor(config.auth_token)] if config.auth_token else []
    return [*token, MalformedRequestInterceptor()]
