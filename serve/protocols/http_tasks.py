"""What every HTTP task route shares (text-embeddings-inference's, Cohere's and Jina's, infinity's,
OpenAI's): the route table (route -> what it does, serve/core/tasks.py OPERATIONS), so a route that
does not fit a model's task is refused naming the task and every route that does; the reading of
the common body fields; and starting a call on the core (serve/protocols/edge.py `start_call`).
"""

from __future__ import annotations

from typing import Callable

from serve.core.engine import Engine
from serve.core.metrics import Metrics
from serve.core.requests import EncodeRequest
from serve.errors import ValidationError, quote
from serve.protocols.edge import start_call

# Every HTTP route that runs a model -> its operation (serve/core/tasks.py OPERATIONS)
OPERATIONS = {
    "POST /v1/embeddings": "embed", "POST /embeddings": "embed", "POST /embed": "embed",
    "POST /embed_all": "hidden_states", "POST /embed_sparse": "embed_sparse",
    "POST /rerank": "rerank", "POST /v1/rerank": "rerank", "POST /v2/rerank": "rerank",
    "POST /predict": "predict", "POST /classify": "predict",
    "POST /tokenize": "tokenize", "POST /decode": "tokenize",
}


def field(body: dict, name: str, kinds: tuple, default=None, what: str = ""):
    """body[name] (default when absent or null) when one of `kinds` (a bool is not an int), else refused
    naming the field."""
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds):
        return value
    raise ValidationError(f"{name}: expected {what or ' or '.join(k.__name__ for k in kinds)}, got {quote(value)}")


def flag(body: dict, name: str, default: bool = False) -> bool:
    return field(body, name, (bool,), default, "true or false")


def model_name(body: dict) -> str:
    """The body's `model` ("": the only or default model)."""
    return field(body, "model", (str,), "", "a string")


class TaskRoutes:
    """Starts an HTTP task call: admits it on its model, checks the route fits the model's task, builds
    the core's request, and renders the answer from the batch that ran it."""

    def __init__(self, engine: Callable[..., Engine], metrics: Metrics | None) -> None:
        # engine(context, model=name): admits the call (serve/core/admission.py)
        self._engine = engine
        self._metrics = metrics

    def start(self, rpc, body: dict, method: str, build: Callable[[Engine], EncodeRequest],
              render: Callable[[Engine, object], bytes], route: str | None = None) -> None:
        """`build(engine)` makes the request (raising ValidationError naming a field); `render(engine,
        result)` the answer's bytes. The route (`route`, else rpc.method) must fit the model's task."""
        route = route or rpc.method

        def submit():
            engine = self._engine(rpc, model=model_name(body))
            engine.check(OPERATIONS[route], route, OPERATIONS)
            return engine, engine.submit(build(engine), rpc.deadline)

        start_call(self._metrics, method, rpc, submit, lambda engine, result, call: render(engine, result))
