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
waits for the model's admitted calls, which that loop answers).
"""

from __future__ import annotations

from concurrent import futures

import grpc
import orjson

from serve import logs
from serve.assembly.repository import READY, IndexEntry, ModelRepository
from serve.core.engine import Reloaded
from serve.core.metrics import Metrics
from serve.errors import NotFound, Unsupported, ValidationError, quote
from serve.protocols import kserve_v2 as kserve
from serve.protocols.edge import Call, json_object

INDEX, LOAD, UNLOAD = "RepositoryIndex", "RepositoryModelLoad", "RepositoryModelUnload"
UNLOAD_PARAMETERS = {"unload_dependents": bool}  # accepted, and nothing to do: no model depends on another
REST_THREADS = 4  # REST repository calls at once (a second load or unload is refused at once anyway)


def entry_json(entry: IndexEntry) -> dict:
    return {"name": entry.name, "version": entry.version, "state": entry.state, "reason": entry.reason}


def _check_repository(what: str, repository_name: str) -> None:
    if repository_name:
        raise Unsupported(f"{what}: repository_name {quote(repository_name)}: this server has one model "
                          "repository (--model-repository); send repository_name empty")


def _check_parameters(what: str, parameters: dict, known: dict[str, type]) -> None:
    for key, value in parameters.items():
        if key == "config" or key.startswith("file:"):
            raise Unsupported(f"{what}: parameters[{quote(key)}]: loading with an override config or files is "
                              "not supported; the model is loaded from its repository folder as it is")
        kind = known.get(key)
        if kind is None:
            takes = f"it takes {', '.join(known)}" if known else "it takes none"
            raise ValidationError(f"{what}: parameters: unknown parameter {quote(key)}; {takes}")
        if not isinstance(value, kind):
            raise ValidationError(f"{what}: parameters[{quote(key)}]: {quote(value)} must be a {kind.__name__}")


def _grpc_parameters(parameters) -> dict:
    """A ModelRepositoryParameter map as {key: its value}."""
    out = {}
    for key, value in parameters.items():
        which = value.WhichOneof("parameter_choice")
        out[key] = getattr(value, which) if which is not None else None
    return out


class RepositoryApi:
    """The repository calls, protocol-free (`index`, `load`, `unload`: the admin service's too), and
    their gRPC servicer methods and REST routes (module docstring)."""

    def __init__(self, repository: ModelRepository, metrics: Metrics | None) -> None:
        self._repository = repository
        self._metrics = metrics
        self._rest_pool = futures.ThreadPoolExecutor(max_workers=REST_THREADS, thread_name_prefix="repository",
                                                     initializer=logs.name_thread, initargs=("repository",))

    # -- the calls ---------------------------------------------------------------------------
    def index(self, ready: bool = False, repository_name: str = "") -> list[IndexEntry]:
        """Every model of the repository with its state; `ready`: the READY ones only."""
        _check_repository("index", repository_name)
        entries = self._repository.index()
        return [e for e in entries if e.state == READY] if ready else entries

    def load(self, model: str, parameters: dict | None = None, repository_name: str = "") -> Reloaded:
        """Loads `model` from the repository, or reloads it when it is served."""
        _check_repository("load", repository_name)
        _check_parameters("load", parameters or {}, {})
        return self._repository.load(model)

    def unload(self, model: str, parameters: dict | None = None, repository_name: str = "") -> None:
        """Stops serving `model` once every call admitted to it is answered."""
        _check_repository("unload", repository_name)
        _check_parameters("unload", parameters or {}, UNLOAD_PARAMETERS)
        self._repository.unload(model)

    # -- gRPC: inference.GRPCInferenceService ----------------------------------------------------
    def RepositoryIndex(self, request, context):
        with Call(self._metrics, f"v2.{INDEX}", context):
            Model = kserve.M["RepositoryIndexResponse"].ModelIndex
            entries = self.index(request.ready, request.repository_name)
            return kserve.M["RepositoryIndexResponse"](
                models=[Model(name=e.name, version=e.version, state=e.state, reason=e.reason) for e in entries])

    def RepositoryModelLoad(self, request, context):
        with Call(self._metrics, f"v2.{LOAD}", context):
            self.load(request.model_name, _grpc_parameters(request.parameters), request.repository_name)
            return kserve.M["RepositoryModelLoadResponse"]()

    def RepositoryModelUnload(self, request, context):
        with Call(self._metrics, f"v2.{UNLOAD}", context):
            self.unload(request.model_name, _grpc_parameters(request.parameters), request.repository_name)
            return kserve.M["RepositoryModelUnloadResponse"]()

    # -- REST: /v2/repository/... ----------------------------------------------------------------
    def route(self, rpc, method: str, parts: list[str], body: bytes) -> None:
        """`parts`: the path's parts after "v2" ("repository", ...); answered through `rpc`, from a
        thread of this module's pool."""
        if method == "POST" and parts == ["repository", "index"]:
            name = INDEX

            def run(doc: dict):
                return [entry_json(e) for e in self.index(self._ready(doc))]
        elif method == "POST" and len(parts) == 4 and parts[:2] == ["repository", "models"] and \
                parts[3] in ("load", "unload"):
            model, name = parts[2], LOAD if parts[3] == "load" else UNLOAD
            change = self.load if name == LOAD else self.unload

            def run(doc: dict):
                change(model, self._parameters(doc))
                return {}  # as Triton: 200 and nothing to say
        else:
            raise NotFound(f"{method} /v2/{'/'.join(parts)}: no such endpoint")

        def answer() -> None:
            call = Call(self._metrics, f"v2.{name}", rpc)
            try:
                payload = orjson.dumps(run(json_object(body) if body.strip() else {}))
            except Exception as error:
                call.answer(error)
                return
            call.answer(None, payload)

        self._rest_pool.submit(answer)

    @staticmethod
    def _ready(doc: dict) -> bool:
        ready = doc.get("ready", False)
        if not isinstance(ready, bool):
            raise ValidationError(f"ready: {quote(ready)} must be true or false")
        return ready

    @staticmethod
    def _parameters(doc: dict) -> dict:
        parameters = doc.get("parameters") or {}
        if not isinstance(parameters, dict):
            raise ValidationError("parameters: must be an object")
        return parameters


def add_repository_to_server(repository: ModelRepository, metrics: Metrics | None, server) -> RepositoryApi:
    """Registers RepositoryIndex, RepositoryModelLoad and RepositoryModelUnload of
    `inference.GRPCInferenceService` (serve/transport/rpc.py Registry); returns the API (KServe v2
    REST and the admin service call it too)."""
    api = RepositoryApi(repository, metrics)
    handlers = {
        method: grpc.unary_unary_rpc_method_handler(
            getattr(api, method),
            request_deserializer=kserve.M[f"{method}Request"].FromString,
            response_serializer=kserve.M[f"{method}Response"].SerializeToString,
        )
        for method in (INDEX, LOAD, UNLOAD)
    }
    server.add_registered_method_handlers(kserve.SERVICE, handlers)
    return api
