"""Hugging Face text-embeddings-inference's HTTP API, in the shapes its clients send and read
(huggingface_hub's InferenceClient, LlamaIndex's TextEmbeddingsInference, Haystack's TEI embedders
and ranker, LangChain's HuggingFaceEndpointEmbeddings):

  POST /embed         {inputs: str | [str] | [ids] | [[ids]], normalize=true, truncate, truncation_direction,
                       prompt_name, dimensions}                                -> [[float]]
  POST /embed_all     {inputs, truncate, truncation_direction, prompt_name}    -> [[[float]]] (per token)
                      (a late-interaction model: its token vectors; ours: is_query=false, true for a query)
  POST /embed_sparse  {inputs, truncate, truncation_direction, prompt_name}    -> [[{index, value}]]
  POST /rerank        {query, texts, raw_scores, return_text, truncate, truncation_direction, instruction (an LLM
                      reranker's task instruction; ours, not TEI's)}
                                                      -> [{index, score, text?}], highest score first
                      (a body with `documents` instead of `texts` is infinity's /rerank: serve/protocols/infinity.py)
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
(serve/core/tasks/). Errors are TEI's body {"error": message, "error_type": ...} with this
server's status for each error kind (serve/protocols/status.py), the same as every protocol's.
"""

from __future__ import annotations

import orjson

from serve.core.tasks import classify, embed, encode, rerank, sparse, tokens
from serve.core.tasks.inputs import Inputs, TextOptions, check_positive, direction
from serve.errors import ValidationError, quote
from serve.protocols import fields, infinity
from serve.protocols.edge import Api, Call, answer_now, start_task
from serve.protocols.routing import Family, HttpCall, Route

ERROR_TYPES = {400: "Validation", 404: "Validation", 413: "Validation", 422: "Validation", 429: "Overloaded",
               503: "Unhealthy"}
_JSON = orjson.OPT_SERIALIZE_NUMPY


def error_body(status: int, message: str) -> bytes:
    """TEI's error object: {"error": message, "error_type": ...}."""
    return orjson.dumps({"error": message, "error_type": ERROR_TYPES.get(status, "Backend")})


def _inputs(body: dict) -> Inputs:
    """`inputs` (texts or token ids) with the text fields every embedding route takes."""
    texts, sequences = fields.inputs(body, "inputs")
    return Inputs(texts, sequences, text=_text_options(body))


def _text_options(body: dict, prompts: bool = True) -> TextOptions:
    return TextOptions(truncate=fields.flag(body, "truncate"), direction=direction(body.get("truncation_direction")),
                       prompt_name=fields.string(body, "prompt_name") if prompts else None)


def _predict_inputs(value) -> tuple[bool, tuple[str, ...], tuple[tuple[str, str], ...]]:
    """TEI's predict inputs as (one input?, texts, pairs): a string; [a] or [a, b] (one text or pair);
    or a batch [[a] | [a, b], ...] of texts or of pairs."""
    def sequence(item, where: str):
        if not isinstance(item, list) or not 1 <= len(item) <= 2 or not all(isinstance(t, str) for t in item):
            raise ValidationError(f"{where}: expected [text] or [text, text_pair], got {quote(item)}")
        return item
    if isinstance(value, str):
        return True, fields.texts(value, "inputs"), ()
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        items, single = [sequence(value, "inputs")], True
    elif isinstance(value, list) and value:
        items, single = [sequence(v, f"inputs[{i}]") for i, v in enumerate(value)], False
    else:
        raise ValidationError(f"inputs: expected a string, a pair [text, text_pair] or a batch of them, got "
                              f"{quote(value) if not isinstance(value, list) else 'an empty list'}")
    kinds = {len(item) for item in items}
    if kinds == {1}:
        return single, fields.texts([item[0] for item in items], "inputs"), ()
    if kinds == {2}:
        return single, (), tuple((a, b) for a, b in items)
    raise ValidationError("inputs: a batch holds single texts or text pairs, not both; send them in two requests")


