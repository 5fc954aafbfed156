"""`encoder.v1.AdminService` (`--admin`): protobuf <-> the server's hot swap, nothing more.

ReloadModel calls `EncoderServer.reload` (serve/assembly/app.py), which builds, checks and swaps in the new
model or refuses it (the old one keeps serving); deadline, metrics and status are the shared edge's
(serve/protocols/edge.py), as for Encode and KServe v2. SIGHUP reloads without this service.
LoadModel, UnloadModel and ListModels are Triton's repository calls (serve/protocols/repository_api.py,
served without --admin over KServe v2 too), in this service's messages.
"""

from __future__ import annotations

from typing import Callable

from serve.core.engine import Reloaded
from serve.protocols.edge import Api, Call
from serve.protocols.pb import admin_pb, admin_pb_grpc
from serve.protocols import repository_api

ADMIN_SERVICE_NAME = admin_pb.DESCRIPTOR.services_by_name["AdminService"].full_name  # "encoder.v1.AdminService"


class AdminServicer(admin_pb_grpc.AdminServiceServicer):
    def __init__(self, api: Api, reload: Callable[[str, str, str], Reloaded]) -> None:
        # reload(export_dir, graph, model): EncoderServer.reload; "" keeps the served one
        self._api = api
        self._reload = reload

    def ReloadModel(self, request, context):
        with Call(self._api.metrics, "ReloadModel", context):
            return _reloaded(self._reload(request.export_dir, request.graph, request.model))

    def LoadModel(self, request, context):
        with Call(self._api.metrics, "LoadModel", context):
            return _reloaded(repository_api.load(self._api.repository, request.model))

    def UnloadModel(self, request, context):
        with Call(self._api.metrics, "UnloadModel", context):
            repository_api.unload(self._api.repository, request.model)
            return admin_pb.UnloadModelResponse()

    def ListModels(self, request, context):
        with Call(self._api.metrics, "ListModels", context):
            Model = admin_pb.ListModelsResponse.Model
            return admin_pb.ListModelsResponse(models=[
                Model(name=e.name, version=e.version, state=e.state, reason=e.reason)
                for e in repository_api.index(self._api.repository, request.ready)])


def _reloaded(done: Reloaded):
    return admin_pb.ReloadModelResponse(
        previous_sha256=done.previous_sha256, sha256=done.sha256, model_name=done.model_name,
        model_version=done.model_version, load_seconds=done.load_seconds,
    )


def add_admin_to_server(api: Api, reload: Callable[[str, str, str], Reloaded], server) -> None:
    """Registers `encoder.v1.AdminService` on `server` (before server.start())."""
    admin_pb_grpc.add_AdminServiceServicer_to_server(AdminServicer(api, reload), server)
