"""Transport security and authentication: TLS / mTLS server credentials, a bearer-token check,
and clean INVALID_ARGUMENT for request bytes that are not valid protobuf.

- TLS: `--tls-cert` + `--tls-key` (PEM) serve TLS; `--tls-client-ca` additionally *requires* a
  client certificate signed by that CA (mTLS). Without them the port is plaintext, which is why the
  default bind address is 127.0.0.1.
- Token: with `--auth-token` (better: the ENCODER_AUTH_TOKEN environment variable, which does not
  show in `ps`), every RPC except `grpc.health.v1.Health/*` must carry the metadata
  `authorization: Bearer <token>` (over HTTP: that header; the scheme in any case); otherwise
  UNAUTHENTICATED (HTTP 401 with `WWW-Authenticate: Bearer`). The comparison is constant-time
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


DENIED = {  # the refusal, in each protocol's words; the rule itself is TokenCheck's alone
    "grpc": "missing or wrong bearer token: send metadata 'authorization: Bearer <token>'",
    "http": "missing or wrong bearer token: send the header 'Authorization: Bearer <token>'",
}
# RFC 6750 section 3: a 401 names the scheme it wants; a token that was sent and is wrong is "invalid_token"
WWW_AUTHENTICATE = {"missing": "Bearer", "invalid": 'Bearer error="invalid_token"'}


class TokenCheck:
    """The bearer-token rule (module docstring), for every transport and protocol: the credentials
    `Bearer <token>`, the scheme matched case-insensitively (RFC 7235 section 2.1: many clients and
    proxies write `bearer`), the token compared in constant time."""

    def __init__(self, token: str) -> None:
        if not token:
            raise ValueError("TokenCheck needs a non-empty token")
        self._expected = token.encode()

    def refusal(self, method: str, metadata) -> str | None:
        """None when the call may go on; else why not: "missing" (no authorization sent) or "invalid"."""
        if method.startswith(HEALTH_PREFIX):
            return None
        for key, value in metadata or ():
            if key == AUTH_HEADER:
                got = value.encode() if isinstance(value, str) else bytes(value)
                scheme, _, credentials = got.strip().partition(b" ")
                if scheme.lower() != b"bearer":
                    return "invalid"
                return None if hmac.compare_digest(credentials.strip(), self._expected) else "invalid"
        return "missing"

    def allowed(self, method: str, metadata) -> bool:
        return self.refusal(method, metadata) is None


def malformed(method: str):
    """The error for bytes that do not parse as `method`'s request (serve/transport/rpc.py Router)."""
    from serve.errors import ValidationError

    return ValidationError(f"request: the bytes are not a valid protobuf request for {method}")
