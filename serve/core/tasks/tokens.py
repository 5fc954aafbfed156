"""The tokenize and decode verbs: a model's tokenizer, without running the model (TEI's /tokenize and
/decode, encoder.v1 Tokenize). Answered at once, on the caller's thread."""

from __future__ import annotations

from dataclasses import dataclass

from serve.core.tasks.inputs import non_empty, prompt, tokenizer


@dataclass(frozen=True, slots=True)
class TokenizeTask:
    texts: tuple[str, ...]
    add_special_tokens: bool = True
    prompt_name: str | None = None  # None: the model's default prompt; "": none
    field: str = "texts"  # how errors name the texts


@dataclass(frozen=True, slots=True)
class DecodeTask:
    ids: tuple[tuple[int, ...], ...]  # token ids, one list per text
    skip_special_tokens: bool = True
    field: str = "ids"


def tokenize(engine, task: TokenizeTask) -> list[list[dict]]:
    """Each text's tokens: id, text, special, start, stop (serve/core/text.py `tokens`)."""
    texts = non_empty(task.texts, task.field)
    engine.limits.check_count(len(texts), task.field)
    return tokenizer(engine, task.field).tokens(texts, add_special_tokens=task.add_special_tokens,
                                                prompt=prompt(engine, task.prompt_name))


def decode(engine, task: DecodeTask) -> list[str]:
    """Token ids back to text, one string per list."""
    engine.limits.check_count(len(task.ids), task.field)
    return tokenizer(engine, task.field).decode(task.ids, skip_special_tokens=task.skip_special_tokens,
                                                field=task.field)
