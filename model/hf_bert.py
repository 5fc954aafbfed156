"""The BERT family (MiniLM & co.): BertModel's checkpoint ⇄ encoder names, config.json → EncoderConfig.

  bert   post-norm, learned positions 0, 1, 2, ..., token types, biases everywhere

Loaded by the shared strict loader (model/hf_pretrained.py) through `FAMILY`; RoBERTa / XLM-RoBERTa
(model/hf_roberta.py) reuse these names and this config reading.
"""

from __future__ import annotations

import re
from typing import Any, Mapping

import torch

from model.checkpoint import CheckpointError
from model.config import EncoderConfig
from model.hf_family import Family, Mapped, checkpoint_name, encoder_config, require

# --------------------------------------------------------------------------------------------
# The BERT name mapping, written down once, as data.
# Checkpoint (Hugging Face BertModel) name -> our `Encoder` state-dict name. Per-layer entries
# are module prefixes under `encoder.layer.{i}.` -> `layers.{i}.`; the parameter suffix
# (`.weight` / `.bias`) is carried over unchanged.
BERT_EMBEDDING_NAMES: Mapping[str, str] = {
    "embeddings.word_embeddings.weight": "embeddings.tokens.weight",
    "embeddings.position_embeddings.weight": "embeddings.positions.weight",
    "embeddings.token_type_embeddings.weight": "embeddings.token_types.weight",
    "embeddings.LayerNorm.weight": "embeddings.norm.weight",
    "embeddings.LayerNorm.bias": "embeddings.norm.bias",
}
BERT_LAYER_MODULES: Mapping[str, str] = {
    "attention.self.query": "attention.q_proj",
    "attention.self.key": "attention.k_proj",
    "attention.self.value": "attention.v_proj",
    "attention.output.dense": "attention.out_proj",
    "attention.output.LayerNorm": "attention_norm",
    "intermediate.dense": "ffn.up",
    "output.dense": "ffn.down",
    "output.LayerNorm": "ffn_norm",
}
# Checkpoint tensors we knowingly do not use: a buffer (position_ids = arange) and heads that sit
# on top of the encoder (BertModel's [CLS] pooler; MLM / NSP / classification heads).
BERT_IGNORED_NAMES = ("embeddings.position_ids", "embeddings.token_type_ids")
BERT_IGNORED_PREFIXES = ("pooler.", "cls.", "classifier.", "qa_outputs.")
# Task-model checkpoints (BertForMaskedLM, ...) prefix the encoder's names with this.
BERT_PREFIX = "bert."
# Very old BERT checkpoints name LayerNorm parameters gamma / beta.
_LEGACY_SUFFIXES = {".gamma": ".weight", ".beta": ".bias"}
_LAYER_NAME = re.compile(r"^encoder\.layer\.(\d+)\.(.+)\.(weight|bias)$")

# HF `hidden_act` -> our activation. HF "gelu" is the exact (erf) GELU, as ours; the tanh
# approximations ("gelu_new", "gelu_pytorch_tanh", ...) are refused rather than silently changed.
BERT_ACTIVATIONS: Mapping[str, str] = {"gelu": "gelu", "relu": "relu"}


def bert_to_encoder_name(name: str) -> str | None:
    """Our state-dict name for a BertModel tensor name, or None when it has no counterpart."""
    for old, new in _LEGACY_SUFFIXES.items():
        if name.endswith(old):
            name = name[: -len(old)] + new
    if name in BERT_EMBEDDING_NAMES:
        return BERT_EMBEDDING_NAMES[name]
    match = _LAYER_NAME.match(name)
    if match and match.group(2) in BERT_LAYER_MODULES:
        index, module, suffix = match.groups()
        return f"layers.{index}.{BERT_LAYER_MODULES[module]}.{suffix}"
    return None


def bert_to_encoder(name: str, tensor: torch.Tensor) -> Mapped:
    """[(our name, tensor, name)] for a BertModel tensor; [] when it has no counterpart."""
    target = bert_to_encoder_name(name)
    return [(target, tensor, name)] if target is not None else []


