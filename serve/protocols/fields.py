"""The one family of field readers every adapter reads its request with: a JSON body's fields (OpenAI, TEI,
Cohere, Jina, infinity, KServe v2 REST, the repository API), and KServe v2's request parameters once read as
a dict (`parameter_values`). Each reader takes the value's shape as the vendor sends it (a string or a list of
strings; token ids; a document object) and refuses anything else naming the field and what fits:
`{field}: expected {what}, got {value}`. What the value must then be for the model (non-empty texts, counts,
ranges) is its task verb's (serve/core/tasks/), once.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from serve.core.tasks.inputs import non_empty, present
from serve.errors import ValidationError, quote

BOOL_WORDS = {"true": True, "false": False, "1": True, "0": False}  # KServe v2 parameters sent as strings


def refuse(field: str, what: str, value: Any) -> ValidationError:
    return ValidationError(f"{field}: expected {what}, got {quote(value)}")


def value(body: Mapping, name: str, kinds: tuple[type, ...], default=None, what: str = "", *,
          field: str | None = None):
    """body[name] (`default` when absent or null) when it is one of `kinds` (a bool is never an int);
    ValidationError naming `field` (default: `name`) otherwise."""
    got = body.get(name)
    if got is None:
        return default
    if isinstance(got, kinds) and not (isinstance(got, bool) and bool not in kinds):
        return got
    raise refuse(field or name, what or " or ".join(k.__name__ for k in kinds), got)


def flag(body: Mapping, name: str, default: bool = False, *, field: str | None = None,
         lenient: bool = False) -> bool:
    """A true/false field; `lenient` (KServe v2 parameters) also takes 0/1 and "true"/"false"/"1"/"0"."""
    got = body.get(name)
    if got is None:
        return default
    if isinstance(got, bool):
        return got
    if lenient and isinstance(got, int) and got in (0, 1):
        return bool(got)
    if lenient and isinstance(got, str) and got.lower() in BOOL_WORDS:
        return BOOL_WORDS[got.lower()]
    raise refuse(field or name, "true or false", got)


def integer(body: Mapping, name: str, default: int | None = None, what: str = "an integer", *,
            field: str | None = None, lenient: bool = False) -> int | None:
    """An integer field; `lenient` (KServe v2 parameters) also takes a string of digits."""
    got = body.get(name)
    if got is None:
        return default
    if isinstance(got, int) and not isinstance(got, bool):
        return got
    if lenient and isinstance(got, str):
        try:
            return int(got)
        except ValueError:  # also a string of over 4300 digits (Python's int limit)
            pass
    raise refuse(field or name, what, got)


def string(body: Mapping, name: str, default: str | None = None, *, field: str | None = None) -> str | None:
    return value(body, name, (str,), default, "a string", field=field)


def model(body: Mapping) -> str:
    """The body's `model` ("": the only or default model; admission resolves it)."""
    return string(body, "model", "")


def text(got, field: str) -> str:
    """One text: a non-empty string (the empty-text rule: serve/core/tasks/inputs.py `present`)."""
    if not isinstance(got, str):
        raise refuse(field, "a string", got)
    return present(got, field)


def texts(got, field: str = "inputs") -> tuple[str, ...]:
    """A string, or a non-empty list of strings."""
    if isinstance(got, str):
        return (text(got, field),)
    if not isinstance(got, list) or not got:
        raise refuse(field, "a string or a non-empty list of strings",
                     got) if not isinstance(got, list) else ValidationError(
            f"{field}: expected a string or a non-empty list of strings, got an empty list")
    return tuple(text(v, f"{field}[{i}]") for i, v in enumerate(got))


def documents(got, field: str = "documents", *, objects: bool = False) -> tuple[str, ...]:
    """A rerank's documents: a non-empty list of strings (`objects`: or {"text": ...} objects, as Cohere's and
    Jina's APIs take them)."""
    if not isinstance(got, list):
        raise refuse(field, "a list of strings", got)
    out = []
    for i, item in enumerate(got):
        if objects and isinstance(item, dict):
            if "text" not in item:
                raise ValidationError(f"{field}[{i}]: a document object needs a \"text\" field")
            item = item["text"]
        out.append(text(item, f"{field}[{i}]"))
    return non_empty(tuple(out), field, "document")


def query(got, field: str = "query") -> str:
    if got is None:
        raise ValidationError(f"{field}: missing; send the query the documents are ranked against")
    return text(got, field)


def _ints(row) -> bool:
    return isinstance(row, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in row)


def token_ids(got, field: str = "ids") -> tuple[tuple[int, ...], ...]:
    """Token ids: one list of integers, or a non-empty list of them."""
    if _ints(got) and got:
        return (tuple(got),)
    if not isinstance(got, list) or not got or not all(_ints(row) for row in got):
        raise refuse(field, "a list of token ids or a list of token-id lists", got)
    return tuple(tuple(row) for row in got)


def inputs(body: Mapping, field: str = "input") -> tuple[tuple[str, ...], tuple[np.ndarray, ...]]:
    """What an embedding route takes (body[field]: OpenAI's `input`, TEI's `inputs`) as (texts, token-id
    sequences), exactly one of them non-empty: a string, a list of strings, a list of token ids or a list of
    token-id lists."""
    if field not in body:
        raise ValidationError(f"{field}: missing; send a string, a list of strings or token-id lists")
    got = body[field]
    if isinstance(got, str):
        return (got,), ()
    if not isinstance(got, list) or not got:
        raise ValidationError(f"{field}: expected a string, a list of strings, a list of token ids or a list of "
                              f"token-id lists, got {quote(got) if not isinstance(got, list) else 'an empty list'}")
    if all(isinstance(v, str) for v in got):
        return tuple(got), ()
    if _ints(got):
        got = [got]  # one token-id list
    sequences = []
    for i, ids in enumerate(got):
        if not _ints(ids):
            raise ValidationError(f"{field}[{i}]: expected a string or a list of integer token ids, got {quote(ids)}; "
                                  "one request holds strings or token ids, not both")
        try:
            sequences.append(np.asarray(ids, np.int64))
        except OverflowError:
            raise ValidationError(f"{field}[{i}]: a token id does not fit in 64 bits") from None
    return (), tuple(sequences)


def parameter_values(parameters) -> dict:
    """A protobuf map of KServe v2's InferParameter (or the repository's ModelRepositoryParameter) as
    {key: its value}, for the readers above."""
    out = {}
    for key, parameter in parameters.items():
        which = parameter.WhichOneof("parameter_choice")
        out[key] = None if which is None else getattr(parameter, which)
    return out


def object_of(got, field: str) -> dict:
    """A JSON object field (absent or null: {})."""
    if got is None:
        return {}
    if not isinstance(got, dict):
        raise ValidationError(f"{field}: must be an object")
    return got
