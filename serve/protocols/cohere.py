"""Cohere's rerank API (v1 and v2: the `cohere` client's rerank), which Jina's rerank shares, in the shapes
their clients send and read:

  POST /v1/rerank, /v2/rerank
        {model, query, documents: [str | {text}], top_n, return_documents=false, truncate=true,
         max_tokens_per_doc (v2: each document cut to at most this many tokens), raw_scores=false,
         instruction (an LLM reranker's task instruction; ours, not Cohere's)}
        -> {id, results: [{index, relevance_score, document?: {text}}], model, usage: {total_tokens},
            meta: {api_version, billed_units: {search_units: 1}}}

Results are highest score first (equal scores in document order). These services cut long documents to fit
by default (`truncate=true`; only the document is cut, never the query); with `truncate: false` a pair over
the model's length is refused naming the document. The rules are the rerank verb's
(serve/core/tasks/rerank.py); errors are Cohere's body, {"message": ...}.
"""

from __future__ import annotations

import uuid

import orjson

from serve.core.tasks import rerank
from serve.core.tasks.inputs import TextOptions, direction
from serve.protocols import fields
from serve.protocols.edge import Api, start_task
from serve.protocols.routing import Family, HttpCall, Route


def error_body(status: int, message: str) -> bytes:
    """Cohere's error object, {"message": ...}."""
    return orjson.dumps({"message": message})


def rerank_task(body: dict, *, objects: bool, truncate: bool = True) -> rerank.RerankTask:
    """The rerank task of a Cohere-, Jina- or infinity-shaped body (`objects`: documents may be {"text"}
    objects; `truncate`: the vendor's default)."""
    return rerank.RerankTask(
        fields.query(body.get("query")), fields.documents(body.get("documents"), objects=objects),
        TextOptions(truncate=fields.flag(body, "truncate", truncate),
                    direction=direction(body.get("truncation_direction"))),
        top_n=fields.integer(body, "top_n", None, "an integer >= 1"),  # its range: the rerank verb's
        raw_scores=fields.flag(body, "raw_scores"),
        max_tokens_per_doc=fields.integer(body, "max_tokens_per_doc", None, "a positive integer"),
        instruction=fields.string(body, "instruction"))


def start_rerank(api: Api, rpc, call: HttpCall, method: str, answer, *, objects: bool,
                 route: str | None = None) -> None:
    """A rerank in the shape Cohere, Jina and infinity share: `answer(engine, ranking, documents, return_documents)`
    renders the vendor's answer."""
    asked = {}

    def submit(engine):
        asked["task"] = task = rerank_task(call.body, objects=objects)
        asked["return_documents"] = fields.flag(call.body, "return_documents")
        return rerank.submit(engine, task, rpc.deadline)

    start_task(api, method, rpc, call.model, "rerank", call.verbs, submit,
               lambda engine, result, _: answer(engine, result, asked["task"].documents, asked["return_documents"]),
               route)


def rerank_(api: Api, rpc, call: HttpCall) -> None:
    """A query against documents, highest score first (Cohere's and Jina's shape)."""
    def answer(engine, result, documents, return_documents: bool) -> bytes:
        results = [{"index": i, "relevance_score": float(result.scores[i]),
                    **({"document": {"text": documents[i]}} if return_documents else {})}
                   for i in result.order.tolist()]
        return orjson.dumps({"id": str(uuid.uuid4()), "results": results, "model": engine.name,
                             "usage": {"total_tokens": int(sum(result.run.token_counts))},
                             "meta": {"api_version": {"version": "2" if rpc.method.startswith("POST /v2") else "1"},
                                      "billed_units": {"search_units": 1}}})

    start_rerank(api, rpc, call, "cohere.Rerank", answer, objects=True)


FAMILY = Family("cohere", error_body, (
    Route("POST", "/v1/rerank", rerank_, "rerank"),
    Route("POST", "/v2/rerank", rerank_, "rerank"),
))
