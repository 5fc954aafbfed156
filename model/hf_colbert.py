"""PyLate ColBERT checkpoints: a sentence-transformers directory of a Transformer and PyLate's Dense projection
(pylate.models.Dense.Dense: no bias, no activation), with PyLate's settings in config_sentence_transformers.json.
The projection becomes the encoder's multivector head (model/heads.py), the settings metadata.json's
"multivector" task (model/tasks.py), read as PyLate's ColBERT.__init__ reads them (its defaults where a key is
missing or null).

  PYLATE_DENSE                          modules.json's type of PyLate's projection
  read_projection(directory, modules)   the projection's weight [vector_dim, hidden] (one Dense, no bias)
  colbert_task(directory, config)       the multivector task: markers, lengths, expansion, skiplist ids
"""

from __future__ import annotations

import json
import string
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from model.checkpoint import CheckpointError
from model.config import EncoderConfig
from model.hf_dense import read_dense
from model.hf_heads import PYLATE_DENSE
from model.signature import HEAD_OUTPUT_NAMES
from model.tasks import TaskError, check_task

ST_CONFIG = "config_sentence_transformers.json"
# PyLate's defaults (ColBERT.__init__) for a setting its config does not give
DEFAULTS: dict[str, Any] = {"query_prefix": "[Q] ", "document_prefix": "[D] ", "query_length": 32,
                            "document_length": 180, "do_query_expansion": True, "attend_to_expansion_tokens": False,
                            "skiplist_words": list(string.punctuation)}


def read_projection(directory: Path, modules: Sequence[tuple[str | None, dict]]) -> np.ndarray:
    """The weight [vector_dim, hidden] of the one PyLate Dense module after the Transformer; refuses a chain of
    them, a bias or an activation (the head computes a plain projection)."""
    paths = [directory / entry.get("path", "") for kind, entry in modules if kind == PYLATE_DENSE]
    if len(paths) != 1:
        raise CheckpointError(f"{directory}: a ColBERT checkpoint needs exactly one {PYLATE_DENSE} module, has "
                              f"{len(paths)}")
    layer = read_dense(paths[0])
    if layer.bias is not None or layer.activation != "identity":
        raise CheckpointError(f"{paths[0]}: the ColBERT projection must have no bias and no activation "
                              f"(bias={layer.bias is not None}, activation={layer.activation!r})")
    return layer.weight


def colbert_task(directory: Path, config: EncoderConfig) -> dict:
    """metadata.json's multivector task from PyLate's settings, ids by the checkpoint's tokenizer (as PyLate's
    convert_tokens_to_ids: a word outside the vocabulary is the unknown token's id)."""
    from transformers import AutoTokenizer

    path = directory / ST_CONFIG
    saved = json.loads(path.read_text()) if path.is_file() else {}
    settings = {key: default if saved.get(key) is None else saved[key] for key, default in DEFAULTS.items()}
    if not settings["do_query_expansion"]:
        settings["attend_to_expansion_tokens"] = False  # as PyLate: no expansion tokens to attend to
    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    expansion = tokenizer.mask_token_id if tokenizer.mask_token_id is not None else tokenizer.pad_token_id
    if expansion is None:
        raise CheckpointError(f"{directory}: its tokenizer has no [MASK] (nor pad) token to expand queries with")

    def marker(prefix: str) -> int | None:
        return None if prefix == "" else int(tokenizer.convert_tokens_to_ids(prefix))

    task = {"kind": "multivector", "output": HEAD_OUTPUT_NAMES["multivector"],
            "query_marker_id": marker(settings["query_prefix"]),
            "document_marker_id": marker(settings["document_prefix"]),
            "query_length": int(settings["query_length"]), "document_length": int(settings["document_length"]),
            "query_expansion": bool(settings["do_query_expansion"]),
            "attend_to_expansion_tokens": bool(settings["attend_to_expansion_tokens"]),
            "expansion_id": int(expansion),
            "skiplist_ids": sorted({int(tokenizer.convert_tokens_to_ids(w)) for w in settings["skiplist_words"]})}
    try:
        return check_task(task, config)
    except TaskError as exc:
        raise CheckpointError(f"{path}: {exc}") from exc
