"""Late interaction (ColBERT, PyLate checkpoints): each text's token vectors, and MaxSim scores of a query against
documents. A multivector model's graph answers one L2-normalised vector per token (model/heads.py); what a query
and a document are made of is its metadata.json task (model/tasks.py), applied here as PyLate's ColBERT applies
it (tokenize, encode):

  - a text is tokenized to at most query_length (document_length) tokens with its marker: the marker id goes
    right after the first token ([CLS]); a longer text is refused, or cut with `truncate`;
  - a query with query_expansion is padded with expansion_id ([MASK]) up to query_length; every query vector is
    answered, the padding attended to only with attend_to_expansion_tokens (a custom mask: each row's keys are
    its own tokens, serve/core/requests.py);
  - a document's vectors of skiplist tokens (punctuation) are dropped;
  - MaxSim: the sum over the query's vectors of the largest dot product with the document's vectors (PyLate's
    colbert_scores of one query and one document).

`submit` (the encode verb on such a model: TEI /embed_all, encoder.v1 Encode) answers the token vectors as the
EncodeResult's hidden states: row i holds its kept vectors first, token_counts[i] of them. `rank` (the rerank
verb, and Encode with a maxsim_query) runs the query and the documents in one Work and scores each document.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from model.mask_kinds import MaskKind
from serve.core.requests import EncodeResult, MaskChoice, Work
from serve.core.tasks import Pending
from serve.core.tasks.inputs import TextOptions, tokenizer
from serve.errors import ValidationError


def rows(engine, texts: tuple[str, ...], is_query: bool, options: TextOptions, field: str = "texts"
         ) -> tuple[list[np.ndarray], list[int], tuple[bool, ...]]:
    """(int64 ids per row: marker in, a query expanded; the count of real tokens per row; which texts were cut)."""
    task = engine.export.metadata.task
    if options.prompt_name:
        raise ValidationError(f"prompt_name: model {engine.name!r} is a late-interaction model; its queries and "
                              f"documents take their own markers, not prompts")
    length = task["query_length"] if is_query else task["document_length"]
    marker = task["query_marker_id"] if is_query else task["document_marker_id"]
    text = tokenizer(engine, field).limited(length - (marker is not None))
    try:
        sequences, truncated, _ = text.encode(texts, truncate=options.truncate, direction=options.direction)
    except ValidationError as error:  # names texts[i]: the caller's field instead (a query is one text)
        message = str(error)
        if field != "texts":
            message = message.replace("texts[0]", "query", 1) if field == "query" else \
                message.replace("texts[", f"{field}[", 1)
        raise ValidationError(message) from None
    out, real = [], []
    for ids in sequences:
        if marker is not None:
            ids = np.concatenate([ids[:1], np.asarray([marker], np.int64), ids[1:]])
        real.append(len(ids))
        if is_query and task["query_expansion"] and len(ids) < length:
            ids = np.concatenate([ids, np.full(length - len(ids), task["expansion_id"], np.int64)])
        out.append(ids)
    return out, real, truncated


def mask(engine, sequences: list[np.ndarray], real: list[int]) -> MaskChoice:
    """Each row attends to its real tokens only (a query's expansion is not attended to, as PyLate's attention
    mask of 0 there), or the model's natural mask where every row's tokens are all real."""
    if all(len(ids) == n for ids, n in zip(sequences, real)) or engine.export.metadata.task["attend_to_expansion_tokens"]:
        return MaskChoice()
    longest = max(len(ids) for ids in sequences)
    keys = np.zeros((len(sequences), longest, longest), bool)
    for i, n in enumerate(real):
        keys[i, :, :n] = True
    return MaskChoice(MaskKind.CUSTOM, custom=keys)


def kept(engine, ids: np.ndarray, is_query: bool) -> np.ndarray:
    """Which of a row's positions are answered: a query's every one (its expansion too), a document's but its
    skiplist tokens."""
    if is_query:
        return np.ones(len(ids), bool)
    return ~np.isin(ids, engine.export.metadata.task["skiplist_ids"])


def submit(engine, texts: tuple[str, ...], is_query: bool, options: TextOptions, request_id: str = "",
           deadline: float | None = None) -> Pending:
    """Each text's token vectors (the hidden states of an EncodeResult: row i's kept vectors first)."""
    engine.limits.check_count(len(texts), "texts")
    sequences, real, truncated = rows(engine, texts, is_query, options)
    work = Work(tuple(sequences), mask(engine, sequences, real), hidden_states=True, request_id=request_id,
                truncated=truncated)
    return Pending(engine.submit(work, deadline),
                   lambda result: compacted(result, [kept(engine, ids, is_query) for ids in sequences]))


def compacted(result: EncodeResult, keep: list[np.ndarray], first: int = 0) -> EncodeResult:
    """`result`'s rows from `first` on, each row's kept vectors first and token_counts the number of them."""
    counts = [int(k.sum()) for k in keep[first:]]
    hidden = np.zeros((len(counts), max(counts, default=0), result.hidden_states.shape[-1]), np.float32)
    for i, k in enumerate(keep[first:]):
        hidden[i, :counts[i]] = result.hidden_states[first + i, :len(k)][k]
    return dataclasses.replace(result, hidden_states=hidden, token_counts=tuple(counts),
                               truncated=result.truncated[first:], attention_paths=result.attention_paths[first:])


def maxsim(query: np.ndarray, document: np.ndarray) -> float:
    """Σ over the query's vectors of the largest dot product with the document's ([Q, dim], [D, dim])."""
    return float((query.astype(np.float32) @ document.astype(np.float32).T).max(axis=1).sum())


def rank(engine, query: str, documents: tuple[str, ...], options: TextOptions, request_id: str,
         documents_field: str, deadline: float | None, finish) -> Pending:
    """The query and the documents in one Work; `finish(scores, documents)` makes the verb's answer of the MaxSim
    scores (float32 [documents]) and the documents' rows (`compacted`: their token vectors; the run's timings).
    Only documents are cut with `truncate`: a query too long is refused."""
    engine.limits.check_count(len(documents), documents_field)
    most = engine.limits.max_sequences_per_request
    if len(documents) + 1 > most:  # the query is a row of the same request
        raise ValidationError(f"{documents_field}: {len(documents)} documents and the query make {len(documents) + 1} "
                              f"sequences, over max_sequences_per_request={most}; send at most {most - 1} documents")
    q, q_real, _ = rows(engine, (query,), True, dataclasses.replace(options, truncate=False), "query")
    d, d_real, truncated = rows(engine, documents, False, options, documents_field)
    sequences = q + d
    work = Work(tuple(sequences), mask(engine, sequences, q_real + d_real), hidden_states=True,
                request_id=request_id, truncated=(False, *truncated))
    keep = [kept(engine, ids, i == 0) for i, ids in enumerate(sequences)]

    def scored(result: EncodeResult):
        query = result.hidden_states[0, :len(keep[0])][keep[0]]
        documents = compacted(result, keep, first=1)
        scores = np.asarray([maxsim(query, v[:n]) for v, n in zip(documents.hidden_states, documents.token_counts)],
                            np.float32)
        return finish(scores, documents)

    return Pending(engine.submit(work, deadline), scored)