def _hub_parameters(body: dict) -> tuple[int | None, str | None] | None:
    """The Hugging Face Inference API's `parameters` (huggingface_hub's text_classification sends them):
    (top_k, function_to_apply), or None when the body is TEI's own shape."""
    parameters = body.get("parameters")
    if parameters is None:
        return None
    if not isinstance(parameters, dict):
        raise ValidationError(f"parameters: expected an object, got {quote(parameters)}")
    top_k = fields.integer(parameters, "top_k", None, "a positive integer", field="parameters.top_k")
    check_positive(top_k, "parameters.top_k")
    function = fields.string(parameters, "function_to_apply", field="parameters.function_to_apply")
    return top_k, classify.activation_name(function, "parameters.function_to_apply")


def embed_(api: Api, rpc, call: HttpCall, route: str | None = None) -> None:
    """Pooled embeddings of texts or token ids."""
    body = call.body

    def submit(engine):
        task = embed.EmbedTask(_inputs(body), normalize=fields.flag(body, "normalize", True),
                               dimensions=fields.integer(body, "dimensions", None, "a positive integer"))
        return embed.submit(engine, task, rpc.deadline)

    start_task(api, "tei.Embed", rpc, call.model, "embed", call.verbs, submit,
               lambda engine, result, _: orjson.dumps(result.embeddings, option=_JSON), route)


def embed_all(api: Api, rpc, call: HttpCall) -> None:
    """Per-token hidden states of texts or token ids."""
    def submit(engine):
        task = encode.EncodeTask(_inputs(call.body), hidden_states=True, pooling="none",
                                 is_query=fields.flag(call.body, "is_query"))
        return encode.submit(engine, task, rpc.deadline)

    start_task(api, "tei.EmbedAll", rpc, call.model, "encode", call.verbs, submit,
               lambda engine, result, _: orjson.dumps([out.hidden_states for out in result.outputs], option=_JSON))


def embed_sparse(api: Api, rpc, call: HttpCall, route: str | None = None) -> None:
    """SPLADE weights: each input's non-zero entries."""
    def submit(engine):
        return sparse.submit(engine, sparse.SparseTask(_inputs(call.body)), rpc.deadline)

    def render(engine, result, _) -> bytes:
        return orjson.dumps([[{"index": i, "value": v} for i, v in zip(index.tolist(), values.tolist())]
                             for index, values in result.rows])

    start_task(api, "tei.EmbedSparse", rpc, call.model, "sparse", call.verbs, submit, render, route)


def rerank_(api: Api, rpc, call: HttpCall, route: str | None = None) -> None:
    """A query against texts, highest score first (a body with `documents` is infinity's /rerank)."""
    body = call.body
    if "documents" in body and "texts" not in body:  # infinity's /rerank, on the same path
        infinity.rerank_(api, rpc, call, route)
        return
    asked = {}

    def submit(engine):
        asked["texts"] = fields.documents(body.get("texts"), "texts")
        task = rerank.RerankTask(fields.query(body.get("query")), asked["texts"],
                                 _text_options(body, prompts=False), raw_scores=fields.flag(body, "raw_scores"),
                                 documents_field="texts", instruction=fields.string(body, "instruction"))
        return rerank.submit(engine, task, rpc.deadline)

    def render(engine, result, _) -> bytes:
        text = fields.flag(body, "return_text")
        return orjson.dumps([{"index": i, "score": float(result.scores[i]),
                              **({"text": asked["texts"][i]} if text else {})} for i in result.order.tolist()])

    start_task(api, "tei.Rerank", rpc, call.model, "rerank", call.verbs, submit, render, route)


def predict(api: Api, rpc, call: HttpCall, route: str | None = None) -> None:
    """Each label's score of a text, a pair, or a batch of them."""
    body = call.body
    asked = {}

    def submit(engine):
        if "inputs" not in body:
            raise ValidationError("inputs: missing; send a text, a pair [text, text_pair] or a batch of them")
        asked["single"], texts, pairs = _predict_inputs(body["inputs"])
        asked["hub"] = _hub_parameters(body)
        task = classify.ClassifyTask(texts, pairs, _text_options(body, prompts=not pairs),
                                     raw_scores=fields.flag(body, "raw_scores"),
                                     activation=(asked["hub"] or (None, None))[1],
                                     pair_fields=("inputs[{i}][0]", "inputs[{i}][1]"))
        return classify.submit(engine, task, rpc.deadline)

    def render(engine, result, _) -> bytes:
        top_k = (asked["hub"] or (None, None))[0]
        ranked = [[{"score": score, "label": label} for label, score in row][:top_k] for row in result.ranked]
        # TEI answers one input with one list; the Inference API's shape is always a batch
        return orjson.dumps(ranked[0] if asked["single"] and asked["hub"] is None else ranked)

    start_task(api, "tei.Predict", rpc, call.model, "classify", call.verbs, submit, render, route)


