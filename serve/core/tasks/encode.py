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
from serve.core.tasks import DESCRIBED, Pending, m3, multivector
from serve.core.tasks.inputs import Inputs, check_untemplated, non_empty, present, text_rows
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
    dimensions_field: str = "dimensions"  # the same, for dimensions
    is_query: bool = False  # a multivector model: the texts are queries (expanded), else documents
    maxsim_query: str | None = None  # a multivector model: each text (a document) scored by MaxSim against it


def submit(engine, task: EncodeTask, deadline: float | None = None, *, embedding: bool = False) -> Pending:
    """Checks `task` against the model, admits its rows; the Pending's result is an EncodeResult (its embeddings
    cut to `dimensions`, a chunked text's windows pooled back). `embedding`: the caller needs a pooled
    embedding (the embed verb): a "none" default pooling means mean."""
    if engine.task == "multivector":
        return _token_vectors(engine, task, deadline, embedding)
    if engine.task == "m3":
        return _m3(engine, task, deadline, embedding)
    for name in ("is_query", "maxsim_query"):
        if getattr(task, name) not in (False, None):
            raise ValidationError(f"{name}: model {engine.name!r} is {DESCRIBED[engine.task]} (task {engine.task!r}); "
                                  f"only a late-interaction (ColBERT) model (task 'multivector') has queries, "
                                  f"documents and MaxSim")
    if engine.task != "embed":
        if task.pooling in ("mean", *FROM_HIDDEN) or embedding:
            raise ValidationError(
                f"pooling: model {engine.name!r} is {DESCRIBED[engine.task]}; it answers its head's output "
                f"(scores), not pooled embeddings: ask for pooling none (or leave it unset)")
        if task.dimensions is not None:
            raise ValidationError(f"{task.dimensions_field}: model {engine.name!r} is {DESCRIBED[engine.task]}; it "
                                  f"answers its head's output (scores), which has no dimensions to cut")
        pooling, normalize, scores = "none", False, True
        no_quantized(task, f"; model {engine.name!r} is {DESCRIBED[engine.task]} and answers its head's output "
                           f"(scores): ask for float")
    else:
        pooling = resolve_pooling(task.pooling, engine.export.default_pooling, embedding=embedding)
        check_pooled_dimensions(task, pooling, engine.embedding_width)
        normalize = engine.export.default_normalize if task.normalize is None else task.normalize
        scores = False
        check_encodings(task, pooling, normalize)
    inputs = task.inputs
    if inputs.texts:
        if scores:  # its head's output of each text as it is: an LLM reranker's texts need its template
            check_untemplated(engine, "texts")
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


def check_pooled_dimensions(task: EncodeTask, pooling: str, width: int) -> None:
    """`dimensions` cuts a pooled embedding (none asked: refused) of `width` values."""
    if task.dimensions is not None:
        if pooling == "none":
            raise ValidationError(f"{task.dimensions_field}: no pooled embedding is asked for (pooling none) to cut")
        check_dimensions(task.dimensions, width, task.dimensions_field)


def no_quantized(task: EncodeTask, why: str) -> None:
    """A quantized encoding (int8, uint8, binary, ubinary) is of a pooled embedding: refused where there is none,
    naming the request's encoding field; `why` ends the message."""
    quantized = [name for name in task.encodings if name in encoding_rules.QUANTIZED]
    if quantized:
        raise ValidationError(f"{task.encoding_field}: {quantized[0]} encodes a pooled embedding{why}")


def check_encodings(task: EncodeTask, pooling: str, normalize: bool) -> None:
    """The output encodings fit an embed model's request: a pooled embedding to encode, and for int8 / uint8
    normalised embeddings (serve/core/encodings.py: their range is fixed at [-1, 1])."""
    if pooling == "none":
        no_quantized(task, ", and none is asked for (pooling none)")
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
    return encoded(result, encodings)


