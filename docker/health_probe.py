"""gRPC health probe for containers (grpc_health_probe-like, with grpcio-health-checking).

    python /app/docker/health_probe.py [--addr 127.0.0.1:50051] [--service ""] [--timeout 3]

Exit 0 when grpc.health.v1 reports SERVING, 1 otherwise (NOT_SERVING, unreachable, timeout).
The port defaults to $ENCODER_PORT, the server's own setting. With TLS on (the server's
$ENCODER_TLS_CERT set) the probe speaks TLS: it trusts --tls-ca ($ENCODER_PROBE_TLS_CA, default the
server's own certificate, right for a self-signed one) and, where the server asks for client
certificates (mTLS), presents --tls-cert/--tls-key ($ENCODER_PROBE_TLS_CERT / _KEY).
Health needs no bearer token (the server exempts grpc.health.v1).
"""

from __future__ import annotations

import argparse
import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--addr", default=f"127.0.0.1:{os.environ.get('ENCODER_PORT', '50051')}")
    parser.add_argument("--service", default="", help='"" = the whole server (default)')
    parser.add_argument("--timeout", type=float, default=3.0)
    env = os.environ.get
    parser.add_argument("--tls-ca", default=env("ENCODER_PROBE_TLS_CA") or env("ENCODER_TLS_CERT", ""),
                        help="PEM roots to trust; empty: plaintext")
    parser.add_argument("--tls-cert", default=env("ENCODER_PROBE_TLS_CERT", ""), help="client certificate (mTLS)")
    parser.add_argument("--tls-key", default=env("ENCODER_PROBE_TLS_KEY", ""), help="client key (mTLS)")
    parser.add_argument("--server-name", default=env("ENCODER_PROBE_SERVER_NAME", ""),
                        help="name to check the server certificate against, when not the --addr host")
    args = parser.parse_args(argv)
    try:
        with _channel(args) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout)
    except grpc.RpcError as error:
        print(f"{args.addr}: {error.code().name}: {error.details()}", file=sys.stderr)
        return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{args.addr}: {status}")
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


def _channel(args: argparse.Namespace) -> grpc.Channel:
    if not args.tls_ca:
        return grpc.insecure_channel(args.addr)

    def read(path: str) -> bytes | None:
        with open(path, "rb") as handle:
            return handle.read()

    credentials = grpc.ssl_channel_credentials(
        root_certificates=read(args.tls_ca),
        private_key=read(args.tls_key) if args.tls_key else None,
        certificate_chain=read(args.tls_cert) if args.tls_cert else None,
    )
    options = [("grpc.ssl_target_name_override", args.server_name)] if args.server_name else []
    return grpc.secure_channel(args.addr, credentials, options=options)


if __name__ == "__main__":
    raise SystemExit(main())
