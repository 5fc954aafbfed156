"""OpenAI's embeddings API (`POST /v1/embeddings`, `GET /v1/models`): its JSON <-> the embed verb
(serve/core/tasks/embed.py).

The shape of https://platform.openai.com/docs/api-reference/embeddings, which the `openai` client,
LangChain's and LlamaIndex's OpenAI embedding classes, infinity, TEI and vLLM speak:

  request   model            the served model's name (another: 404)
            input            a string, a list of strings (the export's tokenizer: texts), a list of
                             token ids, or a list of token-id lists
            encoding_format  "float" (default) | "base64" (little-endian float32, as OpenAI's:
                             serve/core/encodings.py)
            dimensions       Matryoshka: keep the first N values (of d_model, or of the projection's
                             output), re-normalised when normalising
            user             ignored
   ours:    pooling ("mean" | "first" | "last"), normalize (default: the export's), truncate, chunk (texts, as
            Encode's), mask ({"kind", "window", "step", "causal"}, as Encode's)
  response  {"object": "list", "data": [{"object": "embedding", "index", "embedding"}], "model",
             "usage": {"prompt_tokens", "total_tokens"}} (tokens each input ran with)

Fields this API does not know are ignored, as OpenAI-compatible servers do. Every check of the request's
content is the embed verb's; errors become OpenAI's error object (`error_body`, also the body of every
path no route has: serve/protocols/routes.py).
"""

from __future__ import annotations

import orjson

from serve.core import encodings
from serve.core.requests import MaskChoice, mask_choice
from serve.core.pooling import pooling_name
from serve.core.tasks import embed
from serve.core.tasks.inputs import Inputs, TextOptions
from serve.errors import ValidationError, quote
from serve.protocols import fields
from serve.protocols.edge import Api, answer_now, start_task
from serve.protocols.routing import Family, HttpCall, Route

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               413: "invalid_request_error", 429: "rate_limit_error"}
ENCODINGS = ("float", "base64")  # OpenAI's encoding_format (serve/core/encodings.py: the encodings' rules)


def error_body(status: int, message: str) -> bytes:
    """OpenAI's error object, which its clients raise from."""
    return orjson.dumps({"error": {"message": message, "type": ERROR_TYPES.get(status, "server_error"),
                                   "param": None, "code": status}})


def mask_of(value) -> MaskChoice:
    """Our `mask` object ({"kind", "window", "step", "causal"}) as the core's MaskChoice."""
    if value is None:
        return MaskChoice()
    if not isinstance(value, dict):
        raise ValidationError(f"mask: expected an object {{\"kind\", \"window\", \"step\", \"causal\"}}, got {quote(value)}")
    return mask_choice(value.get("kind"), fields.flag(value, "causal", field="mask.causal"),
                       fields.integer(value, "window", 0, field="mask.window"),
                       fields.integer(value, "step", 1, field="mask.step"), field="mask.kind")


def embed_task(body: dict) -> tuple[embed.EmbedTask, str]:
    """(the embed task, the encoding format); ValidationError naming the field."""
    texts, sequences = fields.inputs(body, "input")
    encoding, = encodings.names(fields.string(body, "encoding_format", "float"), "encoding_format", ENCODINGS)
    task = embed.EmbedTask(
        Inputs(texts, sequences, text=TextOptions(truncate=fields.flag(body, "truncate"))),
        pooling=pooling_name(fields.string(body, "pooling", ""), embedding=True),
        normalize=fields.value(body, "normalize", (bool,), None, "true or false"),
        dimensions=fields.integer(body, "dimensions", None, "a positive integer"),
        chunk=fields.flag(body, "chunk"), mask=mask_of(body.get("mask")))
    return task, encoding


def embeddings_json(result, name: str, encoding: str) -> bytes:
    vectors = encodings.encode(result.embeddings, encoding)
    rows = encodings.base64_rows(vectors) if encoding == "base64" else vectors
    data = [{"object": "embedding", "index": i, "embedding": vector} for i, vector in enumerate(rows)]
    tokens = int(sum(result.token_counts))
    # orjson writes a float32 array natively, each value in the shortest form that reads back to the
    # same float32 (exact, and about half json's bytes); json.dumps of .tolist() took 13 ms for 32 x 384
    return orjson.dumps({"object": "list", "data": data, "model": name,
                         "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}, option=orjson.OPT_SERIALIZE_NUMPY)


def embeddings(api: Api, rpc, call: HttpCall) -> None:
    """Embeddings of texts or token ids (OpenAI's shape)."""
    asked = {}

    def submit(engine):
        task, asked["encoding"] = embed_task(call.body)
        return embed.submit(engine, task, rpc.deadline)

    start_task(api, "openai.Embeddings", rpc, call.model, "embed", call.verbs, submit,
               lambda engine, result, _: embeddings_json(result, engine.name, asked["encoding"]))


def _created(engine) -> int:
    metadata = engine.export.metadata
    return int(metadata.created_unix) if hasattr(metadata, "created_unix") else 0


def models(api: Api, rpc, call: HttpCall) -> None:
    """Every served model, in OpenAI's list shape."""
    def work() -> bytes:
        api.admit(model=None)  # Unavailable unless serving
        data = [{"id": name, "object": "model", "created": _created(engine), "owned_by": "onnx-encoder-service"}
                for name, engine in sorted(api.admission.engines().items())]
        return orjson.dumps({"object": "list", "data": data})

    answer_now(api, "openai.Models", rpc, work)


FAMILY = Family("openai", error_body, (
    Route("POST", "/v1/embeddings", embeddings, "embed"),
    Route("POST", "/embeddings", embeddings, "embed"),
    Route("GET", "/v1/models", models, body="none"),
))
