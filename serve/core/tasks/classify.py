"""The classify verb: each label's score of texts or of sentence pairs, from a classifier's or a re-ranker's
head (TEI's /predict, infinity's /classify, encoder.v1 Classify). Scores are the logits through the export's
activation (metadata.json task "activation": sigmoid per label, softmax over labels, none), or another one
the call names (the Inference API's function_to_apply), or the logits themselves (`raw_scores`). Labels are
the export's (model/tasks.py `labels_of`); each input's predictions come highest score first, equal scores
in label order.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from model.tasks import SCORE_ACTIVATIONS
from serve.core.requests import EncodeResult, Work
from serve.core.tasks import Pending
from serve.core.tasks.inputs import Inputs, TextOptions, check_untemplated, pair_rows, text_rows
from serve.errors import ValidationError, quote

ACTIVATIONS = SCORE_ACTIVATIONS


@dataclass(frozen=True, slots=True)
class ClassifyTask:
    texts: tuple[str, ...] = ()
    pairs: tuple[tuple[str, str], ...] = ()  # (text, text_pair): a pair classifier's, a cross-encoder's
    text: TextOptions = TextOptions()  # pairs: only the second text is ever cut
    raw_scores: bool = False  # the logits, not the scores
    activation: str | None = None  # one of ACTIVATIONS instead of the export's (`activation_name` checks it)
    request_id: str = ""
    pair_fields: tuple[str, str] = ("pairs[{i}][0]", "pairs[{i}][1]")  # the pair's texts as errors name them


@dataclass(frozen=True, slots=True)
class Predictions:
    scores: np.ndarray  # float32 [n, labels], in label order
    labels: list[str]
    run: EncodeResult

    def __len__(self) -> int:
        return len(self.scores)

    @property
    def ranked(self) -> list[list[tuple[str, float]]]:
        """Per input, every (label, score), highest score first (equal scores in label order)."""
        out = []
        for row in np.asarray(self.scores, np.float32):
            order = np.argsort(-row.astype(np.float64), kind="stable")
            out.append([(self.labels[i], float(row[i])) for i in order.tolist()])
        return out


def submit(engine, task: ClassifyTask, deadline: float | None = None) -> Pending:
    if task.texts and task.pairs:
        raise ValidationError("texts: send either texts or pairs, not both")
    check_untemplated(engine, "model")
    if task.pairs:
        rows = pair_rows(engine, task.pairs, task.text, task.pair_fields)
    else:
        rows = text_rows(engine, Inputs(texts=task.texts, text=task.text))
    work = Work(rows.sequences, scores=True, request_id=task.request_id, types=rows.types, truncated=rows.truncated)
    activation = task.activation or activation_of(engine)
    labels = engine.labels
    return Pending(engine.submit(work, deadline),
                   lambda result: Predictions(activate(result.scores, activation, task.raw_scores), labels, result))


def activation_name(value: str | None, field: str) -> str | None:
    """An activation a call names (None: the export's), one of ACTIVATIONS; ValidationError naming `field`."""
    if value is not None and value not in ACTIVATIONS:
        raise ValidationError(f"{field}: {quote(value)} is not one of {', '.join(ACTIVATIONS)}")
    return value


def activation_of(engine) -> str:
    """The export's activation of its logits (metadata.json task "activation"; none for a model without one)."""
    return str(engine.export.metadata.task.get("activation", "none"))


def activate(logits: np.ndarray, activation: str, raw: bool = False) -> np.ndarray:
    """Scores [n, labels] from logits [n, labels]: sigmoid per label, softmax over labels, none; or the logits
    themselves when `raw`."""
    if raw or activation == "none":
        return np.asarray(logits, np.float32)
    x = np.asarray(logits, np.float64)
    if activation == "sigmoid":
        return (1.0 / (1.0 + np.exp(-x))).astype(np.float32)
    if activation == "softmax":
        e = np.exp(x - x.max(axis=-1, keepdims=True))
        return (e / e.sum(axis=-1, keepdims=True)).astype(np.float32)
    raise ValueError(f"unknown activation {activation!r}")
