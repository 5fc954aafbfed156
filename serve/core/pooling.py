"""What a request's rows become once they have run: the ONE home of pooling, normalisation and the
pooling of a chunked text's windows, and of the defaults a request leaves to its model.

  resolve_pooling   the pooling a request runs with: what it asked, else the model's default
                    (metadata.json "pooling"), "mean" where an embedding is required and the model's
                    default is none (OpenAI's API, v2's `embeddings` output)
  row_output        one row's SequenceOutput: the pooled embedding (mean from the graph, first token
                    from the hidden states), L2-normalised when asked (a chunked text: after pooling)
  pool_chunks       one output per chunked text from its windows' rows
  l2_normalize      the one normalisation (every protocol's, Matryoshka's re-normalisation too)
"""

from __future__ import annotations

import dataclasses

import numpy as np

from serve.errors import ValidationError, quote

POOLINGS = ("mean", "first", "none")  # what a request's pooling may be (KServe v2 lists them in this order)
NORM_FLOOR = 1e-12  # a zero vector stays zero instead of dividing by zero


def l2_normalize(vector: np.ndarray) -> np.ndarray:
    return vector / max(float(np.linalg.norm(vector)), NORM_FLOOR)


def resolve_pooling(asked: str, default: str, *, field: str = "pooling", embedding: bool = False) -> str:
    """`asked` ("": the model's `default`) checked against POOLINGS; ValidationError naming `field`.
    `embedding`: the caller needs a pooled embedding, so a "none" default means "mean"."""
    if not asked:
        return "mean" if embedding and default == "none" else default
    if asked not in POOLINGS or (embedding and asked == "none"):
        allowed = [p for p in POOLINGS if not (embedding and p == "none")]
        raise ValidationError(f"{field}: {quote(asked)} is not one of {', '.join(allowed)}")
    return asked


def row_output(request, hidden: np.ndarray, mean_pooled: np.ndarray):
    """One row's output for `request` (hidden [T, D] of its own length, the graph's mean [D])."""
    from serve.core.requests import SequenceOutput

    embedding = None
    if request.pooling == "mean":
        embedding = mean_pooled
    elif request.pooling == "first":
        embedding = hidden[0]
    if embedding is not None and request.normalize and not request.chunks:  # chunks: after pooling them
        embedding = l2_normalize(embedding)
    return SequenceOutput(hidden if request.hidden_states else None, embedding)


def pool_chunks(result, request):
    """One output per text from its windows' rows: the token-weighted mean of their mean-pooled
    embeddings (each window's mean weighs as many tokens as it holds), normalized after pooling
    when asked. Token counts are per text, summed over its windows (overlaps counted in each)."""
    from serve.core.requests import SequenceOutput

    outputs, counts, paths, row = [], [], [], 0
    for n in request.chunks:
        rows = range(row, row + n)
        weights = np.array([result.token_counts[r] for r in rows], np.float64)
        stacked = np.stack([result.outputs[r].embedding for r in rows]).astype(np.float64)
        embedding = (weights[:, None] * stacked).sum(0) / weights.sum()
        if request.normalize:
            embedding = l2_normalize(embedding)
        outputs.append(SequenceOutput(None, embedding.astype(np.float32)))
        counts.append(int(weights.sum()))
        paths.append(result.attention_paths[row] if result.attention_paths else "")
        row += n
    return dataclasses.replace(result, outputs=tuple(outputs), token_counts=tuple(counts),
                               attention_paths=tuple(paths), chunks=request.chunks)
