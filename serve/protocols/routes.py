"""The one HTTP route table: the route families this server speaks, one line each.

Each family is one adapter module declaring its `FAMILY` (serve/protocols/routing.py: its name, its error
body and its routes, each with the task verb it runs). From this table, and nothing else, come:
  - the HTTP router (`router(api)`: serve/protocols/routing.py HttpRoutes): the transport hands it every
    request's method and path and knows no path itself; a path of no route is 404, a known path with
    another method 405, each in the error body of the family the path belongs to (`UNMATCHED`: KServe v2's
    for /v2/..., else OpenAI's, the shape most HTTP clients here read);
  - the listing, GET /openapi.json (an OpenAPI 3.1 document of every route, tagged by family);
  - the "routes that fit this model" of a refused task call (the router's `verbs`: route -> the task verb
    it runs, serve/core/tasks/).
A route cannot be half-registered: it is one entry of its family, and every view above is derived; a
(method, path) given twice is refused when the router is built.

Adding a route family: write its adapter module with a FAMILY, and add one line to FAMILIES.
"""

from __future__ import annotations

import orjson

from serve.protocols import cohere, health, infinity, kserve_rest, openai, tei
from serve.protocols.edge import Api, answer_now
from serve.protocols.routing import Family, HttpCall, HttpRoutes, Route


def listing(api: Api, rpc, call: HttpCall) -> None:
    """This server's HTTP routes (OpenAPI 3.1, without schemas), by family."""
    answer_now(api, "listing.OpenAPI", rpc, lambda: LISTING)


FAMILIES: tuple[Family, ...] = (
    health.FAMILY,
    openai.FAMILY,
    tei.FAMILY,
    cohere.FAMILY,
    infinity.FAMILY,
    kserve_rest.FAMILY,
    Family("listing", openai.error_body, (Route("GET", "/openapi.json", listing, body="none"),)),
)
ROUTES: tuple[Route, ...] = tuple(route for family in FAMILIES for route in family.routes)
UNMATCHED = (("/v2", kserve_rest.FAMILY), ("", openai.FAMILY))


def router(api: Api) -> HttpRoutes:
    return HttpRoutes(api, FAMILIES, UNMATCHED)


def _openapi() -> bytes:
    paths: dict[str, dict] = {}
    for family in FAMILIES:
        for route in family.routes:
            summary = route.summary or (route.handler.__doc__ or "").strip().split("\n")[0]
            entry = {"tags": [family.name], "summary": summary,
                     "operationId": f"{family.name}.{route.handler.__name__.strip('_')}"}
            if route.verb is not None:
                entry["x-task-verb"] = route.verb
            if route.open:
                entry["security"] = []
            paths.setdefault(route.path, {})[route.method.lower()] = entry
    return orjson.dumps({"openapi": "3.1.0", "info": {"title": "onnx-encoder-service", "version": "1"},
                         "tags": [{"name": family.name} for family in FAMILIES], "paths": paths})


LISTING = _openapi()
