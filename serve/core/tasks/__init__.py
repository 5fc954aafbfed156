"""Tasks: what a model is for, and what a call asks of it. One module per verb, each holding its typed
request (the defaults and limits it declares, once), its result, and the verb that applies them:

  verb       module       request -> result             serves models whose task is
  encode     encode.py    EncodeTask -> Encoded         any: per-token hidden states, pooled embeddings, or
                                                        the head's raw output, under any mask (encoder.v1
                                                        Encode, KServe v2 ModelInfer, TEI /embed_all)
  embed      embed.py     EmbedTask -> Embeddings       embed: pooled embeddings, Matryoshka `dimensions`,
                                                        output encodings (OpenAI /v1/embeddings, TEI /embed,
                                                        Cohere /v1|v2/embed)
  sparse     sparse.py    SparseTask -> SparseVectors   sparse: SPLADE weights (TEI /embed_sparse, EmbedSparse)
  rerank     rerank.py    RerankTask -> Ranking         rerank: a query against documents (TEI /rerank,
                                                        Cohere/Jina /v1|v2/rerank, infinity /rerank, Rerank);
                                                        multivector: the same, scored by MaxSim
  (encode)   multivector.py                             multivector: each text's token vectors, as the
                                                        ColBERT computes them (the encode verb's hidden
                                                        states on such a model); MaxSim (rerank.py)
  (all)      m3.py                                      m3 (bge-m3): embed its dense embedding, sparse its
                                                        lexical weights, encode its ColBERT vectors
  classify   classify.py  ClassifyTask -> Predictions   rerank, classify: each label's score of texts or pairs
                                                        (TEI /predict, infinity /classify, Classify)
  tokenize   tokens.py    TokenizeTask -> tokens        any model with a tokenizer (TEI /tokenize, /decode,
             (decode)     DecodeTask -> texts           Tokenize)

A model's task is one word from model to serve: metadata.json's "task" kind (model/tasks.py: embed, rerank,
classify, sparse, multivector), written by the exporter from the checkpoint's head, is the word the verbs serve. Every
protocol adapter (serve/protocols/) turns its vendor's shape into one of these requests and the result back
into its vendor's shape, and nothing else; the route table (serve/protocols/routes.py) says which verb a
route runs, so a route that does not fit a model's task is refused (`check`) naming the routes that do.

A verb's `submit(engine, request, deadline)` checks the request against the model, makes the core's Work
(serve/core/requests.py: rows and what to answer of them), admits it into the model's batcher and returns a
`Pending`, whose `result()` is the verb's result, made on the thread that finished the batch.

Shared here: `check` (does a verb fit a model's task), `Pending`.
"""

from __future__ import annotations

from typing import Callable, Mapping

from model.tasks import TASK_KINDS
from serve.errors import ValidationError, quote

TASKS = TASK_KINDS  # model/tasks.py: what an export's metadata.json "task" may say
DESCRIBED = {
    "embed": "an embedding model",
    "rerank": "a re-ranker (a cross-encoder or an LLM reranker: one score per query-document pair)",
    "classify": "a classifier",
    "sparse": "a sparse (SPLADE) embedding model",
    "multivector": "a late-interaction (ColBERT) model: token vectors, MaxSim scores",
    "m3": "a bge-m3 model: dense embeddings, lexical weights, ColBERT vectors",
}
# each verb -> the model tasks it serves
SERVES: Mapping[str, tuple[str, ...]] = {
    "encode": TASKS,  # per-token hidden states (and what else the model answers): every model has them; a
    # multivector model's are its token vectors (multivector.py)
    "embed": ("embed", "m3"),  # bge-m3's dense embedding (m3.py)
    "sparse": ("sparse", "m3"),  # bge-m3's lexical weights
    "rerank": ("rerank", "multivector"),  # a ColBERT ranks by MaxSim (multivector.py)
    "classify": ("rerank", "classify"),  # a cross-encoder's one label is a classifier's too (TEI /predict)
    "tokenize": TASKS,
}
VERBS = tuple(SERVES)


def check(task: str, verb: str, *, model: str, route: str, routes: Mapping[str, str]) -> None:
    """Refuses `verb` (called as `route`) on a model whose task it does not serve, naming the model's task and
    the routes of `routes` (route -> verb: a protocol's table) that do serve it."""
    if task in SERVES[verb]:
        return
    fits = [name for name, v in routes.items() if v is not None and task in SERVES[v]]
    needs = " or ".join(DESCRIBED[t] for t in SERVES[verb])
    raise ValidationError(f"model: {quote(model)} is {DESCRIBED.get(task, task)} (task {task!r}); {route} needs "
                          f"{needs}. Routes that fit it: {', '.join(fits) or 'none'}")


class Pending:
    """A submitted task: the ticket its rows wait on in the batcher (serve/core/batcher.py), and `finish`,
    which makes the verb's result from the core's (on the thread that finished the ticket)."""

    __slots__ = ("ticket", "_finish")

    def __init__(self, ticket, finish: Callable[[object], object] | None = None) -> None:
        self.ticket = ticket
        self._finish = finish  # None: the core's result is the verb's

    def cancel(self) -> None:
        """The caller left: a request still queued is dropped, never run."""
        self.ticket.cancel()

    def add_done_callback(self, callback: Callable[["Pending"], None]) -> None:
        """`callback(self)` once the rows have run (at once if they have), on the finishing thread."""
        self.ticket.add_done_callback(lambda _: callback(self))

    def result(self):
        """The verb's result of a finished task, or raises its error."""
        outcome = self.ticket.outcome()
        return outcome if self._finish is None else self._finish(outcome)

    def wait(self, timeout: float | None = None):
        """Waits for the rows (DeadlineExceeded past `timeout`: the ticket is cancelled), then `result()`."""
        try:
            self.ticket.wait(timeout)
        except Exception:
            self.ticket.cancel()
            raise
        return self.result()
