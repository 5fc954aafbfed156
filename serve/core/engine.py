"""One served model: its export, backend, batcher and limits; `submit` checks the core's Work against them
and admits it; `describe` says what the model is and takes. One Engine per loaded model.

It knows the core's types only (serve/core/requests.py); what a call asks is a task verb's
(serve/core/tasks/), and the protocols own their wire formats.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

from model.config import to_json
from model.tasks import labels_of
from model.mask_kinds import MaskKind
from serve.backend.session import Backend
from serve.core.batcher import Batcher, Ticket
from serve.config import ServerConfig
from serve.core.requests import Limits, Work, to_rows
from serve.errors import DeadlineExceeded, ValidationError
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
    # the export's parity proof against PyTorch, per graph (model/export_format.py GraphEntry.proof)
    validation: dict = dataclasses.field(default_factory=dict)


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
        """What the model is for (metadata.json "task"; serve/core/tasks/): embed, rerank, classify or sparse."""
        return self.export.task

    @property
    def embedding_width(self) -> int:
        """The width of this model's pooled embeddings as clients get them (after its projection, if any)."""
        return self.export.embedding_width

    @property
    def labels(self) -> list[str]:
        """A classifier's or re-ranker's labels, in the order of its logits (model/tasks.py `labels_of`)."""
        return labels_of(self.export.metadata.task, self.export.config.num_labels)

    def submit(self, work: Work, deadline: float | None = None) -> Ticket:
        """Validates `work` (its defaults resolved by its verb, serve/core/tasks/) and admits it into this
        model's batcher; raises ValidationError / TooLarge / Overloaded / Unavailable / DeadlineExceeded."""
        rows = to_rows(work, self.export.config, self.limits, self.budget)  # paths decided here, once
        if work.hidden_states:
            tokens = int(rows.lengths.sum())
            size = tokens * self.export.config.d_model * 4
            if size > self.server.max_response_bytes:
                raise ValidationError(
                    f"hidden_states: {tokens} tokens of hidden states are {size} bytes, "
                    f"over max_response_bytes={self.server.max_response_bytes}; ask for hidden_states=false "
                    "(pooled embeddings only), or send the sequences one by one on EncodeStream")
        if deadline is not None and time.monotonic() >= deadline:
            raise DeadlineExceeded("deadline expired before the request was admitted")
        return self.batcher.submit(work, rows, deadline)

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
            validation={name: entry.proof for name, entry in meta.graphs.items() if entry.proof},
        )

