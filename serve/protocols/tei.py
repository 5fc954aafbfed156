"""Hugging Face text-embeddings-inference's HTTP API, in the shapes its clients send and read
(huggingface_hub's InferenceClient, LlamaIndex's TextEmbeddingsInference, Haystack's TEI embedders
and ranker, LangChain's HuggingFaceEndpointEmbeddings):

  POST /embed         {inputs: str | [str] | [ids] | [[ids]], normalize=true, truncate, truncation_direction,
                       prompt_name, dimensions}                                -> [[float]]
  POST /embed_all     {inputs, truncate, truncation_direction, prompt_name}    -> [[[float]]] (per token)
  POST /embed_sparse  {inputs, truncate, truncation_direction, prompt_name}    -> [[{index, value}]]
  POST /rerank        {query, texts, raw_scores, return_text, truncate, truncation_direction}
                                                      -> [{index, score, text?}], highest score first
                      (a body with `documents` instead of `texts` is infinity's /rerank: serve/protocols/rerank_api.py)
  POST /predict       {inputs: str | [str, str] | [[str] | [str, str], ...], raw_scores, truncate,
                       truncation_direction}           -> [{label, score}] (one input) or [[{label, score}]]
  POST /tokenize      {inputs: str | [str], add_special_tokens=true, prompt_name}
                                                      -> [[{id, text, special, start, stop}]]
  POST /decode        {ids: [int] | [[int]], skip_special_tokens=true}   -> [str]
  GET  /info          the model's id, sha, dtype, type ({embedding: {pooling}}, {classifier | reranker:
                      {id2label, label2id}}) and the server's limits
  POST /              what the model's task answers (TEI's dispatch): embed, embed_sparse, predict,
                      or rerank (a body with `query`)

TEI serves one model; here a body may name its model (`model`), else the default model answers. A
route that does not fit the model's task is refused (400) naming the task and the routes that fit
(serve/core/tasks.py). Errors are TEI's body {"error": message, "error_type": ...} with this
server's status for each error kind (serve/protocols/status.py), the same as every protocol's.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import orjson

from serve.core import tasks
from serve.core.engine import Engine
from serve.core.pooling import check_dimensions, truncate_dimensions
from serve.core.requests import EncodeRequest
from serve.errors import ValidationError, quote
from serve.protocols.edge import Call
from serve.protocols.http_tasks import TaskRoutes, field, flag, model_name
from serve.protocols.openai import inputs_of

ERROR_TYPES = {400: "Validation", 404: "Validation", 413: "Validation", 422: "Validation", 429: "Overloaded",
               503: "Unhealthy"}
# TEI's own routes (the transport's route keys), and the paths whose errors take TEI's body
ROUTE_PATHS = ("/embed", "/embed_all", "/embed_sparse", "/rerank", "/predict", "/tokenize", "/decode", "/info", "/")
_JSON = orjson.OPT_SERIALIZE_NUMPY


def error_body(status: int, message: str) -> bytes:
    """TEI's error object: {"error": message, "error_type": ...}."""
    return orjson.dumps({"error": message, "error_type": ERROR_TYPES.get(status, "Backend")})


def _inputs(body: dict) -> tuple[tuple[str, ...], tuple[np.ndarray, ...]]:
    if "inputs" not in body:
        raise ValidationError("inputs: missing; send a string, a list of strings or token-id lists")
    return inputs_of(body["inputs"], "inputs")


def _text_options(body: dict, engine: Engine) -> dict:
    """The text fields every embedding route takes, as the core's request fields."""
    return dict(truncate=flag(body, "truncate"), prompt_name=field(body, "prompt_name", (str,), None, "a string"),
                truncation_direction=tasks.truncation_direction(body.get("truncation_direction")))


def _predict_inputs(value) -> tuple[bool, tuple[str, ...], tuple[tuple[str, str], ...]]:
    """TEI's predict inputs as (one input?, texts, pairs): a string; [a] or [a, b] (one text or pair);
    or a batch [[a] | [a, b], ...] of texts or of pairs."""
    def sequence(item, where: str):
        if not isinstance(item, list) or not 1 <= len(item) <= 2 or not all(isinstance(t, str) for t in item):
            raise ValidationError(f"{where}: expected [text] or [text, text_pair], got {quote(item)}")
        return item
    if isinstance(value, str):
        return True, tasks.texts_of(value, "inputs"), ()
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        items, single = [sequence(value, "inputs")], True
    elif isinstance(value, list) and value:
        items, single = [sequence(v, f"inputs[{i}]") for i, v in enumerate(value)], False
    else:
        raise ValidationError(f"inputs: expected a string, a pair [text, text_pair] or a batch of them, got "
                              f"{quote(value) if not isinstance(value, list) else 'an empty list'}")
    kinds = {len(item) for item in items}
    if kinds == {1}:
        return single, tasks.texts_of([item[0] for item in items], "inputs"), ()
    if kinds == {2}:
        return single, (), tuple((a, b) for a, b in items)
    raise ValidationError("inputs: a batch holds single texts or text pairs, not both; send them in two requests")


