"""The MPNet family (transformers' MPNetModel: all-mpnet-base-v2, multi-qa-mpnet-base-*): its checkpoint ⇄
encoder names, config.json → EncoderConfig.

  mpnet  BERT's post-norm layers under other names (attention.attn.q/k/v/o), learned positions numbered
         RoBERTa's way after id 1 (position_ids="after_padding"), no token types, and relative position
         buckets: one Embedding(32 buckets, heads) shared by every layer, its per-head bias added to the
         softmax scores after scaling (config relative_attention_buckets; model/relative_positions.py)

Refused, naming it: a pad_token_id other than 1 (transformers' MPNetEmbeddings numbers positions after id 1
whatever config.json says), relative_attention_num_buckets other than 32 (MPNetEncoder computes 32 buckets
whatever its table holds), an activation other than the exact GELU or ReLU.

Loaded by the shared strict loader (model/hf_pretrained.py) through `FAMILY`.
"""

from __future__ import annotations

import re
from typing import Any, Mapping

from model.checkpoint import CheckpointError
from model.config import EncoderConfig
from model import hf_roberta
from model.hf_bert import BERT_ACTIVATIONS, BERT_EMBEDDING_NAMES, BERT_LAYER_MODULES
from model.hf_family import Family, encoder_config, require, table_maps

MPNET_TYPE = "mpnet"
# Task models (MPNetForMaskedLM, MPNetForSequenceClassification, ...) prefix the encoder's names with this.
MPNET_PREFIX = "mpnet."
# BERT's embeddings but token types, and the relative bias table every layer shares.
MPNET_NAMES: Mapping[str, str] = {
    **{theirs: ours for theirs, ours in BERT_EMBEDDING_NAMES.items() if "token_type" not in theirs},
    "encoder.relative_attention_bias.weight": "relative_attention_bias.weight",
}
# BERT's layer modules (under encoder.layer.{i}. -> layers.{i}.), its attention's under MPNet's names.
_MPNET_ATTENTION = {"attention.self.query": "attention.attn.q", "attention.self.key": "attention.attn.k",
                    "attention.self.value": "attention.attn.v", "attention.output.dense": "attention.attn.o",
                    "attention.output.LayerNorm": "attention.LayerNorm"}
MPNET_LAYER_MODULES: Mapping[str, str] = {_MPNET_ATTENTION.get(bert, bert): ours
                                          for bert, ours in BERT_LAYER_MODULES.items()}
# A buffer (position_ids = arange) and the heads on top of the encoder (MPNetModel's [CLS] pooler, the MLM head).
MPNET_IGNORED_NAMES = ("embeddings.position_ids",)
MPNET_IGNORED_PREFIXES = ("pooler.", "lm_head.", "classifier.", "qa_outputs.")
# What transformers' MPNet fixes in code, whatever config.json says.
MPNET_PAD_ID = 1  # MPNetEmbeddings.padding_idx: positions count from 2
MPNET_BUCKETS = 32  # MPNetEncoder.compute_position_bias(num_buckets=32)
MPNET_MAX_DISTANCE = 128  # relative_position_bucket(max_distance=128)
_LAYER_NAME = re.compile(r"^encoder\.layer\.(\d+)\.(.+)\.(weight|bias)$")


# (MPNet's layers are encoder.layer.{i}.{module}.{suffix}, as BERT's)
mpnet_to_encoder, encoder_to_mpnet_name = table_maps(MPNET_NAMES, MPNET_LAYER_MODULES, _LAYER_NAME,
                                                     "encoder.layer.{index}.{module}.{suffix}")


def mpnet_config(hf: Mapping[str, Any], name: str, source: Mapping[str, Any] = ()) -> EncoderConfig:
    """EncoderConfig for an MPNet config.json; refuses what the encoder does not compute, naming it."""
    act = hf.get("hidden_act", "gelu")
    if act not in BERT_ACTIVATIONS:
        raise CheckpointError(f"hidden_act {act!r} is not supported; expected one of {', '.join(BERT_ACTIVATIONS)} "
                              "(the tanh GELU approximations are not the encoder's exact GELU)")
    buckets = int(hf.get("relative_attention_num_buckets", MPNET_BUCKETS))
    if buckets != MPNET_BUCKETS:
        raise CheckpointError(f"relative_attention_num_buckets {buckets} is not supported; expected {MPNET_BUCKETS} "
                              "(transformers' MPNetEncoder computes 32 buckets whatever its table holds)")
    pad = hf.get("pad_token_id", MPNET_PAD_ID)
    if pad != MPNET_PAD_ID:
        raise CheckpointError(f"pad_token_id {pad} is not supported; expected {MPNET_PAD_ID} (transformers' "
                              "MPNetEmbeddings numbers positions after id 1 whatever config.json says)")
    require(hf, ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size", "vocab_size",
                 "max_position_embeddings"))
    return encoder_config(
        hf, name, source,
        pad_token_id=MPNET_PAD_ID,
        max_positions=int(hf["max_position_embeddings"]),
        type_vocab_size=0,
        layer_norm_eps=float(hf.get("layer_norm_eps", 1e-12)),
        norm_placement="post",
        positional="learned",
        position_ids="after_padding",
        activation=BERT_ACTIVATIONS[act],
        relative_attention_buckets=MPNET_BUCKETS,
        relative_attention_max_distance=MPNET_MAX_DISTANCE,
    )


FAMILY = Family(
    model_types=(MPNET_TYPE,),
    prefix=MPNET_PREFIX,
    config=mpnet_config,
    to_encoder=mpnet_to_encoder,
    name_in_checkpoint=encoder_to_mpnet_name,
    ignored_names=MPNET_IGNORED_NAMES,
    ignored_prefixes=MPNET_IGNORED_PREFIXES,
    heads=hf_roberta.ROBERTA_HEADS,  # MPNet's classifier and lm_head have RoBERTa's names
    head_config=hf_roberta.roberta_head_config,
)
