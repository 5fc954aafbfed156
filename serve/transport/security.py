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


def tls_material(config: ServerConfig) -> tuple[bytes, bytes, bytes] | None:
    """(key, cert, client CA or b"") PEMs from the config, or None for plaintext. Raises BackendError
    naming the file."""
    if not config.tls_cert:
        return None
    cert = _read_pem(config.tls_cert, "tls_cert")
    key = _read_pem(config.tls_key, "tls_key")
    if b"-----BEGIN" not in cert or b"-----BEGIN" not in key:
        raise BackendError("tls_cert / tls_key must be PEM files (-----BEGIN ...)")
    ca = _read_pem(config.tls_client_ca, "tls_client_ca") if config.tls_client_ca else b""
    return key, cert, ca


def server_credentials(material: tuple[bytes, bytes, bytes] | None) -> grpc.ServerCredentials | None:
    """grpcio's credentials for `tls_material`'s PEMs (None: plaintext)."""
    if material is None:
        return None
    key, cert, ca = material
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca or None, require_client_auth=bool(ca))


DENIED = "missing or wrong bearer token: send metadata 'authorization: Bearer <token>'"


class TokenCheck:
    """The bearer-token rule (module docstring), for every transport and protocol."""

    def __init__(self, token: str) -> None:
        if not token:
            raise ValueError("TokenCheck needs a non-empty token")
        self._expected = f"Bearer {token}".encode()

    def allowed(self, method: str, metadata) -> bool:
        if method.startswith(HEALTH_PREFIX):
            return True
        for key, value in metadata or ():
            if key == AUTH_HEADER:
                got = value.encode() if isinstance(value, str) else bytes(value)
                return hmac.compare_digest(got, self._expected)
        return False


def malformed(method: str):
    """The error for bytes that do not parse as `method`'s request (serve/transport/rpc.py Router)."""
    from serve.errors import ValidationError

    return ValidationError(f"request: the bytes are not a valid protobuf request for {method}")