class TEIService(TaskRoutes):
    def __init__(self, engine: Callable[..., Engine], metrics, lookup: Callable[[str], Engine], rerank_api) -> None:
        super().__init__(engine, metrics)
        self._lookup = lookup  # name -> the engine serving it, without admitting (the root's dispatch)
        self._rerank_api = rerank_api  # infinity's /rerank shares the path

    def routes(self) -> dict:
        return {"POST /embed": self.embed, "POST /embed_all": self.embed_all, "POST /embed_sparse": self.embed_sparse,
                "POST /rerank": self.rerank, "POST /predict": self.predict, "POST /tokenize": self.tokenize,
                "POST /decode": self.decode, "GET /info": self.info, "POST /": self.root}

    def embed(self, rpc, body: dict, route: str | None = None) -> None:
        asked = {}

        def build(engine: Engine) -> EncodeRequest:
            texts, sequences = _inputs(body)
            asked["dimensions"] = field(body, "dimensions", (int,), None, "a positive integer")
            check_dimensions(asked["dimensions"], engine.embedding_width)
            asked["normalize"] = flag(body, "normalize", True)
            return EncodeRequest(sequences=sequences, texts=texts, pooling=engine.pooling("", embedding=True),
                                 normalize=asked["normalize"], **_text_options(body, engine))

        def render(engine: Engine, result) -> bytes:
            vectors = truncate_dimensions(result.embeddings, asked["dimensions"], asked["normalize"])
            return orjson.dumps(vectors, option=_JSON)

        self.start(rpc, body, "tei.Embed", build, render, route)

    def embed_all(self, rpc, body: dict) -> None:
        def build(engine: Engine) -> EncodeRequest:
            texts, sequences = _inputs(body)
            return EncodeRequest(sequences=sequences, texts=texts, hidden_states=True, pooling="none",
                                 **_text_options(body, engine))

        self.start(rpc, body, "tei.EmbedAll", build,
                   lambda engine, result: orjson.dumps([out.hidden_states for out in result.outputs], option=_JSON))

    def embed_sparse(self, rpc, body: dict, route: str | None = None) -> None:
        def build(engine: Engine) -> EncodeRequest:
            texts, sequences = _inputs(body)
            return EncodeRequest(sequences=sequences, texts=texts, **_text_options(body, engine))

        def render(engine: Engine, result) -> bytes:
            return orjson.dumps([[{"index": i, "value": v} for i, v in zip(index.tolist(), values.tolist())]
                                 for index, values in tasks.sparse_rows(result.scores)])

        self.start(rpc, body, "tei.EmbedSparse", build, render, route)

    def rerank(self, rpc, body: dict, route: str | None = None) -> None:
        if "documents" in body and "texts" not in body:  # infinity's /rerank, on the same path
            self._rerank_api.infinity_rerank(rpc, body, route)
            return
        asked = {}

        def build(engine: Engine) -> EncodeRequest:
            query = tasks.query(body.get("query"))
            asked["texts"] = tasks.documents(body.get("texts"), "texts")
            engine.limits.check_count(len(asked["texts"]), "texts")
            return EncodeRequest(sequences=(), pairs=tuple((query, t) for t in asked["texts"]),
                                 pair_fields=("query", "texts[{i}]"), **_pair_options(body))

        def render(engine: Engine, result) -> bytes:
            scores = engine.scores(result, flag(body, "raw_scores"))[:, 0]
            text = flag(body, "return_text")
            return orjson.dumps([{"index": i, "score": float(scores[i]), **({"text": asked["texts"][i]} if text else {})}
                                 for i in tasks.ranking(scores).tolist()])

        self.start(rpc, body, "tei.Rerank", build, render, route)

    def predict(self, rpc, body: dict, route: str | None = None) -> None:
        asked = {}

        def build(engine: Engine) -> EncodeRequest:
            if "inputs" not in body:
                raise ValidationError("inputs: missing; send a text, a pair [text, text_pair] or a batch of them")
            asked["single"], texts, pairs = _predict_inputs(body["inputs"])
            asked["hub"] = _hub_parameters(body)
            if pairs:
                return EncodeRequest(sequences=(), pairs=pairs, pair_fields=("inputs[{i}][0]", "inputs[{i}][1]"),
                                     **_pair_options(body))
            return EncodeRequest(sequences=(), texts=texts, **_text_options(body, engine))

        def render(engine: Engine, result) -> bytes:
            top_k, function = asked["hub"] or (None, None)
            scores = engine.scores(result, flag(body, "raw_scores"), function)
            ranked = [[{"score": score, "label": label} for label, score in row][:top_k]
                      for row in tasks.predictions(scores, engine.labels)]
            # TEI answers one input with one list; the Inference API's shape is always a batch
            return orjson.dumps(ranked[0] if asked["single"] and asked["hub"] is None else ranked)

        self.start(rpc, body, "tei.Predict", build, render, route)

    def tokenize(self, rpc, body: dict) -> None:
        call = Call(self._metrics, "tei.Tokenize", rpc)
        try:
            engine = self._engine(rpc, model=model_name(body))
            texts = tasks.texts_of(body.get("inputs"), "inputs")
            engine.limits.check_count(len(texts), "inputs")
            tokens = engine.tokenize(texts, flag(body, "add_special_tokens", True),
                                     field(body, "prompt_name", (str,), None, "a string"))
            payload = orjson.dumps(tokens)
        except Exception as error:
            call.answer(error)
            return
        call.answer(None, payload)

    def decode(self, rpc, body: dict) -> None:
        call = Call(self._metrics, "tei.Decode", rpc)
        try:
            engine = self._engine(rpc, model=model_name(body))
            ids = body.get("ids")
            if isinstance(ids, list) and ids and all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                ids = [ids]
            if not isinstance(ids, list) or not ids or not all(
                    isinstance(row, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in row)
                    for row in ids):
                raise ValidationError(f"ids: expected a list of token ids or a list of token-id lists, got {quote(ids)}")
            engine.limits.check_count(len(ids), "ids")
            payload = orjson.dumps(engine.decode(ids, flag(body, "skip_special_tokens", True)))
        except Exception as error:
            call.answer(error)
            return
        call.answer(None, payload)

    def info(self, rpc, body) -> None:
        call = Call(self._metrics, "tei.Info", rpc)
        try:
            engine = self._lookup(model_name(body) if isinstance(body, dict) else "")
            d = engine.describe()
            if d.task in ("rerank", "classify"):
                labels = {str(i): label for i, label in enumerate(engine.labels)}
                kind = {"reranker" if d.task == "rerank" else "classifier":
                        {"id2label": labels, "label2id": {v: int(k) for k, v in labels.items()}}}
            else:
                pooling = "splade" if d.task == "sparse" else \
                    {"first": "cls", "last": "last_token"}.get(d.default_pooling, d.default_pooling)
                kind = {"embedding": {"pooling": pooling}}
            payload = orjson.dumps({
                "model_id": d.name, "model_sha": d.sha256, "model_dtype": "float32", "served_model_name": d.name,
                "model_type": kind, "max_concurrent_requests": engine.server.max_queue_size,
                "max_input_length": d.limits["max_text_tokens"] or d.limits["max_sequence_length"],
                "max_batch_tokens": d.limits["max_batch_tokens"], "max_batch_requests": d.limits["max_batch_size"],
                "max_client_batch_size": d.limits["max_sequences_per_request"], "auto_truncate": False,
                "tokenization_workers": 1, "version": d.version, "sha": None, "docker_label": None,
                "prompts": d.prompts, "default_prompt_name": d.default_prompt_name or None})
        except Exception as error:
            call.answer(error)
            return
        call.answer(None, payload)

    def root(self, rpc, body: dict) -> None:
        """POST /: what the model's task answers, as TEI dispatches it."""
        try:
            task = self._lookup(model_name(body)).task
        except Exception as error:
            Call(self._metrics, "tei.Root", rpc).answer(error)
            return
        if task == "sparse":
            self.embed_sparse(rpc, body, "POST /embed_sparse")
        elif task == "rerank" and "query" in body:
            self.rerank(rpc, body, "POST /rerank")
        elif task in ("rerank", "classify"):
            self.predict(rpc, body, "POST /predict")
        else:
            self.embed(rpc, body, "POST /embed")


def _hub_parameters(body: dict) -> tuple[int | None, str | None] | None:
    """The Hugging Face Inference API's `parameters` (huggingface_hub's text_classification sends them):
    (top_k, function_to_apply), or None when the body is TEI's own shape."""
    parameters = body.get("parameters")
    if parameters is None:
        return None
    if not isinstance(parameters, dict):
        raise ValidationError(f"parameters: expected an object, got {quote(parameters)}")
    top_k = field(parameters, "top_k", (int,), None, "a positive integer")
    if top_k is not None and top_k < 1:
        raise ValidationError(f"parameters.top_k: expected a positive integer, got {top_k}")
    function = field(parameters, "function_to_apply", (str,), None, "a string")
    if function is not None and function not in tasks.ACTIVATIONS:
        raise ValidationError(f"parameters.function_to_apply: {quote(function)} is not one of "
                              f"{', '.join(tasks.ACTIVATIONS)}")
    return top_k, function


def _pair_options(body: dict) -> dict:
    """A pair request's truncation (only the second text is cut)."""
    return dict(truncate=flag(body, "truncate"),
                truncation_direction=tasks.truncation_direction(body.get("truncation_direction")))
