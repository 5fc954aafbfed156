"""What an HTTP route is, and the router over a table of them (the table itself: serve/protocols/routes.py).

A route family (a vendor's API) is a `Family`: its name, its error body (the shape its clients read errors
in) and its `Route`s, each (method, path, handler, the task verb it runs). A handler is
`handler(api, rpc, call)`: it answers through `rpc` (serve/transport/rpc.py), from `call` (`HttpCall`: the
parsed body, the path's parameters, the headers, and the table's route -> verb map for a refusal that names
the routes fitting a model).

Paths: a `{name}` segment matches any one segment (`{model}`, `{version}`), handed over in
`HttpCall.params`. Any path may also be called on one model as /models/<name>/<path> (TEI's clients name no
model: their base URL can), /models/<name> alone being POST /.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

from serve.errors import ValidationError, clip
from serve.protocols import fields
from serve.protocols.edge import Api, json_object

MODEL_PREFIX = "/models/"  # /models/<name>/<path>: <path> on model <name>


@dataclass(frozen=True)
class HttpCall:
    """One HTTP request as a handler gets it."""

    body: object  # a JSON route's object (the path's model merged in), a raw route's bytes, else None
    params: Mapping[str, str]  # the path's {name} segments, and "model" from /models/<name>/
    headers: Sequence[tuple[str, str]] = ()
    verbs: Mapping[str, str] = field(default_factory=dict)  # the table's route -> task verb

    @property
    def model(self) -> str:
        """The model the request names: in its path, else its JSON body's `model` ("": the default)."""
        if "model" in self.params:
            return self.params["model"]
        if isinstance(self.body, dict):
            return fields.model(self.body)
        return ""

    def header(self, name: str) -> str | None:
        return next((v for k, v in self.headers if k == name), None)


Handler = Callable[[Api, object, HttpCall], None]  # (api, rpc, call): answers through rpc


@dataclass(frozen=True)
class Route:
    method: str  # GET | POST
    path: str
    handler: Handler
    verb: str | None = None  # the task verb it runs (serve/core/tasks/ SERVES); None: no model task
    body: str = "json"  # "json": a JSON object; "json_optional": the same or nothing ({}); "raw": the bytes as
    #                     sent; "none": no body is read
    open: bool = False  # answered without the bearer token (health, as gRPC health)
    summary: str = ""  # the listing's line (default: the handler's docstring's first line)

    @property
    def key(self) -> str:
        return f"{self.method} {self.path}"


@dataclass(frozen=True)
class Family:
    name: str  # whose API: the listing's tag
    error_body: Callable[[int, str], bytes]  # (HTTP status, message) -> the body its clients read
    routes: tuple[Route, ...] = ()


@dataclass(frozen=True)
class Match:
    """What the router makes of a request's method and path: its route and parameters, or the refusal."""

    route: Route | None
    params: dict
    error_body: Callable[[int, str], bytes]
    status: int = 200  # 404 (no such path) or 405 (the path takes other methods) when route is None
    message: str = ""

    @property
    def reads_body(self) -> bool:
        return self.route is not None and self.route.body != "none"

    @property
    def open(self) -> bool:
        return self.route is not None and self.route.open


class HttpRoutes:
    """The router of a table of families: the HTTP transport's one view of the protocols. `unmatched`:
    (path prefix, family) whose error body a path of no route gets, the first that fits."""

    def __init__(self, api: Api, families: Sequence[Family], unmatched: Sequence[tuple[str, Family]]) -> None:
        self._api = api
        self._family: dict[str, Family] = {}
        self._exact: dict[str, Route] = {}
        self._templates: list[tuple[Route, list[str]]] = []
        for family in families:
            for route in family.routes:
                if route.key in self._family:
                    raise RuntimeError(f"route table: {route.key} is declared twice")
                self._family[route.key] = family
                if "{" in route.path:
                    self._templates.append((route, route.path.strip("/").split("/")))
                else:
                    self._exact[route.key] = route
        self._by_path = {route.path: route for route in self._exact.values()}
        self._unmatched = tuple(unmatched)
        self.fallback_error_body = self._unmatched[-1][1].error_body  # a refusal of no path (the connection cap)
        # route -> the task verb it runs: what a refused task call names as the routes that fit its model
        self.verbs = {route.key: route.verb for family in families for route in family.routes
                      if route.verb is not None}

    def match(self, method: str, path: str) -> Match:
        params: dict = {}
        if path.startswith(MODEL_PREFIX):
            name, _, rest = path[len(MODEL_PREFIX):].partition("/")
            if name:
                path, params = f"/{rest}", {"model": name}
        route = self._exact.get(f"{method} {path}")
        if route is not None:
            return Match(route, params, self._family[route.key].error_body)
        parts = path.strip("/").split("/")
        other = self._by_path.get(path)
        for candidate, pattern in self._templates:
            found = _fits(pattern, parts)
            if found is None:
                continue
            if candidate.method == method:
                return Match(candidate, {**params, **found}, self._family[candidate.key].error_body)
            other = other or candidate
        if other is not None:
            return Match(None, params, self._family[other.key].error_body, 405, f"{method} {path}: method not allowed")
        body = next(family.error_body for prefix, family in self._unmatched if path.startswith(prefix))
        return Match(None, params, body, 404, f"{method} {path}: no such endpoint")

    def call(self, match: Match, rpc, body: bytes, headers: Sequence[tuple[str, str]] = ()) -> None:
        """Runs the matched route's handler (a JSON route's body parsed, the path's model merged in); a
        ServeError raised before the handler answers is the caller's to answer."""
        route = match.route
        payload: object = None
        if route.body in ("json", "json_optional"):
            doc = {} if route.body == "json_optional" and not body.strip() else json_object(body)
            payload = _with_model(doc, match.params.get("model"))
        elif route.body == "raw":
            payload = body
        route.handler(self._api, rpc, HttpCall(payload, match.params, headers, self.verbs))


def _fits(pattern: list[str], parts: list[str]) -> dict | None:
    if len(pattern) != len(parts):
        return None
    found = {}
    for want, got in zip(pattern, parts):
        if want.startswith("{"):
            if not got:
                return None
            found[want[1:-1]] = got
        elif want != got:
            return None
    return found


def _with_model(body: dict, model: str | None) -> dict:
    """The body with the model its path names (a body naming another is refused)."""
    if model is None:
        return body
    named = body.get("model")
    if named not in (None, "", model):
        raise ValidationError(f"model: the body names {clip(str(named))!r}, the path /models/{clip(model)}/; "
                              "name one model")
    return {**body, "model": model}
