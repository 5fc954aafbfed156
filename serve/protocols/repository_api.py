"""Triton's model repository extension, as tritonclient sends it, over gRPC and REST; and the same
three calls for encoder.v1.AdminService (serve/protocols/admin.py). The one place where a request
to the repository (serve/assembly/repository.py) is checked, run, counted and answered:

  gRPC inference.GRPCInferenceService   REST (KServe v2, serve/protocols/kserve_rest.py)   answer
  RepositoryIndex{ready}                POST /v2/repository/index  {"ready": bool}        every model:
                                                                                          name, version,
                                                                                          state, reason
  RepositoryModelLoad{model_name}       POST /v2/repository/models/{name}/load            {} (REST)
  RepositoryModelUnload{model_name}     POST /v2/repository/models/{name}/unload          {} (REST)

State is Triton's: READY, UNAVAILABLE (with the reason: "not loaded", "unloaded", or why its load
was refused), LOADING, UNLOADING. `ready: true` lists the READY ones only. Load reloads a model that
is served (the hot swap); errors are the repository's ServeErrors, mapped once at the edge (`Call`):
NOT_FOUND (no such folder / not loaded), FAILED_PRECONDITION (the export failed a check; a
one-export server, --export-dir, which loads and unloads nothing), RESOURCE_EXHAUSTED (past
--memory-budget-mb; also another load or unload in progress), UNAVAILABLE (shutting down).

What this server does not do is refused, never ignored: a repository_name (it has one repository:
UNIMPLEMENTED), load's `config` and `file:...` overrides (UNIMPLEMENTED: it loads the folder as it
is), any other parameter but unload's `unload_dependents` (INVALID_ARGUMENT; no model here depends
on another, so that one changes nothing).

Every call goes through the shared edge (serve/protocols/edge.py `Call`: metrics as
`v2.RepositoryIndex` etc., status). gRPC calls run on the Router's worker threads; REST ones on this
module's few threads, never on the HTTP transport's event loop (a load takes seconds, and an unload
waits for the model's admitted calls, which that loop answers). The repository itself is below the
protocols (serve/core/model_index.py `Repository`; serve/assembly/repository.py implements it).
"""

from __future__ import annotations

import threading
from concurrent import futures

import grpc
import orjson

from serve import logs
from serve.core.engine import Reloaded
from serve.core.model_index import READY, IndexEntry, Repository
from serve.errors import Unsupported, ValidationError, quote
from serve.protocols import fields
from serve.protocols import kserve_v2 as kserve
from serve.protocols.edge import Api, Call, answer_now
from serve.protocols.routing import HttpCall, Route

INDEX, LOAD, UNLOAD = "RepositoryIndex", "RepositoryModelLoad", "RepositoryModelUnload"
UNLOAD_PARAMETERS = {"unload_dependents": (bool, "true or false")}  # accepted; no model depends on another
REST_THREADS = 4  # REST repository calls at once (a second load or unload is refused at once anyway)


def entry_json(entry: IndexEntry) -> dict:
    return {"name": entry.name, "version": entry.version, "state": entry.state, "reason": entry.reason}


def _check_repository(what: str, repository_name: str) -> None:
    if repository_name:
        raise Unsupported(f"{what}: repository_name {quote(repository_name)}: this server has one model "
                          "repository (--model-repository); send repository_name empty")


def _check_parameters(what: str, parameters: dict, known: dict[str, tuple[type, str]]) -> None:
    for key in parameters:
        if key == "config" or key.startswith("file:"):
            raise Unsupported(f"{what}: parameters[{quote(key)}]: loading with an override config or files is "
                              "not supported; the model is loaded from its repository folder as it is")
        if key not in known:
            takes = f"it takes {', '.join(known)}" if known else "it takes none"
            raise ValidationError(f"{what}: parameters: unknown parameter {quote(key)}; {takes}")
        kind, what_fits = known[key]
        fields.value(parameters, key, (kind,), what=what_fits, field=f"{what}: parameters[{quote(key)}]")


# -- the calls, protocol-free (the admin service's too) -------------------------------------------

def index(repository: Repository, ready: bool = False, repository_name: str = "") -> list[IndexEntry]:
    """Every model of the repository with its state; `ready`: the READY ones only."""
    _check_repository("index", repository_name)
    entries = repository.index()
    return [e for e in entries if e.state == READY] if ready else entries


