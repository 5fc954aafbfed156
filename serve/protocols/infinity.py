"""infinity's rerank and classify APIs (LangChain's InfinityRerank, infinity's own client), in the shapes
they send and read:

  POST /rerank (a body with `documents`; TEI's /rerank, serve/protocols/tei.py, hands it over)
        {model, query, documents: [str], top_n, return_documents=false, raw_scores=false, truncate=true}
        -> {object: "rerank", id, created, model, results: [{relevance_score, index, document?}],
            usage: {prompt_tokens, total_tokens}}
  POST /classify
        {model, input: [str], raw_scores=false, truncate=true}
        -> {object: "classify", id, created, model, data: [[{score, label}]], usage}

Long texts are cut to fit by default, as infinity does. The rules are the rerank and classify verbs'
(serve/core/tasks/); errors are OpenAI's error object (serve/protocols/openai.py), as infinity's.
"""

from __future__ import annotations

import time
import uuid

import orjson

from serve.core.tasks import classify
from serve.core.tasks.inputs import TextOptions
from serve.protocols import fields, openai
from serve.protocols.cohere import start_rerank
from serve.protocols.edge import Api, start_task
from serve.protocols.routing import Family, HttpCall, Route


def _answer(kind: str, engine, tokens: int, **body) -> bytes:
    return orjson.dumps({"object": kind, "id": str(uuid.uuid4()), "created": int(time.time()), "model": engine.name,
                         **body, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


def rerank_(api: Api, rpc, call: HttpCall, route: str | None = None) -> None:
    """A query against documents, highest score first (infinity's shape)."""
    def answer(engine, result, documents, return_documents: bool) -> bytes:
        results = [{"relevance_score": float(result.scores[i]), "index": i,
                    "document": documents[i] if return_documents else None} for i in result.order.tolist()]
        return _answer("rerank", engine, int(sum(result.run.token_counts)), results=results)

    start_rerank(api, rpc, call, "infinity.Rerank", answer, objects=False, route=route)


def classify_(api: Api, rpc, call: HttpCall) -> None:
    """Each label's score of each text (infinity's shape)."""
    body = call.body

    def submit(engine):
        task = classify.ClassifyTask(fields.texts(body.get("input"), "input"),
                                     text=TextOptions(truncate=fields.flag(body, "truncate", True)),
                                     raw_scores=fields.flag(body, "raw_scores"))
        return classify.submit(engine, task, rpc.deadline)

    def render(engine, result, _) -> bytes:
        data = [[{"score": score, "label": label} for label, score in row] for row in result.ranked]
        return _answer("classify", engine, int(sum(result.run.token_counts)), data=data)

    start_task(api, "infinity.Classify", rpc, call.model, "classify", call.verbs, submit, render)


FAMILY = Family("infinity", openai.error_body, (
    Route("POST", "/classify", classify_, "classify"),
))
