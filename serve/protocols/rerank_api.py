"""The rerank and classify APIs of Cohere, Jina and infinity, in the shapes their clients send and read:

  POST /v1/rerank, /v2/rerank   Cohere (v1 and v2: the `cohere` client's rerank) and Jina:
        {model, query, documents: [str | {text}], top_n, return_documents=false, truncate=true,
         max_tokens_per_doc (v2: each document cut to at most this many tokens)}
        -> {id, results: [{index, relevance_score, document?: {text}}], model, usage: {total_tokens},
            meta: {api_version, billed_units: {search_units: 1}}}
  POST /rerank (a body with `documents`)   infinity (LangChain's InfinityRerank):
        {model, query, documents: [str], top_n, return_documents=false, raw_scores=false, truncate=true}
        -> {object: "rerank", id, created, model, results: [{relevance_score, index, document?}],
            usage: {prompt_tokens, total_tokens}}
  POST /classify                infinity: {model, input: [str], raw_scores=false}
        -> {object: "classify", id, created, model, data: [[{score, label}]], usage}

Results are highest score first (equal scores in document order). These services cut long documents
to fit by default (`truncate=true`; only the document is cut, never the query); with `truncate:
false` a pair over the model's length is refused naming the document. The rules live in
serve/core/tasks.py; errors are OpenAI's error object (serve/protocols/openai.py), as infinity's.
"""

from __future__ import annotations

import time
import uuid

import orjson

from serve.core import tasks
from serve.core.engine import Engine
from serve.core.requests import EncodeRequest
from serve.errors import ValidationError
from serve.protocols.http_tasks import TaskRoutes, field, flag


def _rerank_request(body: dict, engine: Engine, asked: dict, *, objects: bool) -> EncodeRequest:
    query = tasks.query(body.get("query"))
    documents = tasks.documents(body.get("documents"), objects=objects)
    engine.limits.check_count(len(documents), "documents")
    asked["documents"] = documents
    asked["top_n"] = tasks.top_n_of(body.get("top_n"), len(documents))
    asked["return_documents"] = flag(body, "return_documents")
    cap = field(body, "max_tokens_per_doc", (int,), None, "a positive integer")
    if cap is not None:
        if cap < 1:
            raise ValidationError(f"max_tokens_per_doc: expected a positive integer, got {cap}")
        documents = tuple(engine.text.head(d, cap) if engine.text is not None else d for d in documents)
    return EncodeRequest(sequences=(), pairs=tuple((query, d) for d in documents),
                         pair_fields=("query", "documents[{i}]"), truncate=flag(body, "truncate", True),
                         truncation_direction=tasks.truncation_direction(body.get("truncation_direction")))


class RerankAPIs(TaskRoutes):
    def routes(self) -> dict:
        return {"POST /v1/rerank": self.cohere_rerank, "POST /v2/rerank": self.cohere_rerank,
                "POST /classify": self.infinity_classify}

    def cohere_rerank(self, rpc, body: dict) -> None:
        asked = {}

        def render(engine: Engine, result) -> bytes:
            scores = engine.scores(result, flag(body, "raw_scores"))[:, 0]
            documents = asked["documents"]
            results = [{"index": i, "relevance_score": float(scores[i]),
                        **({"document": {"text": documents[i]}} if asked["return_documents"] else {})}
                       for i in tasks.ranking(scores, asked["top_n"]).tolist()]
            tokens = int(sum(result.token_counts))
            return orjson.dumps({"id": str(uuid.uuid4()), "results": results, "model": engine.name,
                                 "usage": {"total_tokens": tokens},
                                 "meta": {"api_version": {"version": "2" if rpc.method.startswith("POST /v2")
                                                          else "1"},
                                          "billed_units": {"search_units": 1}}})

        self.start(rpc, body, "cohere.Rerank",
                   lambda engine: _rerank_request(body, engine, asked, objects=True), render)

    def infinity_rerank(self, rpc, body: dict, route: str | None = None) -> None:
        asked = {}

        def render(engine: Engine, result) -> bytes:
            scores = engine.scores(result, flag(body, "raw_scores"))[:, 0]
            documents = asked["documents"]
            results = [{"relevance_score": float(scores[i]), "index": i,
                        "document": documents[i] if asked["return_documents"] else None}
                       for i in tasks.ranking(scores, asked["top_n"]).tolist()]
            tokens = int(sum(result.token_counts))
            return orjson.dumps({"object": "rerank", "id": str(uuid.uuid4()), "created": int(time.time()),
                                 "model": engine.name, "results": results,
                                 "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})

        self.start(rpc, body, "infinity.Rerank",
                   lambda engine: _rerank_request(body, engine, asked, objects=False), render, route)

    def infinity_classify(self, rpc, body: dict) -> None:
        def build(engine: Engine) -> EncodeRequest:
            return EncodeRequest(sequences=(), texts=tasks.texts_of(body.get("input"), "input"),
                                 truncate=flag(body, "truncate", True))

        def render(engine: Engine, result) -> bytes:
            ranked = tasks.predictions(engine.scores(result, flag(body, "raw_scores")), engine.labels)
            tokens = int(sum(result.token_counts))
            return orjson.dumps({"object": "classify", "id": str(uuid.uuid4()), "created": int(time.time()),
                                 "model": engine.name,
                                 "data": [[{"score": score, "label": label} for label, score in row] for row in ranked],
                                 "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})

        self.start(rpc, body, "infinity.Classify", build, render)