def load(repository: Repository, model: str, parameters: dict | None = None, repository_name: str = "") -> Reloaded:
    """Loads `model` from the repository, or reloads it when it is served."""
    _check_repository("load", repository_name)
    _check_parameters("load", parameters or {}, {})
    return repository.load(model)


def unload(repository: Repository, model: str, parameters: dict | None = None, repository_name: str = "") -> None:
    """Stops serving `model` once every call admitted to it is answered."""
    _check_repository("unload", repository_name)
    _check_parameters("unload", parameters or {}, UNLOAD_PARAMETERS)
    repository.unload(model)


# -- gRPC: inference.GRPCInferenceService ----------------------------------------------------------

class RepositoryServicer:
    def __init__(self, api: Api) -> None:
        self._api = api

    def RepositoryIndex(self, request, context):
        with Call(self._api.metrics, f"v2.{INDEX}", context):
            Model = kserve.M["RepositoryIndexResponse"].ModelIndex
            entries = index(self._api.repository, request.ready, request.repository_name)
            return kserve.M["RepositoryIndexResponse"](
                models=[Model(name=e.name, version=e.version, state=e.state, reason=e.reason) for e in entries])

    def RepositoryModelLoad(self, request, context):
        with Call(self._api.metrics, f"v2.{LOAD}", context):
            load(self._api.repository, request.model_name, fields.parameter_values(request.parameters),
                 request.repository_name)
            return kserve.M["RepositoryModelLoadResponse"]()

    def RepositoryModelUnload(self, request, context):
        with Call(self._api.metrics, f"v2.{UNLOAD}", context):
            unload(self._api.repository, request.model_name, fields.parameter_values(request.parameters),
                   request.repository_name)
            return kserve.M["RepositoryModelUnloadResponse"]()


def add_repository_to_server(api: Api, server) -> None:
    """Registers RepositoryIndex, RepositoryModelLoad and RepositoryModelUnload of
    `inference.GRPCInferenceService` (serve/transport/rpc.py Registry)."""
    servicer = RepositoryServicer(api)
    handlers = {
        method: grpc.unary_unary_rpc_method_handler(
            getattr(servicer, method),
            request_deserializer=kserve.M[f"{method}Request"].FromString,
            response_serializer=kserve.M[f"{method}Response"].SerializeToString,
        )
        for method in (INDEX, LOAD, UNLOAD)
    }
    server.add_registered_method_handlers(kserve.SERVICE, handlers)


# -- REST: POST /v2/repository/... ------------------------------------------------------------------

_pool: futures.ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _in_pool(api: Api, rpc, name: str, run) -> None:
    """Answers `run()`'s JSON from this module's threads (module docstring)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = futures.ThreadPoolExecutor(max_workers=REST_THREADS, thread_name_prefix="repository",
                                               initializer=logs.name_thread, initargs=("repository",))

    _pool.submit(answer_now, api, f"v2.{name}", rpc, lambda: orjson.dumps(run()))


def _parameters(body: dict) -> dict:
    return fields.object_of(body.get("parameters"), "parameters")


def index_rest(api: Api, rpc, call: HttpCall) -> None:
    """Every model of the repository with its state (`ready`: the READY ones)."""
    def run():
        return [entry_json(e) for e in index(api.repository, fields.flag(call.body, "ready"))]

    _in_pool(api, rpc, INDEX, run)


def load_rest(api: Api, rpc, call: HttpCall) -> None:
    """Loads the model (reloads it when served)."""
    def run():
        load(api.repository, call.params["model"], _parameters(call.body))
        return {}  # as Triton: 200 and nothing to say

    _in_pool(api, rpc, LOAD, run)


def unload_rest(api: Api, rpc, call: HttpCall) -> None:
    """Unloads the model once its admitted calls are answered."""
    def run():
        unload(api.repository, call.params["model"], _parameters(call.body))
        return {}

    _in_pool(api, rpc, UNLOAD, run)


ROUTES = (  # KServe v2 REST's (serve/protocols/kserve_rest.py FAMILY)
    Route("POST", "/v2/repository/index", index_rest, body="json_optional"),
    Route("POST", "/v2/repository/models/{model}/load", load_rest, body="json_optional"),
    Route("POST", "/v2/repository/models/{model}/unload", unload_rest, body="json_optional"),
)
