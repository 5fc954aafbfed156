"""`encoder.v1.AdminService` (`--admin`): protobuf <-> the server's hot swap, nothing more.

ReloadModel calls `EncoderServer.reload` (serve/assembly/app.py), which builds, checks and swaps in the new
model or refuses it (the old one keeps serving); deadline, metrics and status are the shared edge's
(serve/protocols/edge.py), as for Encode and KServe v2. SIGHUP reloads without this service.
LoadModel, UnloadModel and ListModels are Triton's repository calls (serve/protocols/repository_api.py,
served without --admin over KServe v2 too), in this service's messages.
"""

from __future__ import annotations

from typing import Callable

import grpc

from serve.protocols.edge import Call
from serve.core.engine import Reloaded
from serve.core.metrics import Metrics
from serve.protocols.pb import admin_pb, admin_pb_grpc
from serve.protocols.repository_api import RepositoryApi

ADMIN_SERVICE_NAME = admin_pb.DESCRIPTOR.services_by_name["AdminService"].full_name  # "encoder.v1.AdminService"


class AdminServicer(admin_pb_grpc.AdminServiceServicer):
    def __init__(self, reload: Callable[[str, str, str], Reloaded], metrics: Metrics | None,
                 repository: RepositoryApi) -> None:
        # reload(export_dir, graph, model): EncoderServer.reload; "" keeps the served one
        self._reload = reload
        self._metrics = metrics
        self._repository = repository

    def ReloadModel(self, request, context):
        with Call(self._metrics, "ReloadModel", context):
            return _reloaded(self._reload(request.export_dir, request.graph, request.model))

    def LoadModel(self, request, context):
        with Call(self._metrics, "LoadModel", context):
            return _reloaded(self._repository.load(request.model))

    def UnloadModel(self, request, context):
        with Call(self._metrics, "UnloadModel", context):
            self._repository.unload(request.model)
            return admin_pb.UnloadModelResponse()

    def ListModels(self, request, context):
        with Call(self._metrics, "ListModels", context):
            Model = admin_pb.ListModelsResponse.Model
            return admin_pb.ListModelsResponse(models=[
                Model(name=e.name, version=e.version, state=e.state, reason=e.reason)
                for e in self._repository.index(request.ready)])


def _reloaded(done: Reloaded):
    return admin_pb.ReloadModelResponse(
        previous_sha256=done.previous_sha256, sha256=done.sha256, model_name=done.model_name,
        model_version=done.model_version, load_seconds=done.load_seconds,
    )


def add_admin_to_server(reload: Callable[[str, str, str], Reloaded], metrics: Metrics | None,
                        server: grpc.Server, repository: RepositoryApi) -> None:
    """Registers `encoder.v1.AdminService` on `server` (before server.start())."""
    admin_pb_grpc.add_AdminServiceServicer_to_server(AdminServicer(reload, metrics, repository), server)
