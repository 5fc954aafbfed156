"""The core between the servicer and the backend: validate, admit (batcher), wait, describe.

It knows our request types only; the servicer owns protobuf. One Engine per loaded model.
"""

from __future__ import annotations

import dataclasses
import time

from dataclasses import dataclass

import numpy as np

from model.config import to_json
from model.mask_kinds import MaskKind
from serve.backend.session import Backend
from serve.core.batcher import Batcher, Ticket
from serve.config import ServerConfig
from serve.core.pooling import FROM_HIDDEN, pool_chunks, resolve_pooling
from serve.core.requests import EncodeRequest, EncodeResult, Limits, to_rows
from serve.core import tasks
from serve.errors import DeadlineExceeded, ValidationError, quote
from serve.backend.export_dir import ExportDir
from serve.core.text import TextTokenizer


@dataclass(frozen=True)
class ModelDescription:
    name: str
    version: str
    sha256: str
    config_json: str
    opset: int
    inputs: tuple[dict, ...]
    outputs: tuple[dict, ...]
    mask_kinds: tuple[str, ...]
    limits: dict
    providers: tuple[str, ...]
    available_providers: tuple[str, ...]
    input_kind: str
    d_model: int
    vocab_size: int
    has_tokenizer: bool
    default_pooling: str
    default_normalize: bool
    memory_bytes: int = 0
    task: str = "embed"
    labels: tuple[str, ...] = ()
    prompts: dict = dataclasses.field(default_factory=dict)
    default_prompt_name: str = ""
    natural_mask: str = "bidirectional"
    embedding_width: int = 0  # a pooled embedding's width as clients get it: d_model, or the projection's output


@dataclass(frozen=True)
class Reloaded:
    """What a hot swap (`EncoderServer.reload`) reports: the model before and the model now serving."""

    previous_sha256: str
    sha256: str
    model_name: str
    model_version: str
    load_seconds: float


