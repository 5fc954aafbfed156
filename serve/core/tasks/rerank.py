"""The rerank verb: one query against documents, each pair scored by a cross-encoder (TEI's /rerank,
Cohere's and Jina's /v1/rerank and /v2/rerank, infinity's /rerank, encoder.v1 Rerank). Each pair is one row
(the query first); with `truncate` only the document is ever cut, and a query too long to pair with any
document is refused naming it. Scores are the head's one logit through the export's activation (or raw);
the ranking is highest score first, equal scores in document order, the first `top_n`. A late-interaction
(multivector) model scores each document by MaxSim against the query (multivector.py), raw.

An LLM reranker (Qwen3-Reranker, bge-reranker-v2-gemma's recipe; metadata.json task "template", model/tasks.py)
reads each pair through its prompt template (Qwen3: prefix, "<Instruct>: {instruction}\n<Query>: {query}\n
<Document>: {document}", suffix), with the request's `instruction` or the template's default one; its score is
the sigmoid of the head's logit (Qwen3: "yes" minus "no", so P("yes")), its raw score that logit. `instruction`
on a model without a template is refused naming it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from serve.core.requests import EncodeResult, Work
from serve.core.tasks import Pending, multivector
from serve.core.tasks.classify import activate, activation_of
from serve.core.tasks.inputs import (TextOptions, check_positive, non_empty, pair_rows, present, template_of,
                                     templated_rows, tokenizer)
from serve.errors import ValidationError, quote


@dataclass(frozen=True, slots=True)
class RerankTask:
    query: str
    documents: tuple[str, ...]
    text: TextOptions = TextOptions()  # truncate: cut a document to fit (never the query)
    top_n: int | None = None  # the first N of the ranking; None: every document
    raw_scores: bool = False  # the logits, not the scores
    max_tokens_per_doc: int | None = None  # each document cut to at most this many tokens first (Cohere v2)
    request_id: str = ""
    documents_field: str = "documents"  # how errors name the documents (TEI's: texts)
    instruction: str | None = None  # an LLM reranker's task instruction; None: its template's default


@dataclass(frozen=True, slots=True)
class Ranking:
    scores: np.ndarray  # float32 [n]: each document's, in document order
    order: np.ndarray  # document indices, highest score first, the first top_n
    run: EncodeResult

    def __len__(self) -> int:
        return len(self.scores)


def submit(engine, task: RerankTask, deadline: float | None = None) -> Pending:
    present(task.query, "query")
    field = task.documents_field
    documents = non_empty(task.documents, field, "document")
    check_positive(task.top_n, "top_n")
    if task.max_tokens_per_doc is not None:
        check_positive(task.max_tokens_per_doc, "max_tokens_per_doc")
        text = tokenizer(engine, field)
        documents, _ = text.keep(documents, task.max_tokens_per_doc, cut=True, field=field,
                                 limit="max_tokens_per_doc")
    if task.instruction is not None and template_of(engine) is None:
        raise ValidationError(f"instruction: model {quote(engine.name)} is a cross-encoder without a prompt template; "
                              "instruction fits an LLM reranker (an export with a reranker template); leave it out")
    if engine.task == "multivector":  # MaxSim of token vectors (multivector.py); the scores are raw
        return multivector.rank(engine, task.query, documents, task.text, task.request_id, field, deadline,
                                lambda scores, documents: Ranking(scores, ranking(scores, task.top_n), documents))
    if template_of(engine) is not None:
        rows = templated_rows(engine, task.query, documents, task.text, task.instruction,
                              ("query", f"{field}[{{i}}]"), count_field=field)
    else:
        rows = pair_rows(engine, tuple((task.query, d) for d in documents), task.text, ("query", f"{field}[{{i}}]"),
                         count_field=field)
    work = Work(rows.sequences, scores=True, request_id=task.request_id, types=rows.types, truncated=rows.truncated)
    activation = activation_of(engine)

    def finish(result: EncodeResult) -> Ranking:
        scores = activate(result.scores, activation, task.raw_scores)[:, 0]
        return Ranking(scores, ranking(scores, task.top_n), result)

    return Pending(engine.submit(work, deadline), finish)


def ranking(scores: np.ndarray, top_n: int | None = None) -> np.ndarray:
    """Document indices by score, highest first (equal scores in document order), the first `top_n`."""
    order = np.argsort(-np.asarray(scores, np.float64), kind="stable")
    return order[:top_n] if top_n else order
