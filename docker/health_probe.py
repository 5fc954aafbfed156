"""gRPC health probe for containers (grpc_health_probe-like, with grpcio-health-checking).

    python /app/docker/health_probe.py [--addr 127.0.0.1:50051] [--service ""] [--timeout 3]

Exit 0 when grpc.health.v1 reports SERVING, 1 otherwise (NOT_SERVING, unreachable, timeout).
The port defaults to $ENCODER_PORT, the server's own setting.
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
    args = parser.parse_args(argv)
    try:
        with grpc.insecure_channel(args.addr) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout)
    except grpc.RpcError as error:
        print(f"{args.addr}: {error.code().name}: {error.details()}", file=sys.stderr)
        return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{args.addr}: {status}")
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


if __name__ == "__main__":
    raise SystemExit(main())
