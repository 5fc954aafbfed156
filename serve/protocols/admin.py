"""`encoder.v1.AdminService` (`--admin`): protobuf <-> the server's hot swap, nothing more.

ReloadModel calls `EncoderServer.reload` (serve/assembly/app.py), which builds, checks and swaps in the new
model or refuses it (the old one keeps serving); deadline, metrics and status are the shared edge's
(serve/protocols/edge.py), as for Encode and KServe v2. SIGHUP reloads without this service.
"""

from __future__ import annotations

from typing import Callable

import grpc

from serve.protocols.edge import Call
from serve.core.engine import Reloaded
from serve.core.metrics import Metrics
from serve.protocols.pb import admin_pb, admin_pb_grpc

ADMIN_SERVICE_NAME = admin_pb.DESCRIPTOR.services_by_name["AdminService"].full_name  # "encoder.v1.AdminService"


class AdminServicer(admin_pb_grpc.AdminServiceServicer):
    def __init__(self, reload: Callable[[str, str], Reloaded], metrics: Metrics | None) -> None:
        # reload(export_dir, graph): EncoderServer.reload; "" keeps the served one
        self._reload = reload
        self._metrics = metrics

    def ReloadModel(self, request, context):
        with Call(self._metrics, "ReloadModel", context):
            done = self._reload(request.export_dir, request.graph)
            return admin_pb.ReloadModelResponse(
                previous_sha256=done.previous_sha256, sha256=done.sha256, model_name=done.model_name,
                model_version=done.model_version, load_seconds=done.load_seconds,
            )


def add_admin_to_server(reload: Callable[[str, str], Reloaded], metrics: Metrics | None,
                        server: grpc.Server) -> None:
    """Registers `encoder.v1.AdminService` on `server` (before server.start())."""
    admin_pb_grpc.add_AdminServiceServicer_to_server(AdminServicer(reload, metrics), server)
