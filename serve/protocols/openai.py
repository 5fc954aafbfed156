"""OpenAI's embeddings API (`POST /v1/embeddings`, `GET /v1/models`): JSON <-> the core's request types.

The shape of https://platform.openai.com/docs/api-reference/embeddings, which the `openai` client,
LangChain's and LlamaIndex's OpenAI embedding classes, infinity, TEI and vLLM speak:

  request   model            the served model's name (another: 404)
            input            a string, a list of strings (the export's tokenizer: texts), a list of
                             token ids, or a list of token-id lists
            encoding_format  "float" (default) | "base64" (little-endian float32, as OpenAI's)
            dimensions       Matryoshka: keep the first N values (of d_model, or of the projection's
                             output), then re-normalise
            user             ignored
   ours:    pooling ("mean" | "first" | "last"), normalize (default: the export's), truncate, chunk (texts, as
            Encode's), mask ({"kind", "window", "step", "causal"}, as Encode's MaskChoice)
  response  {"object": "list", "data": [{"object": "embedding", "index", "embedding"}], "model",
             "usage": {"prompt_tokens", "total_tokens"}} (tokens each input ran with)

Fields this API does not know are ignored, as OpenAI-compatible servers do. Every check of the
request's content is the core's (serve/core/); errors become OpenAI error objects with the HTTP status
serve/errors.py maps them to (the transport writes them: serve/transport/http.py).
"""

from __future__ import annotations

import base64
import json
from typing import Callable

import numpy as np
import orjson

from model.mask_kinds import MaskKind
from serve.core.engine import Engine
from serve.core.metrics import Metrics
from serve.core.pooling import check_dimensions, truncate_dimensions
from serve.core.requests import EncodeRequest, MaskChoice
from serve.errors import ValidationError, quote
from serve.protocols import http_tasks
from serve.protocols.edge import Call, start_call

EMBEDDINGS = "POST /v1/embeddings"
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               413: "invalid_request_error", 429: "rate_limit_error"}
MODELS = "GET /v1/models"


def _field(body: dict, name: str, kinds: tuple, default=None, what: str = ""):
    value = body.get(name, default)
    if value is None or (isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds)):
        return value
    raise ValidationError(f"{name}: expected {what or ' or '.join(k.__name__ for k in kinds)}, got {quote(value)}")


def inputs_of(value, field: str = "input") -> tuple[tuple[str, ...], tuple[np.ndarray, ...]]:
    """`input` as (texts, token-id sequences): exactly one of them is non-empty."""
    if isinstance(value, str):
        return (value,), ()
    if not isinstance(value, list) or not value:
        raise ValidationError(f"{field}: expected a string, a list of strings, a list of token ids or a list of "
                              f"token-id lists, got {quote(value) if not isinstance(value, list) else 'an empty list'}")
    if all(isinstance(v, str) for v in value):
        return tuple(value), ()
    if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        value = [value]  # one token-id list
    sequences = []
    for i, ids in enumerate(value):
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ValidationError(f"{field}[{i}]: expected a string or a list of integer token ids, got {quote(ids)}; "
                                  "one request holds strings or token ids, not both")
        try:
            sequences.append(np.asarray(ids, np.int64))
        except OverflowError:
            raise ValidationError(f"{field}[{i}]: a token id does not fit in 64 bits") from None
    return (), tuple(sequences)


def _mask(value) -> MaskChoice:
    if value is None:
        return MaskChoice()
    if not isinstance(value, dict):
        raise ValidationError(f"mask: expected an object {{\"kind\", \"window\", \"step\", \"causal\"}}, got {quote(value)}")
    # None: a mask without a kind gets the model's natural mask (resolved by core/requests.py to_rows)
    kind = value.get("kind")
    if kind is not None:
        try:
            kind = MaskKind.parse(kind) if isinstance(kind, str) else MaskKind(kind)
        except (ValueError, TypeError):
            raise ValidationError(f"mask.kind: unknown value {quote(kind)}; expected one of "
                                  f"{', '.join(k.label for k in MaskKind)}") from None
    ints = {name: _field(value, name, (int,), default, "an integer") for name, default in (("window", 0), ("step", 1))}
    causal = _field(value, "causal", (bool,), False, "true or false")
    return MaskChoice(kind, causal, ints["window"], ints["step"])


