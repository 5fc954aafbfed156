"""bge-m3 (FlagEmbedding's BGEM3FlagModel): an XLM-RoBERTa checkpoint with colbert_linear.pt and sparse_linear.pt
beside it, its three outputs from one encoder run. The two linears become the encoder's m3 head (model/heads.py),
the special tokens its lexical weights leave out metadata.json's "m3" task (model/tasks.py).

  M3_FILES                 the two head files that make a directory a bge-m3 one
  is_m3(directory)         whether it has them
  read_m3_head(directory)  their tensors in our names, every shape checked (colbert: D -> D, sparse: D -> 1)
  m3_task(directory, cfg)  the m3 task: the ids of the cls, eos, pad and unk tokens (FlagEmbedding's unused_tokens)
"""

from __future__ import annotations

from pathlib import Path

import torch

from model.checkpoint import CheckpointError
from model.config import EncoderConfig
from model.signature import HEAD_OUTPUT_NAMES
from model.tasks import TaskError, check_task

M3_FILES = {"colbert_linear.pt": "head.colbert", "sparse_linear.pt": "head.sparse"}
# FlagEmbedding's _process_token_weights: these special tokens carry no lexical weight
UNUSED_TOKENS = ("cls_token", "eos_token", "pad_token", "unk_token")


def is_m3(directory: Path) -> bool:
    return all((directory / name).is_file() for name in M3_FILES)


def read_m3_head(directory: Path, d_model: int) -> dict[str, torch.Tensor]:
    """head.colbert.{weight [D, D], bias [D]} and head.sparse.{weight [1, D], bias [1]} from the two files; a
    CheckpointError naming the file and tensor that does not fit (a colbert_dim other than D is not served)."""
    ours, wrong = {}, []
    widths = {"head.colbert": d_model, "head.sparse": 1}
    for name, prefix in M3_FILES.items():
        tensors = torch.load(directory / name, map_location="cpu", weights_only=True)
        expected = {"weight": (widths[prefix], d_model), "bias": (widths[prefix],)}
        for key, shape in expected.items():
            found = tensors.get(key)
            if found is None or tuple(found.shape) != shape:
                wrong.append(f"{name} {key}: {None if found is None else list(found.shape)} (expected {list(shape)})")
            else:
                ours[f"{prefix}.{key}"] = found.float()
        wrong += [f"{name} {key} (not used)" for key in tensors if key not in expected]
    if wrong:
        raise CheckpointError(f"{directory}: bge-m3 head files do not fit the encoder: {'; '.join(wrong)}")
    return ours


def m3_task(directory: Path, config: EncoderConfig) -> dict:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    special = tokenizer.special_tokens_map
    unused = sorted({int(tokenizer.convert_tokens_to_ids(special[t])) for t in UNUSED_TOKENS if t in special})
    try:
        return check_task({"kind": "m3", "output": HEAD_OUTPUT_NAMES["m3"], "unused_ids": unused}, config)
    except TaskError as exc:
        raise CheckpointError(f"{directory}: {exc}") from exc
