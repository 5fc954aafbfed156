"""The encode verb: rows through the model, answered as per-token hidden states, pooled embeddings or the
model's head output, under the mask each call chooses. encoder.v1's Encode and EncodeStream, KServe v2's
ModelInfer (gRPC and REST) and TEI's /embed_all run it; the embed verb (embed.py) is its pooled-only form.

What a request leaves unset is the model's (declared here, once): pooling "" is the export's default
pooling, normalize None the export's default normalisation, mask kind None the model's natural mask
(resolved by the core, serve/core/requests.py to_rows). A model with a head (its task is not embed) answers
its head's raw output (`scores`) and, when asked, its hidden states; never a pooled embedding.
`dimensions` (Matryoshka) keeps the first N values of each embedding, re-normalised when the request
normalises (sentence-transformers' truncate_dim before normalize_embeddings). `encodings` asks for the
pooled embeddings in output encodings too (serve/core/encodings.py: int8, uint8, binary, ubinary), made
last, from the embeddings as answered (after `dimensions`): a model with a head has no embedding to encode,
and int8 / uint8 need normalised embeddings (their fixed range is [-1, 1]).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from serve.core import encodings as encoding_rules
from serve.core.pooling import FROM_HIDDEN, check_dimensions, pool_chunks, resolve_pooling, truncate_dimensions
from serve.core.requests import EncodeResult, MaskChoice, Work
from serve.core.tasks import DESCRIBED, Pending
from serve.core.tasks.inputs import Inputs, text_rows
from serve.errors import ValidationError


@dataclass(frozen=True, slots=True)
class EncodeTask:
    inputs: Inputs
    mask: MaskChoice = MaskChoice()
    hidden_states: bool = False
    pooling: str = ""  # "": the model's default; "none": no embedding (serve/core/pooling.py pooling_name)
    normalize: bool | None = None  # None: the model's default
    dimensions: int | None = None  # Matryoshka: the first N values of each embedding; None: all
    chunk: bool = False  # texts: a long text as overlapping windows, pooled back into one mean embedding
    request_id: str = ""
    encodings: tuple[str, ...] = ()  # output encodings of the pooled embeddings (serve/core/encodings.py);
    #                                  (): float only, the embeddings as they are
    encoding_field: str = "encoding"  # what errors name it: the protocol's field


def submit(engine, task: EncodeTask, deadline: float | None = None, *, embedding: bool = False) -> Pending:
    """Checks `task` against the model, admits its rows; the Pending's result is an EncodeResult (its embeddings
    cut to `dimensions`, a chunked text's windows pooled back). `embedding`: the caller needs a pooled
    embedding (the embed verb): a "none" default pooling means mean."""
    if engine.task != "embed":
        if task.pooling in ("mean", *FROM_HIDDEN) or embedding:
            raise ValidationError(
                f"pooling: model {engine.name!r} is {DESCRIBED[engine.task]}; it answers its head's output "
                f"(scores), not pooled embeddings: ask for pooling none (or leave it unset)")
        if task.dimensions is not None:
            raise ValidationError(f"dimensions: model {engine.name!r} is {DESCRIBED[engine.task]}; it answers its "
                                  f"head's output (scores), which has no dimensions to cut")
        pooling, normalize, scores = "none", False, True
        quantized = [name for name in task.encodings if name in encoding_rules.QUANTIZED]
        if quantized:
            raise ValidationError(
                f"{task.encoding_field}: {quantized[0]} encodes a pooled embedding; model {engine.name!r} is "
                f"{DESCRIBED[engine.task]} and answers its head's output (scores): ask for float")
    else:
        pooling = resolve_pooling(task.pooling, engine.export.default_pooling, embedding=embedding)
        if task.dimensions is not None:
            if pooling == "none":
                raise ValidationError("dimensions: no pooled embedding is asked for (pooling none) to cut")
            check_dimensions(task.dimensions, engine.embedding_width)
        normalize = engine.export.default_normalize if task.normalize is None else task.normalize
        scores = False
        check_encodings(task, pooling, normalize)
    inputs = task.inputs
    if inputs.texts:
        rows = text_rows(engine, inputs, chunk=task.chunk, one_mean=not task.hidden_states and pooling == "mean")
        work = Work(rows.sequences, task.mask, task.hidden_states, pooling, normalize, scores, task.request_id,
                    truncated=rows.truncated, chunks=rows.chunks)
    else:
        work = Work(inputs.sequences, task.mask, task.hidden_states, pooling, normalize, scores, task.request_id,
                    inputs.lengths)
    ticket = engine.submit(work, deadline)
    if not work.chunks and task.dimensions is None and not task.encodings:
        return Pending(ticket)  # the core's result is the verb's
    return Pending(ticket, lambda result: finish(result, work, task.dimensions, task.encodings))


def check_encodings(task: EncodeTask, pooling: str, normalize: bool) -> None:
    """The output encodings fit an embed model's request: a pooled embedding to encode, and for int8 / uint8
    normalised embeddings (serve/core/encodings.py: their range is fixed at [-1, 1])."""
    quantized = [name for name in task.encodings if name in encoding_rules.QUANTIZED]
    if quantized and pooling == "none":
        raise ValidationError(f"{task.encoding_field}: {quantized[0]} encodes a pooled embedding, and none is "
                              "asked for (pooling none)")
    scalar = [name for name in task.encodings if name in encoding_rules.SCALAR]
    if scalar and not normalize:
        low, high = encoding_rules.RANGE
        raise ValidationError(
            f"{task.encoding_field}: {scalar[0]} quantizes each value on the fixed range [{low:g}, {high:g}], "
            f"which only normalised embeddings fit; these are not normalised (normalize false, or the model's "
            f"default): ask for normalised embeddings, or for binary or ubinary")


def finish(result: EncodeResult, work: Work, dimensions: int | None,
           encodings: tuple[str, ...] = ()) -> EncodeResult:
    """The core's result as the verb answers it: chunked texts pooled per text, embeddings cut to `dimensions`,
    then encoded in each of `encodings`."""
    if work.chunks:
        result = pool_chunks(result, work)
    if dimensions is not None and result.embeddings is not None:
        result = dataclasses.replace(
            result, embeddings=truncate_dimensions(result.embeddings, dimensions, work.normalize))
    if encodings and result.embeddings is not None:
        result = dataclasses.replace(
            result, encoded={name: encoding_rules.encode(result.embeddings, name) for name in encodings})
    return result