class Engine:
    def __init__(self, export: ExportDir, backend: Backend, batcher: Batcher, server: ServerConfig,
                 name: str = "", memory_bytes: int = 0) -> None:
        self.export = export
        self.name = name or export.name  # the name it is served under (a repository's folder name)
        self.memory_bytes = memory_bytes  # its share of the memory budget (serve/assembly/repository.py)
        self.backend = backend
        self.batcher = batcher
        self.server = server
        self.budget = batcher.budget  # built once, with the batcher (serve/assembly/loading.py)
        lengths = [n for n in (export.config.position_limit, server.max_sequence_length) if n]
        self.limits = Limits(
            max_sequences_per_request=server.max_sequences_per_request,
            max_sequence_length=min([*lengths, self.budget.max_length()]),
            max_request_tokens=server.max_request_tokens,
        )
        self.text = TextTokenizer.from_export(export)  # None without one; ExportError on a bad one

    @property
    def task(self) -> str:
        """What the model does (serve/core/tasks.py): embed, rerank, classify or sparse."""
        return self.export.task

    def check(self, operation: str, route: str, routes: dict[str, str]) -> None:
        """Refuses `operation` (called as `route`) unless this model's task serves it (serve/core/tasks.py)."""
        tasks.check(self.task, operation, route=route, model=self.name, routes=routes)

    @property
    def embedding_width(self) -> int:
        """The width of this model's pooled embeddings as clients get them (after its projection, if any)."""
        return self.export.embedding_width

    @property
    def labels(self) -> list[str]:
        """A classifier's or re-ranker's labels, in the order of its logits."""
        labels = list(self.export.metadata.task.get("labels") or ())
        return labels or [f"LABEL_{i}" for i in range(self.export.config.num_labels)]

    def scores(self, result: EncodeResult, raw: bool = False, activation: str | None = None) -> np.ndarray:
        """A rerank or classify result's scores [n, labels]: the logits through the export's activation
        (or `activation`, one of serve/core/tasks.py ACTIVATIONS), or the logits themselves when `raw`."""
        return tasks.activate(result.scores, activation or str(self.export.metadata.task.get("activation", "none")),
                              raw)

    def submit(self, request: EncodeRequest, deadline: float | None = None) -> Ticket:
        """Resolves what `request` leaves to the model (its default pooling and normalisation: the
        adapters pass "" / None), validates and admits; raises ValidationError / Overloaded / Unavailable.
        A model with a head (its task is not embed) answers its head's output (`scores`), never a pooled
        embedding."""
        if self.task != "embed":
            if request.pooling in ("mean", *FROM_HIDDEN):
                raise ValidationError(
                    f"pooling: model {self.name!r} is {tasks.DESCRIBED[self.task]}; it answers its head's "
                    f"output (scores), not pooled embeddings: ask for pooling none (or leave it unset)")
            request = dataclasses.replace(request, pooling="none", normalize=False, scores=True)
        if not request.pooling or request.normalize is None:
            request = dataclasses.replace(
                request, pooling=self.pooling(request.pooling),
                normalize=self.export.default_normalize if request.normalize is None else request.normalize)
        if request.texts or request.pairs:
            request = self._tokenize(request)
        rows = to_rows(request, self.export.config, self.limits, self.budget)  # paths decided here, once
        if request.hidden_states:
            tokens = int(rows.lengths.sum())
            size = tokens * self.export.config.d_model * 4
            if size > self.server.max_response_bytes:
                raise ValidationError(
                    f"hidden_states: {tokens} tokens of hidden states are {size} bytes, "
                    f"over max_response_bytes={self.server.max_response_bytes}; ask for hidden_states=false "
                    "(pooled embeddings only), or send the sequences one by one on EncodeStream")
        if deadline is not None and time.monotonic() >= deadline:
            raise DeadlineExceeded("deadline expired before the request was admitted")
        return self.batcher.submit(request, rows, deadline)

    def _tokenize(self, request: EncodeRequest) -> EncodeRequest:
        """The request with its texts (or sentence pairs) tokenized into `sequences` (rows like any
        token ids; pairs with their token type ids)."""
        if len(request.sequences):
            raise ValidationError("texts: send either texts or sequences, not both")
        if self.text is None:
            raise ValidationError("texts: model has no tokenizer; send token ids in `sequences`")
        if request.pairs:
            self.limits.check_count(len(request.pairs), "pairs")
            sequences, types, truncated = self.text.encode_pairs(
                request.pairs, truncate=request.truncate, direction=request.truncation_direction,
                fields=request.pair_fields)
            return dataclasses.replace(request, sequences=sequences, types=types, truncated=truncated)
        self.limits.check_count(len(request.texts), "texts")
        if request.chunk:
            if request.truncate:
                raise ValidationError("texts: chunk and truncate are two answers to a long text; set one")
            if request.hidden_states or request.pooling != "mean":
                raise ValidationError("texts: chunk=true pools each text's windows into one mean embedding; "
                                      "ask for pooling mean and no hidden_states")
        sequences, truncated, chunks = self.text.encode(request.texts, truncate=request.truncate,
                                                        chunk=request.chunk, direction=request.truncation_direction,
                                                        prompt=self.prompt(request.prompt_name))
        if len(sequences) > self.server.max_batch_size:
            raise ValidationError(
                f"texts: {len(request.texts)} texts make {len(sequences)} windows, over "
                f"max_batch_size={self.server.max_batch_size}; send fewer or shorter texts")
        return dataclasses.replace(request, sequences=sequences, truncated=truncated,
                                   chunks=chunks if request.chunk else ())

    def prompt(self, name: str | None) -> str:
        """The text of prompt `name` (the export's sentence-transformers prompts); None: the model's
        default prompt, if it has one; "": none."""
        prompts = self.export.metadata.prompts
        if name is None:
            name = self.export.metadata.default_prompt_name or ""
            if not name:
                return ""
        elif name == "":
            return ""
        if name not in prompts:
            raise ValidationError(f"prompt_name: {quote(name)} is not one of this model's prompts "
                                  f"({', '.join(sorted(prompts)) or 'it has none'})")
        return prompts[name]

    def tokenize(self, texts, add_special_tokens: bool = True, prompt_name: str | None = None) -> list[list[dict]]:
        """Each text's tokens (serve/core/text.py `tokens`), with the prompt asked (None: the default)."""
        if self.text is None:
            raise ValidationError("texts: model has no tokenizer")
        return self.text.tokens(texts, add_special_tokens=add_special_tokens, prompt=self.prompt(prompt_name))

    def decode(self, ids, skip_special_tokens: bool = True) -> list[str]:
        if self.text is None:
            raise ValidationError("ids: model has no tokenizer")
        return self.text.decode(ids, skip_special_tokens=skip_special_tokens)

    def pooling(self, asked: str = "", *, field: str = "pooling", embedding: bool = False) -> str:
        """The pooling a request runs with (serve/core/pooling.py resolve_pooling, on this model's default)."""
        return resolve_pooling(asked, self.export.default_pooling, field=field, embedding=embedding)

    def wait(self, ticket: Ticket, deadline: float | None = None) -> EncodeResult:
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            ticket.wait(timeout)
        except DeadlineExceeded:
            ticket.cancel()
            raise
        return self.result(ticket)

    @staticmethod
    def result(ticket: Ticket) -> EncodeResult:
        """A finished ticket's result (chunked texts pooled per text), or raises its error."""
        result = ticket.outcome()
        return pool_chunks(result, ticket.request) if ticket.request.chunks else result

    def encode(self, request: EncodeRequest, deadline: float | None = None) -> EncodeResult:
        return self.wait(self.submit(request, deadline), deadline)

    def describe(self) -> ModelDescription:
        meta, config, s = self.export.metadata, self.export.config, self.server
        return ModelDescription(
            name=self.name,
            version=self.export.version,
            sha256=self.export.sha256,
            config_json=to_json(config),
            opset=self.export.opset,
            inputs=meta.inputs,
            outputs=meta.outputs,
            mask_kinds=tuple(k.label for k in MaskKind),
            limits={
                "max_sequences_per_request": s.max_sequences_per_request,
                "max_sequence_length": self.limits.max_sequence_length,
                "max_attention_bytes": self.budget.max_bytes,
                "max_batch_size": s.max_batch_size,
                "max_batch_tokens": s.max_batch_tokens,
                "max_queue_delay_ms": s.max_queue_delay_ms,
                "max_queue_size": s.max_queue_size,
                "max_request_bytes": s.max_request_bytes,
                "max_request_tokens": self.limits.max_request_tokens,
                "max_text_tokens": self.text.max_length if self.text else 0,
            },
            providers=self.backend.info.providers,
            available_providers=self.backend.info.available_providers,
            input_kind=config.input_kind,
            d_model=config.d_model,
            vocab_size=config.vocab_size if config.input_kind == "tokens" else 0,
            has_tokenizer=self.export.has_tokenizer,
            default_pooling=self.export.default_pooling,
            default_normalize=self.export.default_normalize,
            memory_bytes=self.memory_bytes,
            task=self.task,
            labels=tuple(self.labels) if self.task in ("rerank", "classify") else (),
            prompts=dict(meta.prompts),
            default_prompt_name=meta.default_prompt_name or "",
            natural_mask=config.natural_mask,
            embedding_width=self.embedding_width,
        )

