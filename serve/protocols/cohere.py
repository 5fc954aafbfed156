"""Cohere's embed and rerank APIs (v1 and v2: the `cohere` client's embed and rerank; Jina's rerank shares
Cohere's), in the shapes their clients send and read:

  POST /v2/embed, /v1/embed
        {model, texts: [str], input_type (search_document | search_query | classification | clustering),
         embedding_types ([float | int8 | uint8 | binary | ubinary | base64], default [float]),
         truncate (NONE | START | END, default END), max_tokens, output_dimension}
        -> {id, embeddings: {<type>: [one per text]}, texts, meta: {api_version: {version},
            billed_units: {input_tokens}}, response_type: "embeddings_by_type"}
        (v1 without embedding_types: embeddings: [[float]], response_type: "embeddings_floats")

`input_type` picks the model's prompt of that purpose (its sentence-transformers prompts: `INPUT_TYPES`, by
name, any case), else the model's default prompt. The encodings are serve/core/encodings.py's (int8 and
uint8 on the fixed range [-1, 1]: the model's embeddings must be normalised); base64 is the float32
little-endian bytes. `max_tokens` keeps each text to that many tokens (the prompt and special tokens not counted),
cutting from `truncate`'s end, or with NONE refusing a longer text. `images` and `inputs` (mixed content) are not
served: refused naming them.
The rules are the embed verb's (serve/core/tasks/embed.py).

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

from serve.core import encodings
from serve.core.tasks import embed, rerank
from serve.core.tasks.inputs import Inputs, TextOptions, direction
from serve.errors import ValidationError, quote
from serve.protocols import fields
from serve.protocols.edge import Api, start_task
from serve.protocols.routing import Family, HttpCall, Route


# input_type -> the prompt names (any case) that serve it, the first the model has
INPUT_TYPES = {"search_document": ("document", "passage", "corpus"), "search_query": ("query",),
               "classification": ("classification",), "clustering": ("clustering",)}
TRUNCATE = {"NONE": TextOptions(truncate=False), "START": TextOptions(truncate=True, direction="left"),
            "END": TextOptions(truncate=True, direction="right")}  # Cohere's default: END


def error_body(status: int, message: str) -> bytes:
    """Cohere's error object, {"message": ...}."""
    return orjson.dumps({"message": message})


def prompt_name(engine, input_type: str | None) -> str | None:
    """The model's prompt for Cohere's `input_type` (None: the model's default prompt)."""
    if input_type is None:
        return None
    prompts = {name.lower(): name for name in engine.export.metadata.prompts}
    return next((prompts[name] for name in INPUT_TYPES[input_type] if name in prompts), None)


def embed_task(body: dict, engine) -> tuple[embed.EmbedTask, tuple[str, ...], bool]:
    """(the embed task, the embedding types, whether the answer is by type) of a Cohere embed body."""
    for name in ("images", "inputs"):
        if body.get(name) is not None:
            raise ValidationError(f"{name}: this server embeds texts; send them in `texts`")
    texts = body.get("texts")
    if texts is None or isinstance(texts, str):
        raise ValidationError(f"texts: expected a list of strings, got {'none' if texts is None else quote(texts)}")
    input_type = fields.string(body, "input_type")
    if input_type is not None and input_type not in INPUT_TYPES:
        raise ValidationError(f"input_type: {quote(input_type)} is not one of {', '.join(INPUT_TYPES)}")
    truncate = fields.string(body, "truncate", "END")
    if truncate.upper() not in TRUNCATE:
        raise ValidationError(f"truncate: {quote(truncate)} is not one of {', '.join(TRUNCATE)}")
    by_type = body.get("embedding_types") is not None
    types = encodings.names(body["embedding_types"], "embedding_types", listed=True) if by_type else ("float",)
    options = TRUNCATE[truncate.upper()]
    task = embed.EmbedTask(
        Inputs(fields.texts(texts, "texts"), text=TextOptions(
            options.truncate, options.direction, prompt_name(engine, input_type),
            max_tokens=fields.integer(body, "max_tokens", None, "a positive integer"))),
        dimensions=fields.integer(body, "output_dimension", None, "a positive integer"),
        encodings=types, encoding_field="embedding_types", dimensions_field="output_dimension")
    return task, types, by_type


def embed_(api: Api, rpc, call: HttpCall) -> None:
    """Embeddings of texts, by type: float, int8, uint8, binary, ubinary, base64 (Cohere's shape)."""
    v2 = rpc.method.startswith("POST /v2")
    asked = {}

    def submit(engine):
        asked["task"], asked["types"], by_type = embed_task(call.body, engine)
        asked["by_type"] = by_type or v2
        return embed.submit(engine, asked["task"], rpc.deadline)

    def answer(engine, result, _) -> bytes:
        def rows(name):
            return encodings.base64_rows(result.encoded[name]) if name == "base64" else result.encoded[name]

        by_type = asked["by_type"]
        return orjson.dumps({
            "id": str(uuid.uuid4()),
            "embeddings": {name: rows(name) for name in asked["types"]} if by_type else result.encoded["float"],
            "texts": list(asked["task"].inputs.texts),
            "meta": {"api_version": {"version": "2" if v2 else "1"},
                     "billed_units": {"input_tokens": int(sum(result.token_counts))}},
            "response_type": "embeddings_by_type" if by_type else "embeddings_floats"},
            option=orjson.OPT_SERIALIZE_NUMPY)

    start_task(api, "cohere.Embed", rpc, call.model, "embed", call.verbs, submit, answer)


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
    Route("POST", "/v1/embed", embed_, "embed"),
    Route("POST", "/v2/embed", embed_, "embed"),
    Route("POST", "/v1/rerank", rerank_, "rerank"),
    Route("POST", "/v2/rerank", rerank_, "rerank"),
))