def request_from_json(body: dict, engine: Engine) -> tuple[EncodeRequest, str, int | None]:
    """(our request, the encoding format, dimensions or None); ValidationError naming the field."""
    if "input" not in body:
        raise ValidationError("input: missing; send a string, a list of strings or token-id lists")
    texts, sequences = inputs_of(body["input"])
    encoding = _field(body, "encoding_format", (str,), "float", "\"float\" or \"base64\"")
    if encoding not in ("float", "base64"):
        raise ValidationError(f"encoding_format: {quote(encoding)} is not \"float\" or \"base64\"")
    dimensions = _field(body, "dimensions", (int,), None, "a positive integer")
    check_dimensions(dimensions, engine.embedding_width)
    pooling = engine.pooling(_field(body, "pooling", (str,), "", "a string"), embedding=True)
    request = EncodeRequest(
        sequences=sequences, texts=texts, mask=_mask(body.get("mask")), pooling=pooling,
        normalize=_field(body, "normalize", (bool,), None, "true or false"),
        truncate=_field(body, "truncate", (bool,), False, "true or false"),
        chunk=_field(body, "chunk", (bool,), False, "true or false"),
    )
    return request, encoding, dimensions


def response_json(result, name: str, encoding: str, dimensions: int | None) -> bytes:
    vectors = truncate_dimensions(np.asarray(result.embeddings, np.float32), dimensions, normalize=True)
    vectors = np.ascontiguousarray(vectors, "<f4")
    data = [{"object": "embedding", "index": i,
             "embedding": base64.b64encode(vector.tobytes()).decode() if encoding == "base64" else vector}
            for i, vector in enumerate(vectors)]
    tokens = int(sum(result.token_counts))
    # orjson writes a float32 array natively, each value in the shortest form that reads back to the
    # same float32 (exact, and about half json's bytes); json.dumps of .tolist() took 13 ms for 32 x 384
    return orjson.dumps({"object": "list", "data": data, "model": name,
                         "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}, option=orjson.OPT_SERIALIZE_NUMPY)


def error_body(status: int, message: str) -> bytes:
    """OpenAI's error object, which its clients raise from (every non-/v2 HTTP answer's error shape)."""
    return orjson.dumps({"error": {"message": message, "type": ERROR_TYPES.get(status, "server_error"),
                                   "param": None, "code": status}})


def model_name(body: dict) -> str:
    """The request's `model` ("" when absent: the only or default model; admission resolves it)."""
    return _field(body, "model", (str,), "", "a string")


def _created(engine: Engine) -> int:
    metadata = engine.export.metadata
    return int(metadata.created_unix) if hasattr(metadata, "created_unix") else 0


class OpenAIService:
    def __init__(self, engine: Callable[..., Engine], metrics: Metrics | None,
                 engines: Callable[[], dict[str, Engine]]) -> None:
        # engine(context, model=name): admits the call (serve/core/admission.py), Unavailable unless
        # serving, NotFound naming the served models; engines(): the served models by name
        self._engine = engine
        self._engines = engines
        self._metrics = metrics

    def start_embeddings(self, rpc, body: dict) -> None:
        """POST /v1/embeddings, started: admitted, checked and queued; answered from its batch."""
        asked = {}  # the encoding and dimensions the answer takes

        def submit():
            engine = self._engine(rpc, model=model_name(body))
            engine.check("embed", rpc.method, http_tasks.OPERATIONS)
            request, asked["encoding"], asked["dimensions"] = request_from_json(body, engine)
            return engine, engine.submit(request, rpc.deadline)

        start_call(self._metrics, "openai.Embeddings", rpc, submit,
                   lambda engine, result, call: response_json(result, engine.name, asked["encoding"],
                                                              asked["dimensions"]))

    def models(self, rpc, body) -> None:
        """GET /v1/models: every served model, in OpenAI's list shape."""
        call = Call(self._metrics, "openai.Models", rpc)
        try:
            self._engine(model=None)  # Unavailable unless serving
        except Exception as error:
            call.answer(error)
            return
        data = [{"id": name, "object": "model", "created": _created(engine), "owned_by": "onnx-encoder-service"}
                for name, engine in sorted(self._engines().items())]
        call.answer(None, json.dumps({"object": "list", "data": data}).encode())
