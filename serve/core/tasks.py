"""What a model does (its task: metadata.json "task", written by the exporter from the checkpoint's
head) and the rules of the operations on it: the ONE home of them, which every protocol's routes and
methods call (TEI's, Cohere's, Jina's, infinity's, OpenAI's, encoder.v1's, KServe v2's).

  TASKS        embed (a bare encoder: pooled embeddings), rerank (a cross-encoder: one logit per
               query-document pair), classify (a classifier: one logit per label, texts or pairs),
               sparse (SPLADE: one weight per vocabulary entry)
  OPERATIONS   what a route or method does -> the tasks it serves; `check` refuses the rest with a
               message naming the model's task and the routes that fit it (each protocol passes its
               route table: route -> operation)
  activate     logits -> scores with the export's activation (sigmoid | softmax | none), raw on request
  ranking      a rerank's order: by score, highest first, ties in document order; top_n
  predictions  per input, (label, score) highest first
  sparse_rows  a sparse output's non-zero entries per row
  documents / texts_of / truncation_direction / top_n_of
               the shared readings of a request's fields, each naming the field it refuses
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from model.tasks import SCORE_ACTIVATIONS, TASK_KINDS
from serve.errors import ValidationError, quote

TASKS = TASK_KINDS  # model/tasks.py: what an export's metadata.json "task" may say
DESCRIBED = {
    "embed": "an embedding model",
    "rerank": "a re-ranker (a cross-encoder: one score per query-document pair)",
    "classify": "a classifier",
    "sparse": "a sparse (SPLADE) embedding model",
}
OPERATIONS: Mapping[str, tuple[str, ...]] = {
    "embed": ("embed",),  # pooled dense embeddings
    "rerank": ("rerank",),  # one query against documents
    "predict": ("rerank", "classify"),  # the head's scores (labels) of texts or pairs
    "embed_sparse": ("sparse",),
    "hidden_states": TASKS,  # per-token hidden states: every model has them
    "tokenize": TASKS,
}
ACTIVATIONS = SCORE_ACTIVATIONS
DIRECTIONS = ("right", "left")


def check(task: str, operation: str, *, route: str, model: str, routes: Mapping[str, str]) -> None:
    """Refuses `operation` (via `route`) on a model whose task it does not serve, naming the task and the
    routes of `routes` (route -> operation) that do serve it."""
    if task in OPERATIONS[operation]:
        return
    fits = [name for name, op in routes.items() if task in OPERATIONS[op]]
    needs = " or ".join(DESCRIBED[t] for t in OPERATIONS[operation])
    raise ValidationError(f"model: {quote(model)} is {DESCRIBED.get(task, task)} (task {task!r}); {route} needs "
                          f"{needs}. Routes that fit it: {', '.join(fits) or 'none'}")


def activate(logits: np.ndarray, activation: str, raw: bool = False) -> np.ndarray:
    """Scores [n, labels] from logits [n, labels]: the export's activation (sigmoid per label, softmax
    over labels, none), or the logits themselves when `raw`."""
    if raw or activation == "none":
        return np.asarray(logits, np.float32)
    x = np.asarray(logits, np.float64)
    if activation == "sigmoid":
        return (1.0 / (1.0 + np.exp(-x))).astype(np.float32)
    if activation == "softmax":
        e = np.exp(x - x.max(axis=-1, keepdims=True))
        return (e / e.sum(axis=-1, keepdims=True)).astype(np.float32)
    raise ValueError(f"unknown activation {activation!r}")


def ranking(scores: np.ndarray, top_n: int | None = None) -> np.ndarray:
    """Document indices by score, highest first (equal scores in document order), the first `top_n`."""
    order = np.argsort(-np.asarray(scores, np.float64), kind="stable")
    return order[:top_n] if top_n else order


def predictions(scores: np.ndarray, labels: list[str]) -> list[list[tuple[str, float]]]:
    """Per input, every (label, score), highest score first."""
    out = []
    for row in np.asarray(scores, np.float32):
        order = np.argsort(-row.astype(np.float64), kind="stable")
        out.append([(labels[i] if i < len(labels) else f"LABEL_{i}", float(row[i])) for i in order.tolist()])
    return out


def sparse_rows(weights: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per row of a sparse output [n, vocab]: the indices (ascending) and values of its non-zero entries."""
    out = []
    for row in weights:
        index = np.flatnonzero(row)
        out.append((index, row[index].astype(np.float32, copy=False)))
    return out


def _text(value, field: str) -> str:
    if not isinstance(value, str):
        raise ValidationError(f"{field}: expected a string, got {quote(value)}")
    if not value:
        raise ValidationError(f"{field}: empty text; send at least one character")
    return value


def documents(value, field: str = "documents", *, objects: bool = False) -> tuple[str, ...]:
    """A rerank's documents: a non-empty list of non-empty strings (`objects`: or {"text": ...} objects,
    as Cohere's and Jina's APIs take them)."""
    if not isinstance(value, list):
        raise ValidationError(f"{field}: expected a list of strings, got {quote(value)}")
    if not value:
        raise ValidationError(f"{field}: empty list; send at least one document")
    out = []
    for i, item in enumerate(value):
        if objects and isinstance(item, dict):
            if "text" not in item:
                raise ValidationError(f"{field}[{i}]: a document object needs a \"text\" field")
            item = item["text"]
        out.append(_text(item, f"{field}[{i}]"))
    return tuple(out)


def query(value, field: str = "query") -> str:
    if value is None:
        raise ValidationError(f"{field}: missing; send the query the documents are ranked against")
    return _text(value, field)


def texts_of(value, field: str = "inputs") -> tuple[str, ...]:
    """A string or a non-empty list of non-empty strings."""
    if isinstance(value, str):
        return (_text(value, field),)
    if not isinstance(value, list) or not value:
        raise ValidationError(f"{field}: expected a string or a non-empty list of strings, got "
                              f"{quote(value) if not isinstance(value, list) else 'an empty list'}")
    return tuple(_text(v, f"{field}[{i}]") for i, v in enumerate(value))


def truncation_direction(value, field: str = "truncation_direction") -> str:
    """"right" (default) or "left", in any case (TEI writes "Right")."""
    if value is None:
        return "right"
    if not isinstance(value, str) or value.lower() not in DIRECTIONS:
        raise ValidationError(f"{field}: {quote(value)} is not one of {', '.join(DIRECTIONS)}")
    return value.lower()


def top_n_of(value, count: int, field: str = "top_n") -> int | None:
    """top_n: None (every document), else an integer >= 1 (more than the documents: all of them)."""
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValidationError(f"{field}: expected an integer >= 1, got {quote(value)}")
    return min(value, count)
