"""What a request's rows become once they have run: the ONE home of pooling, the projection after it,
normalisation and the pooling of a chunked text's windows, and of the defaults a request leaves to its model.

  pooling_name      the one check of a pooling's name (every protocol's field calls it)
  resolve_pooling   the pooling a request runs with: what it asked, else the model's default
                    (metadata.json "pooling"), "mean" where an embedding is required and the model's
                    default is none (OpenAI's API, v2's `embeddings` output)
  request_outputs   a request's hidden states, embeddings and head scores, as arrays: the pooled
                    embeddings (mean from the graph, first / last token from the hidden states), through
                    the model's projection, then L2-normalised when asked (a chunked text: after pooling);
                    a head's output as the graph gave it; hidden states as the graph gave them
  project           sentence-transformers' Dense layers after pooling (metadata.json "pooling" "dense")
  pool_chunks       one output per chunked text from its windows' rows (each already projected)
  l2_normalize      the one normalisation (every protocol's, Matryoshka's re-normalisation too)
  check_dimensions  a Matryoshka `dimensions` against the width of the model's embeddings
  truncate_dimensions  the Matryoshka cut itself: the first N values, re-normalised when asked
"""

from __future__ import annotations

import dataclasses

import numpy as np

from model.projection import ACTIVATIONS, Dense
from serve.errors import ValidationError, quote

POOLINGS = ("mean", "first", "last", "none")  # what a request's pooling may be (KServe v2 lists them in this order)
# the poolings read off the hidden states (a run returns them for such a request): the first token's, and
# the last real token's (decoder embedders: Qwen3-Embedding, gte-Qwen2; rows are right-padded here)
FROM_HIDDEN = ("first", "last")


def reads_hidden(request) -> bool:
    """Whether a request's answer is read off the hidden states (asked for, or first/last-token pooling): a run
    fetches them only for such requests (serve/core/runs.py)."""
    return request.hidden_states or request.pooling in FROM_HIDDEN
NORM_FLOOR = 1e-12  # a zero vector stays zero instead of dividing by zero


def l2_normalize(vectors: np.ndarray) -> np.ndarray:
    """Each vector along the last axis divided by its L2 norm (a zero vector stays zero)."""
    norms = np.sqrt(np.add.reduce(vectors * vectors, axis=-1, keepdims=True))  # np.linalg.norm's sum, less overhead
    return vectors / np.maximum(norms, NORM_FLOOR).astype(vectors.dtype, copy=False)


def project(vectors: np.ndarray, dense: tuple[Dense, ...]) -> np.ndarray:
    """Pooled embeddings [n, D] through the model's Dense layers, in order: activation(x @ W.T + b), float32
    (sentence-transformers' Pooling -> Dense -> ... -> Normalize); `vectors` itself without any."""
    for layer in dense:
        vectors = vectors @ layer.weight.T  # (n, out)
        if layer.bias is not None:
            vectors += layer.bias
        vectors = ACTIVATIONS[layer.activation](vectors)
    return vectors


def check_dimensions(dimensions: int | None, width: int, field: str = "dimensions") -> None:
    """A Matryoshka `dimensions` (the first N values of each embedding) must be within the embeddings' `width`
    (the projection's output where the model has one, else d_model); None: not asked."""
    if dimensions is not None and not 1 <= dimensions <= width:
        raise ValidationError(f"{field}: {dimensions} out of range [1, {width}] "
                              f"(this model's embeddings have {width})")


def truncate_dimensions(vectors: np.ndarray, dimensions: int | None, normalize: bool) -> np.ndarray:
    """Matryoshka: the first `dimensions` values of each embedding (None: all), L2-normalised again when
    `normalize` (OpenAI's API always re-normalises; TEI's when its request normalises)."""
    if dimensions is None:
        return vectors
    vectors = vectors[:, :dimensions]
    return l2_normalize(vectors) if normalize else np.ascontiguousarray(vectors)


def pooling_name(asked: str, *, field: str = "pooling", embedding: bool = False) -> str:
    """`asked` checked against POOLINGS ("": the model's default, resolved by `resolve_pooling`); ValidationError
    naming `field`. `embedding`: the caller needs a pooled embedding, so "none" is refused."""
    if asked and (asked not in POOLINGS or (embedding and asked == "none")):
        allowed = [p for p in POOLINGS if not (embedding and p == "none")]
        raise ValidationError(f"{field}: {quote(asked)} is not one of {', '.join(allowed)}")
    return asked


def resolve_pooling(asked: str, default: str, *, embedding: bool = False) -> str:
    """The pooling a request runs with: `asked` (checked by `pooling_name`), else the model's `default`;
    `embedding`: a "none" default means "mean" (OpenAI's API, v2's `embeddings` output need an embedding)."""
    if not asked:
        return "mean" if embedding and default == "none" else default
    return asked


def request_outputs(request, hidden: np.ndarray | None, row_outputs: np.ndarray, lengths: np.ndarray,
                    dense: tuple[Dense, ...] = ()) -> tuple[np.ndarray | None, np.ndarray | None, np.ndarray | None]:
    """A request's (hidden states, embeddings, scores) from its rows' hidden [n, T, D] (zeros past each
    row's length) and the graph's per-row output [n, K]: the mean [n, D] of a model without a head,
    else its head's output (serve/core/tasks/), which a request with `scores` is answered as is.
    What it asked for, nothing else. Embeddings are the mean or the first token, through the model's
    projection `dense` (each chunk window's alone), then L2-normalised when asked (a chunked text: after
    pooling, in `pool_chunks`); "last" reads each row's position lengths[i] - 1 (a row with no token pools
    to zeros). Hidden states are never projected."""
    embeddings = None
    if request.pooling == "mean" and not request.scores:
        embeddings = row_outputs
    elif request.pooling == "first":
        embeddings = hidden[:, 0]
    elif request.pooling == "last":
        embeddings = hidden[np.arange(len(lengths)), np.maximum(np.asarray(lengths) - 1, 0)]
    if embeddings is not None:
        embeddings = project(embeddings, dense)
    if embeddings is not None and request.normalize and not request.chunks:
        embeddings = l2_normalize(embeddings)
    return (hidden if request.hidden_states else None), embeddings, (row_outputs if request.scores else None)


def pool_chunks(result, request):
    """One output per text from its windows' rows: the token-weighted mean of their mean-pooled
    embeddings, each already through the model's projection (`request_outputs`; each window's weighs as
    many tokens as it holds), normalized after pooling when asked. Token counts are per text, summed
    over its windows (overlaps counted in each)."""
    counts = np.asarray(result.token_counts, np.float64)
    starts = np.concatenate([[0], np.cumsum(request.chunks)[:-1]])
    weights = np.add.reduceat(counts, starts)
    embeddings = np.add.reduceat(counts[:, None] * result.embeddings.astype(np.float64), starts) / weights[:, None]
    if request.normalize:
        embeddings = l2_normalize(embeddings)
    paths = tuple(result.attention_paths[s] for s in starts.tolist()) if result.attention_paths else ()
    return dataclasses.replace(result, hidden_states=None, embeddings=embeddings.astype(np.float32),
                               token_counts=tuple(int(w) for w in weights), attention_paths=paths,
                               chunks=request.chunks)
