"""The embed verb: one pooled embedding per input (OpenAI's /v1/embeddings, TEI's /embed), the encode verb
(encode.py) asked for embeddings only. Its defaults, declared once: the model's pooling (a model whose
default is none pools by mean: an embedding is what this verb answers), the model's normalisation, no
Matryoshka cut, the model's natural mask, float embeddings only (`encodings`: serve/core/encodings.py, made by
the encode verb). Its result is the core's EncodeResult, `embeddings` [n, D]
(D: `dimensions`, else the model's embedding width).
"""

from __future__ import annotations

from dataclasses import dataclass

from serve.core.requests import MaskChoice
from serve.core.tasks import Pending, encode
from serve.core.tasks.inputs import Inputs


@dataclass(frozen=True, slots=True)
class EmbedTask:
    inputs: Inputs
    pooling: str = ""  # "": the model's default (none: mean); "none" is refused (serve/core/pooling.py)
    normalize: bool | None = None  # None: the model's default
    dimensions: int | None = None  # Matryoshka: the first N values, re-normalised when normalising
    chunk: bool = False  # texts: a long text as overlapping windows, pooled back into one embedding
    mask: MaskChoice = MaskChoice()
    request_id: str = ""
    encodings: tuple[str, ...] = ()  # output encodings (serve/core/encodings.py); (): float only
    encoding_field: str = "encoding"  # what errors name it: the protocol's field
    dimensions_field: str = "dimensions"  # the same, for dimensions


def submit(engine, task: EmbedTask, deadline: float | None = None) -> Pending:
    return encode.submit(engine, encode.EncodeTask(task.inputs, task.mask, False, task.pooling, task.normalize,
                                                   task.dimensions, task.chunk, task.request_id,
                                                   task.encodings, task.encoding_field, task.dimensions_field),
                         deadline, embedding=True)
