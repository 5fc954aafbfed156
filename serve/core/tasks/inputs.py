"""What the verbs share: what a call sends to be encoded (`Inputs`: texts or token ids), how texts become
token rows (`TextOptions`: truncation, its direction, the prompt, a per-call token limit), and the rows
themselves (`text_rows`, `pair_rows`), each checked once against the model's tokenizer and the server's limits.

The count of texts (sequences, pairs, documents) is `Limits.check_count`'s (serve/core/requests.py), called
here for texts and pairs and by `to_rows` for token ids; tokenization is serve/core/text.py's.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from serve.core.text import DIRECTIONS
from serve.errors import ValidationError, quote


def check_positive(value: int | None, field: str) -> None:
    """A count a call may set (max_tokens, max_tokens_per_doc, top_k, top_n): None or at least 1."""
    if value is not None and value < 1:
        raise ValidationError(f"{field}: expected a positive integer, got {value}")


@dataclass(frozen=True, slots=True)
class TextOptions:
    """How texts become token rows, for every task that takes texts."""

    truncate: bool = False  # cut a text over the tokenizer's max_length instead of refusing it
    direction: str = "right"  # the end a cut text loses (DIRECTIONS)
    prompt_name: str | None = None  # the export's prompt put before each text; None: its default; "": none
    # the most tokens a text keeps, special tokens and the prompt not counted (Cohere's embed max_tokens): a longer
    # one is cut (from `direction`) when `truncate`, else refused; None: only the tokenizer's max_length applies
    max_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.direction not in DIRECTIONS:
            raise ValidationError(f"truncation_direction: {quote(self.direction)} is not one of "
                                  f"{', '.join(DIRECTIONS)}")
        check_positive(self.max_tokens, "max_tokens")


@dataclass(frozen=True, slots=True)
class Inputs:
    """What a call sends to be encoded: texts (tokenized with `text`), or token ids / features (a tuple of
    [T] / [T, D] arrays, or one block [B, T] / [B, T, D] with each row's length; serve/core/requests.py Work)."""

    texts: tuple[str, ...] = ()
    sequences: tuple[np.ndarray, ...] | np.ndarray = ()
    lengths: np.ndarray | None = None
    text: TextOptions = TextOptions()


def direction(value) -> str:
    """A truncation direction as clients write it ("Right", "left"; None or "": "right"); its values are
    checked by TextOptions."""
    return "right" if value is None or value == "" else value.lower() if isinstance(value, str) else value


def prompt(engine, name: str | None) -> str:
    """The text of prompt `name` (the export's sentence-transformers prompts); None: the model's default
    prompt, if it has one; "": none."""
    metadata = engine.export.metadata
    if name is None:
        name = metadata.default_prompt_name or ""
        if not name:
            return ""
    elif name == "":
        return ""
    if name not in metadata.prompts:
        raise ValidationError(f"prompt_name: {quote(name)} is not one of this model's prompts "
                              f"({', '.join(sorted(metadata.prompts)) or 'it has none'})")
    return metadata.prompts[name]


def tokenizer(engine, field: str = "texts"):
    """The model's tokenizer; ValidationError naming `field` for a model without one."""
    if engine.text is None:
        raise ValidationError(f"{field}: model has no tokenizer; send token ids in `sequences`"
                              if field == "texts" else f"{field}: model has no tokenizer")
    return engine.text


@dataclass(frozen=True, slots=True)
class TextRows:
    """Texts as token rows: int64 [T] ids per row, whether each text was cut, rows per text (1, or a
    chunked text's windows), int64 [T] token type ids per row (pairs; () for single texts: zeros)."""

    sequences: tuple[np.ndarray, ...]
    truncated: tuple[bool, ...]
    chunks: tuple[int, ...] = ()
    types: tuple[np.ndarray, ...] = ()


def text_rows(engine, inputs: Inputs, *, chunk: bool = False, one_mean: bool = True) -> TextRows:
    """`inputs.texts` as token rows (the count limit, the prompt, truncation or chunking). With `chunk`, a text
    over max_length becomes overlapping windows, at most max_batch_size rows in all, which only a request for
    one mean embedding per text (`one_mean`) can take."""
    if len(inputs.sequences):
        raise ValidationError("texts: send either texts or sequences, not both")
    text = tokenizer(engine)
    engine.limits.check_count(len(inputs.texts), "texts")
    options = inputs.text
    if chunk and options.truncate:
        raise ValidationError("texts: chunk and truncate are two answers to a long text; set one")
    if chunk and not one_mean:
        raise ValidationError("texts: chunk=true pools each text's windows into one mean embedding; "
                              "ask for pooling mean and no hidden_states")
    texts, kept = inputs.texts, ()
    if options.max_tokens is not None:
        texts, kept = text.keep(texts, options.max_tokens, cut=options.truncate, direction=options.direction)
    sequences, truncated, chunks = text.encode(texts, truncate=options.truncate, chunk=chunk,
                                               direction=options.direction, prompt=prompt(engine, options.prompt_name))
    if any(kept):
        truncated = tuple(a or b for a, b in zip(truncated, kept))
    if len(sequences) > engine.server.max_batch_size:
        raise ValidationError(
            f"texts: {len(inputs.texts)} texts make {len(sequences)} windows, over "
            f"max_batch_size={engine.server.max_batch_size}; send fewer or shorter texts")
    return TextRows(sequences, truncated, chunks if chunk else ())


def pair_rows(engine, pairs: tuple[tuple[str, str], ...], options: TextOptions,
              fields: tuple[str, str] = ("pairs[{i}][0]", "pairs[{i}][1]"), count_field: str = "pairs") -> TextRows:
    """Sentence pairs (a query and a document, a pair classifier's two texts) as one row each with its token
    type ids; only the second text is ever cut. `fields`: the two texts' names in errors ({i}: the pair);
    `count_field`: what the count limit names."""
    text = tokenizer(engine)
    engine.limits.check_count(len(pairs), count_field)
    sequences, types, truncated = text.encode_pairs(pairs, truncate=options.truncate, direction=options.direction,
                                                    fields=fields)
    return TextRows(sequences, truncated, (), types)


def template_of(engine) -> dict | None:
    """An LLM reranker's prompt template (metadata.json task "template", model/tasks.py), or None."""
    return engine.export.metadata.task.get("template")


def check_untemplated(engine, field: str) -> None:
    """Texts scored by the model's head as they are: refused naming `field` on an LLM reranker, whose texts go
    through its prompt template, which only the rerank verb applies."""
    if template_of(engine) is not None:
        raise ValidationError(f"{field}: model {quote(engine.name)} is an LLM reranker (a prompt template over a "
                              "query and a document); score its pairs with a rerank route (/rerank, /v1/rerank, "
                              "/v2/rerank, Rerank)")


def templated_rows(engine, query: str, documents: tuple[str, ...], options: TextOptions, instruction: str | None,
                   fields: tuple[str, str] = ("query", "documents[{i}]"), count_field: str = "documents") -> TextRows:
    """An LLM reranker's rows: the query and each document in the export's prompt template (with `instruction`,
    None: the template's own); only the document is ever cut (serve/core/text.py encode_templated)."""
    text = tokenizer(engine, count_field)
    engine.limits.check_count(len(documents), count_field)
    sequences, truncated = text.encode_templated(template_of(engine), query, documents, instruction=instruction,
                                                 truncate=options.truncate, direction=options.direction,
                                                 fields=fields)
    return TextRows(sequences, truncated)


def present(text: str, field: str) -> str:
    """`text` when it holds at least one character; ValidationError naming `field` (the one rule of an empty
    text, for every task and every protocol's field readers)."""
    if not text:
        raise ValidationError(f"{field}: empty text; send at least one character")
    return text


def non_empty(texts: tuple[str, ...], field: str, what: str = "text") -> tuple[str, ...]:
    """`texts` when it holds at least one text, each non-empty; ValidationError naming `field` (or `field[i]`)."""
    if not texts:
        raise ValidationError(f"{field}: empty list; send at least one {what}")
    for i, text in enumerate(texts):
        present(text, f"{field}[{i}]")
    return texts
