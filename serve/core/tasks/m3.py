"""bge-m3: its dense embedding, lexical weights and ColBERT vectors, taken from the one per-token output its graph
answers (model/heads.py M3Head, read as the hidden states: [B, T, D + 1]), as FlagEmbedding's
BGEM3FlagModel.encode gives them:

  dense     position 0's first D values (the CLS hidden state, L2-normalised in the graph)   the embed verb
  lexical   per token id, its largest weight (column D) over the text's tokens, the task's unused_ids (cls, eos,
            pad, unk) left out, weights > 0 only                                              the sparse verb
  colbert   positions 1 .. length - 1, their first D values (L2-normalised in the graph)   the encode verb

`submit(engine, work, answer)` runs the rows of `work` (texts, made by the calling verb) and answers with
`answer(result, rows)`, one of `dense`, `lexical`, `colbert` below.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from serve.core.requests import EncodeResult, Work
from serve.core.tasks import DESCRIBED, Pending
from serve.core.tasks.inputs import Inputs
from serve.errors import ValidationError


def texts_only(engine, inputs: Inputs) -> None:
    """bge-m3 takes texts (its verbs tokenize them): token ids are refused naming `sequences`."""
    if not inputs.texts:
        raise ValidationError(f"sequences: model {engine.name!r} is {DESCRIBED['m3']}; send texts")


def submit(engine, work: Work, answer, deadline: float | None = None) -> Pending:
    work = dataclasses.replace(work, hidden_states=True, pooling="none", normalize=False, scores=False)
    return Pending(engine.submit(work, deadline), lambda result: answer(engine, result, work.sequences))


def dense(engine, result: EncodeResult, rows) -> EncodeResult:
    """The dense embeddings [n, D] (no hidden states)."""
    d = result.hidden_states.shape[-1] - 1
    return dataclasses.replace(result, embeddings=np.ascontiguousarray(result.hidden_states[:, 0, :d]),
                               hidden_states=None)


def lexical(engine, result: EncodeResult, rows) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per text: the token ids with a weight (ascending) and their largest weight."""
    unused = np.asarray(engine.export.metadata.task["unused_ids"], np.int64)
    out = []
    for ids, tokens in zip(rows, result.hidden_states):
        ids = np.asarray(ids, np.int64)
        weights = tokens[:len(ids), -1]
        keep = (weights > 0) & ~np.isin(ids, unused)
        index, inverse = np.unique(ids[keep], return_inverse=True)
        values = np.zeros(len(index), np.float32)
        np.maximum.at(values, inverse, weights[keep])
        out.append((index, values))
    return out


def colbert(engine, result: EncodeResult, rows) -> EncodeResult:
    """Each text's ColBERT vectors (positions 1 .. length - 1) as its hidden states, token_counts of them."""
    d = result.hidden_states.shape[-1] - 1
    counts = [max(len(ids) - 1, 0) for ids in rows]
    hidden = np.zeros((len(counts), max(counts, default=0), d), np.float32)
    for i, n in enumerate(counts):
        hidden[i, :n] = result.hidden_states[i, 1:1 + n, :d]
    return dataclasses.replace(result, hidden_states=hidden, token_counts=tuple(counts))