def encoded(result: EncodeResult, encodings: tuple[str, ...]) -> EncodeResult:
    """The result with its pooled embeddings in each of `encodings` (none asked, or no embeddings: as it is)."""
    if encodings and result.embeddings is not None:
        result = dataclasses.replace(
            result, encoded={name: encoding_rules.encode(result.embeddings, name) for name in encodings})
    return result


def _token_vectors(engine, task: EncodeTask, deadline: float | None, embedding: bool) -> Pending:
    """A multivector model's answer: each text's token vectors as its hidden states (multivector.py)."""
    if embedding or task.pooling not in ("", "none") or task.dimensions is not None or task.chunk:
        raise ValidationError(f"pooling: model {engine.name!r} is {DESCRIBED['multivector']}; it answers one vector "
                              f"per token (hidden states), not a pooled embedding: leave pooling, dimensions and "
                              f"chunk unset")
    if not task.inputs.texts:
        raise ValidationError(f"sequences: model {engine.name!r} is {DESCRIBED['multivector']}; send texts (its "
                              f"queries and documents get their markers and expansion from its tokenizer)")
    if task.mask.kind is not None or task.mask.custom is not None:
        raise ValidationError(f"mask: model {engine.name!r} is {DESCRIBED['multivector']}; its queries and documents "
                              f"attend as the model was trained to: send no mask")
    no_quantized(task, f"; model {engine.name!r} is {DESCRIBED['multivector']} and answers token vectors: ask for "
                       f"float")
    if task.maxsim_query is None:
        if not task.hidden_states:
            raise ValidationError(f"hidden_states: model {engine.name!r} is {DESCRIBED['multivector']}; ask for its "
                                  f"token vectors (hidden_states) or for MaxSim scores against a query (maxsim_query)")
        return multivector.submit(engine, task.inputs.texts, task.is_query, task.inputs.text, task.request_id,
                                  deadline)
    if task.is_query:
        raise ValidationError("is_query: with maxsim_query the texts are the documents; leave is_query unset")
    present(task.maxsim_query, "maxsim_query")

    def finish(scores, documents: EncodeResult) -> EncodeResult:  # the scores as each row's one `scores` value
        return dataclasses.replace(documents, scores=scores[:, None],
                                   hidden_states=documents.hidden_states if task.hidden_states else None)

    return multivector.rank(engine, task.maxsim_query, non_empty(task.inputs.texts, "texts"), task.inputs.text,
                            task.request_id, "texts", deadline, finish)


def _m3(engine, task: EncodeTask, deadline: float | None, embedding: bool) -> Pending:
    """bge-m3 (m3.py): its dense embedding as the pooled embedding (pooling first, the model's default), its
    ColBERT vectors as the hidden states."""
    described = f"model {engine.name!r} is {DESCRIBED['m3']}"
    m3.texts_only(engine, task.inputs)
    if task.mask.kind is not None or task.mask.custom is not None or task.chunk:
        raise ValidationError(f"mask: {described}; it is encoded as trained: send no mask, no chunk")
    if task.normalize is False:
        raise ValidationError(f"normalize: {described}; its dense embedding is L2-normalised in its graph")
    pooling = resolve_pooling(task.pooling, engine.export.default_pooling, embedding=embedding)
    if pooling not in ("none", "first"):
        raise ValidationError(f"pooling: {described}; its dense embedding is its first token's (pooling first)")
    check_pooled_dimensions(task, pooling, engine.embedding_width)
    check_encodings(task, pooling, True)
    rows = text_rows(engine, task.inputs)
    work = Work(rows.sequences, request_id=task.request_id, truncated=rows.truncated)

    def answer(engine, result: EncodeResult, sequences) -> EncodeResult:
        out = m3.colbert(engine, result, sequences) if task.hidden_states else \
            dataclasses.replace(result, hidden_states=None)
        if pooling == "first":
            dense = m3.dense(engine, result, sequences).embeddings
            if task.dimensions is not None:
                dense = truncate_dimensions(dense, task.dimensions, True)
            out = encoded(dataclasses.replace(out, embeddings=dense), task.encodings)
        return out

    return m3.submit(engine, work, answer, deadline)
