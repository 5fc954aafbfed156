"""The sparse verb: a SPLADE model's weight per vocabulary entry, answered as each input's non-zero entries
(TEI's /embed_sparse, encoder.v1 EmbedSparse); bge-m3's lexical weights (m3.py) in the same shape."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from serve.core.requests import EncodeResult, Work
from serve.core.tasks import Pending, m3
from serve.core.tasks.inputs import Inputs, text_rows


@dataclass(frozen=True, slots=True)
class SparseTask:
    inputs: Inputs
    request_id: str = ""


@dataclass(frozen=True, slots=True)
class SparseVectors:
    rows: list[tuple[np.ndarray, np.ndarray]]  # per input: the indices (ascending) and values of its non-zeros
    run: EncodeResult

    def __len__(self) -> int:
        return len(self.rows)


def submit(engine, task: SparseTask, deadline: float | None = None) -> Pending:
    inputs = task.inputs
    if engine.task == "m3":  # bge-m3's lexical weights (m3.py)
        m3.texts_only(engine, inputs)
        rows = text_rows(engine, inputs)
        work = Work(rows.sequences, request_id=task.request_id, truncated=rows.truncated)
        return m3.submit(engine, work, lambda engine, result, sequences: SparseVectors(
            m3.lexical(engine, result, sequences), result), deadline)
    if inputs.texts:
        rows = text_rows(engine, inputs)
        work = Work(rows.sequences, scores=True, request_id=task.request_id, truncated=rows.truncated)
    else:
        work = Work(inputs.sequences, scores=True, request_id=task.request_id, lengths=inputs.lengths)
    return Pending(engine.submit(work, deadline), lambda result: SparseVectors(non_zeros(result.scores), result))


def non_zeros(weights: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per row of a sparse output [n, vocab]: the indices (ascending) and values of its non-zero entries."""
    out = []
    for row in weights:
        index = np.flatnonzero(row)
        out.append((index, row[index].astype(np.float32, copy=False)))
    return out
