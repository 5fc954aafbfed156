"""Tokenizer helpers shared by the exporter side and the server: `tokenizers` and numpy only, no torch.

A packaged tokenizer.json carries its own truncation and padding settings (all-MiniLM-L6-v2's say:
fixed length 128). Both are always replaced here: the length limit is the export's `max_length`
(metadata.json "tokenizer"), and padding, when wanted, is to the longest text of the batch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np


class TokenizerError(ValueError):
    """A tokenizer file that cannot be used as asked; the message names the file."""


def read_tokenizer(tokenizer_file: str | Path):
    """tokenizer.json as a `tokenizers.Tokenizer` with the file's truncation and padding removed."""
    from tokenizers import Tokenizer

    try:
        tokenizer = Tokenizer.from_file(str(tokenizer_file))
    except Exception as error:  # tokenizers raises its own Exception type for unreadable files
        raise TokenizerError(f"{tokenizer_file}: cannot load tokenizer: {error}") from error
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return tokenizer


def load_tokenizer(tokenizer_file: str | Path, max_length: int, pad_id: int = 0):
    """tokenizer.json with truncation to `max_length` and padding to the longest in the batch."""
    tokenizer = read_tokenizer(tokenizer_file)
    pad_token = tokenizer.id_to_token(pad_id)
    if pad_token is None:
        raise TokenizerError(f"{tokenizer_file}: pad id {pad_id} is not in the vocabulary")
    tokenizer.enable_truncation(max_length=max_length)
    tokenizer.enable_padding(direction="right", pad_id=pad_id, pad_type_id=0, pad_token=pad_token)
    return tokenizer


def tokenize(tokenizer, texts: Sequence[str | tuple[str, str]]) -> dict[str, np.ndarray]:
    """input_ids, attention_mask, token_type_ids as int64 arrays (B, T) for a batch of texts; an entry may be a
    (text, text) pair, joined as the tokenizer's post-processor does ([CLS] a [SEP] b [SEP], type ids 1 on b)."""
    encodings = tokenizer.encode_batch(list(texts))
    return {
        "input_ids": np.asarray([e.ids for e in encodings], dtype=np.int64),
        "attention_mask": np.asarray([e.attention_mask for e in encodings], dtype=np.int64),
        "token_type_ids": np.asarray([e.type_ids for e in encodings], dtype=np.int64),
    }
