"""Output encodings of pooled embeddings, chosen per request: the one home of their names, their ranges and
their arithmetic (serve/core/tasks/encode.py applies them inside the verb; the protocols only pick the
names their vendor spells and render the arrays).

  encoding  per value of a D-wide embedding                                   bytes per vector
  float     float32                                                           4 D
  base64    float32, little-endian, the bytes base64-encoded (OpenAI's        4 ceil(4 D / 3) characters
            `encoding_format`, Cohere's `base64`): a JSON rendering of float
  int8      floor((x - lo) / step) clipped to 0..255, minus 128, int8          D
  uint8     floor((x - lo) / step) clipped to 0..255, uint8                   D
  binary    packbits(x > 0) - 128, int8: 8 values a byte, the first value     ceil(D / 8)
            the byte's high bit, the last byte zero-padded
  ubinary   packbits(x > 0), uint8                                            ceil(D / 8)

The arithmetic is sentence-transformers' `quantize_embeddings(embeddings, precision, ranges=RANGES)`, exactly
(tests/test_output_encodings.py holds us to it). Its `step` is (hi - lo) / 255 per dimension.

The ranges of int8 and uint8 are FIXED: lo = -1 and hi = 1 in every dimension (`ranges`). quantize_embeddings
with no ranges calibrates on the batch it is given (each dimension's min and max), which on a server would
make one text's vector depend on the other texts of its request, and is undefined for a request of one text.
A unit-length (L2-normalised) embedding has every value in [-1, 1], so these ranges never clip it, hold for
any model and any `dimensions` cut, and make a stored vector independent of how it was batched: which is why
int8 and uint8 need normalised embeddings (the verb refuses them otherwise). The price: a normalised
embedding's values are mostly small (about 1 / sqrt(D)), so a fixed [-1, 1] range uses fewer of the 256
steps than a range calibrated on the model's own embeddings would. binary and ubinary need no range (the
sign of each value) and fit any embedding.
"""

from __future__ import annotations

import base64

import numpy as np

from serve.errors import ValidationError, quote

FLOAT = "float"
ENCODINGS = ("float", "base64", "int8", "uint8", "binary", "ubinary")  # every name, in this order
TENSOR_ENCODINGS = ("float", "int8", "uint8", "binary", "ubinary")  # what a tensor carries (base64 is JSON's)
QUANTIZED = ("int8", "uint8", "binary", "ubinary")
SCALAR = ("int8", "uint8")  # the ones that need RANGE, and so normalised embeddings
RANGE = (-1.0, 1.0)  # int8 / uint8: the fixed range of every dimension (module docstring)


def names(asked, field: str, allowed: tuple[str, ...] = ENCODINGS, *, listed: bool = False) -> tuple[str, ...]:
    """The encodings `asked` (one name, or a list of them; `listed`: a list only) as a tuple, each once in the
    order asked; ValidationError naming `field` (`field[i]` for a list) and the names that fit."""
    items = [asked] if isinstance(asked, str) and not listed else asked
    if not isinstance(items, list) or not items:
        what = f"a non-empty list of {', '.join(allowed)}" if listed else \
            f"one of {', '.join(allowed)} or a non-empty list of them"
        raise ValidationError(f"{field}: expected {what}, "
                              f"got {quote(asked) if not isinstance(asked, list) else 'an empty list'}")
    out: list[str] = []
    for i, name in enumerate(items):
        where = field if isinstance(asked, str) else f"{field}[{i}]"
        if name not in allowed:
            raise ValidationError(f"{where}: {quote(name)} is not one of {', '.join(allowed)}")
        if name not in out:
            out.append(name)
    return tuple(out)


def width(name: str, dimensions: int) -> int:
    """Values per encoded vector of a `dimensions`-wide embedding (bytes, for the quantized ones)."""
    return -(-dimensions // 8) if name in ("binary", "ubinary") else dimensions


def ranges(dimensions: int) -> np.ndarray:
    """The int8 / uint8 ranges, as quantize_embeddings takes them: float32 [2, D], row 0 the minimum of each
    dimension, row 1 its maximum."""
    return np.array([[RANGE[0]] * dimensions, [RANGE[1]] * dimensions], np.float32)


def encode(embeddings: np.ndarray, name: str) -> np.ndarray:
    """float32 [n, D] embeddings in encoding `name`: float32 [n, D] (float, base64), int8 / uint8 [n, D], or
    int8 / uint8 [n, ceil(D / 8)] (binary, ubinary)."""
    embeddings = np.asarray(embeddings, np.float32)
    if name in (FLOAT, "base64"):
        return embeddings.astype("<f4", copy=False)
    if name in SCALAR:
        bounds = ranges(embeddings.shape[-1])
        starts = bounds[0]
        steps = (bounds[1] - starts) / 255
        steps = np.where(steps == 0, 1, steps)
        buckets = np.clip(np.floor((embeddings - starts) / steps), 0, 255)
        return buckets.astype(np.uint8) if name == "uint8" else (buckets - 128).astype(np.int8)
    packed = np.packbits(embeddings > 0, axis=-1)
    if name == "ubinary":
        return packed
    if name == "binary":
        return (packed.astype(np.int16) - 128).astype(np.int8)
    raise ValueError(f"unknown encoding {name!r}")  # names() lets no other name through


def base64_rows(vectors: np.ndarray) -> list[str]:
    """Each float32 row as base64 of its little-endian bytes (OpenAI's and Cohere's base64)."""
    vectors = np.ascontiguousarray(vectors, "<f4")
    return [base64.b64encode(row.tobytes()).decode() for row in vectors]