def encoder_to_bert_name(name: str) -> str | None:
    """The inverse of `bert_to_encoder_name` (for messages about tensors a checkpoint lacks)."""
    return checkpoint_name(name, BERT_EMBEDDING_NAMES, BERT_LAYER_MODULES, "encoder.layer.{index}.{module}.{suffix}")


# --------------------------------------------------------------------------------------------
# config.json


def check_bert_config(hf: Mapping[str, Any]) -> None:
    """Refuses a BERT-layout config.json the encoder cannot compute (activation, positions, decoder,
    missing sizes), naming it."""
    act = hf.get("hidden_act", "gelu")
    if act not in BERT_ACTIVATIONS:
        raise CheckpointError(
            f"hidden_act {act!r} is not supported; expected one of {', '.join(BERT_ACTIVATIONS)} "
            "(the tanh GELU approximations are not the encoder's exact GELU)"
        )
    positions = hf.get("position_embedding_type", "absolute")
    if positions != "absolute":
        raise CheckpointError(f"position_embedding_type {positions!r} is not supported; expected 'absolute'")
    if hf.get("is_decoder") or hf.get("add_cross_attention"):
        raise CheckpointError("decoder / cross-attention BERT configs are not supported (encoder only)")
    require(hf, ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size",
                 "vocab_size", "max_position_embeddings"))


def bert_layout_config(hf: Mapping[str, Any], name: str, source: Mapping[str, Any] = (), *,
                       position_ids: str = "range", **fields: Any) -> EncoderConfig:
    """EncoderConfig of a config.json check_bert_config passed, with the family's position ids and other `fields`
    (ELECTRA's embedding_size)."""
    return encoder_config(
        hf, name, source,
        max_positions=int(hf["max_position_embeddings"]),
        type_vocab_size=int(hf.get("type_vocab_size", 2)),
        layer_norm_eps=float(hf.get("layer_norm_eps", 1e-12)),
        norm_placement="post",
        positional="learned",
        position_ids=position_ids,
        activation=BERT_ACTIVATIONS[hf.get("hidden_act", "gelu")],
        **fields,
    )


def bert_config(hf: Mapping[str, Any], name: str, source: Mapping[str, Any] = ()) -> EncoderConfig:
    """EncoderConfig for a BERT config.json; refuses what the encoder cannot compute, naming it."""
    check_bert_config(hf)
    return bert_layout_config(hf, name, source)


# BERT's task heads: the pooler + classifier of *ForSequenceClassification, the MLM head (cls.predictions) that
# SPLADE reads (its decoder bias is stored twice: either name, or both when equal).
BERT_HEADS: Mapping[str, Mapping[str, str]] = {
    "classification": {"pooler.dense": "head.dense", "classifier": "head.out"},
    "sparse": {"cls.predictions.transform.dense": "head.dense", "cls.predictions.transform.LayerNorm": "head.norm",
               "cls.predictions.decoder": "head.out", "cls.predictions": "head.out"},
}


def bert_head_config(hf: Mapping[str, Any], head: str) -> dict[str, Any]:
    """The classifier: BERT's pooler (the first token, dense, tanh, no norm); the MLM transform: dense, hidden_act
    (checked with the encoder's), LayerNorm."""
    if head == "classification":
        return dict(head_pooling="cls", head_activation="tanh", head_norm=False, head_bias=True, head_out_bias=True)
    return dict(head_activation=hf.get("hidden_act", "gelu"), head_norm=True, head_bias=True, head_out_bias=True)


FAMILY = Family(
    model_types=("bert",),
    prefix=BERT_PREFIX,
    config=bert_config,
    to_encoder=bert_to_encoder,
    name_in_checkpoint=encoder_to_bert_name,
    ignored_names=BERT_IGNORED_NAMES,
    ignored_prefixes=BERT_IGNORED_PREFIXES,
    heads=BERT_HEADS,
    head_config=bert_head_config,
)