def tokenize(api: Api, rpc, call: HttpCall) -> None:
    """Each text's tokens (id, text, special, start, stop)."""
    body = call.body

    def work() -> bytes:
        engine = api.admit(rpc, model=call.model)
        task = tokens.TokenizeTask(fields.texts(body.get("inputs"), "inputs"),
                                   fields.flag(body, "add_special_tokens", True), fields.string(body, "prompt_name"),
                                   field="inputs")
        return orjson.dumps(tokens.tokenize(engine, task))

    answer_now(api, "tei.Tokenize", rpc, work)


def decode(api: Api, rpc, call: HttpCall) -> None:
    """Token ids back to text."""
    body = call.body

    def work() -> bytes:
        engine = api.admit(rpc, model=call.model)
        task = tokens.DecodeTask(fields.token_ids(body.get("ids"), "ids"), fields.flag(body, "skip_special_tokens", True))
        return orjson.dumps(tokens.decode(engine, task))

    answer_now(api, "tei.Decode", rpc, work)


def info(api: Api, rpc, call: HttpCall) -> None:
    """The model's id, type, labels or pooling, and the server's limits."""
    def work() -> bytes:
        engine = api.engine(call.model)
        d = engine.describe()
        if d.task in ("rerank", "classify"):
            labels = {str(i): label for i, label in enumerate(engine.labels)}
            kind = {"reranker" if d.task == "rerank" else "classifier":
                    {"id2label": labels, "label2id": {v: int(k) for k, v in labels.items()}}}
        else:
            pooling = "splade" if d.task == "sparse" else \
                {"first": "cls", "last": "last_token"}.get(d.default_pooling, d.default_pooling)
            kind = {"embedding": {"pooling": pooling}}
        return orjson.dumps({
            "model_id": d.name, "model_sha": d.sha256, "model_dtype": "float32", "served_model_name": d.name,
            "model_type": kind, "max_concurrent_requests": engine.server.max_queue_size,
            "max_input_length": d.limits["max_text_tokens"] or d.limits["max_sequence_length"],
            "max_batch_tokens": d.limits["max_batch_tokens"], "max_batch_requests": d.limits["max_batch_size"],
            "max_client_batch_size": d.limits["max_sequences_per_request"], "auto_truncate": False,
            "tokenization_workers": 1, "version": d.version, "sha": None, "docker_label": None,
            "prompts": d.prompts, "default_prompt_name": d.default_prompt_name or None,
            "validation": d.validation})  # ours: the export's parity proof per graph (TEI has no such field)

    answer_now(api, "tei.Info", rpc, work)


def root(api: Api, rpc, call: HttpCall) -> None:
    """What the model's task answers, as TEI dispatches it: embed, embed_sparse, rerank (with a query) or predict."""
    try:
        task = api.engine(call.model).task
    except Exception as error:
        Call(api.metrics, "tei.Root", rpc).answer(error)
        return
    if task == "sparse":
        embed_sparse(api, rpc, call, "POST /embed_sparse")
    elif task == "rerank" and "query" in call.body:
        rerank_(api, rpc, call, "POST /rerank")
    elif task in ("rerank", "classify"):
        predict(api, rpc, call, "POST /predict")
    else:
        embed_(api, rpc, call, "POST /embed")


FAMILY = Family("tei", error_body, (
    Route("POST", "/embed", embed_, "embed"),
    Route("POST", "/embed_all", embed_all, "encode"),
    Route("POST", "/embed_sparse", embed_sparse, "sparse"),
    Route("POST", "/rerank", rerank_, "rerank"),
    Route("POST", "/predict", predict, "classify"),
    Route("POST", "/tokenize", tokenize, "tokenize"),
    Route("POST", "/decode", decode, "tokenize"),
    Route("GET", "/info", info, body="none"),
    Route("POST", "/", root),
))
