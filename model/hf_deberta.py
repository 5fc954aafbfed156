"""The DeBERTa-v2 / v3 family (model_type deberta-v2; transformers' DebertaV2Model: deberta-v3-base/large/xsmall,
mDeBERTa-v3, deberta-v2-xlarge without its conv layer, the DeBERTa-v3 cross-encoders and NLI classifiers): its
checkpoint ⇄ encoder names, config.json → EncoderConfig, its classification head.

  deberta-v2  BERT's post-norm layers under other names (attention.self.query_proj/key_proj/value_proj), the
              exact GELU, word embeddings (+ learned positions 0, 1, ... when position_biased_input, + token
              types when type_vocab_size > 0) -> LayerNorm, and disentangled attention (config
              disentangled_terms, model/disentangled_attention.py): pos_att_type's c2p / p2c terms from one
              relative position table (encoder.rel_embeddings, its LayerNorm when norm_rel_ebd has
              "layer_norm") in log buckets (position_buckets up to max_relative_positions), projected by each
              layer's pos_key_proj / pos_query_proj or, with share_att_key, its key / query projections; every
              score scaled by 1 / sqrt(head_dim · (1 + number of pos_att_type terms)) (scaling="temperature").
  head        ContextPooler + classifier: the first token -> pooler.dense -> pooler_hidden_act -> classifier

Not reproduced, and invisible at real tokens: DebertaV2Embeddings multiplies the embeddings by the attention
mask (zero at padding), whose keys no real query attends to.

Refused, naming it: embedding_size other than hidden_size (embed_proj), conv_kernel_size > 0 (deberta-v2-xlarge's
ConvLayer), attention_head_size other than hidden_size / num_attention_heads, pos_att_type terms other than
c2p / p2c, relative_attention without pos_att_type (or norm_rel_ebd without relative_attention),
pooler_hidden_size other than hidden_size, an activation other than the exact GELU or ReLU (pooler_hidden_act:
GELU, tanh or ReLU).

Loaded by the shared strict loader (model/hf_pretrained.py) through `FAMILY`.
"""

from __future__ import annotations

import math
import re
from typing import Any, Mapping

from model.checkpoint import CheckpointError
from model.config import DISENTANGLED_TERMS, HEAD_ACTIVATIONS, EncoderConfig
from model.hf_bert import BERT_ACTIVATIONS, BERT_EMBEDDING_NAMES, BERT_LAYER_MODULES
from model.hf_family import Family, encoder_config, require, table_maps

DEBERTA_TYPE = "deberta-v2"
# Task models (DebertaV2ForSequenceClassification, ...ForMaskedLM) prefix the encoder's names with this.
DEBERTA_PREFIX = "deberta."
# BERT's embeddings, and the relative position table every layer shares with its LayerNorm.
DEBERTA_NAMES: Mapping[str, str] = {
    **BERT_EMBEDDING_NAMES,
    "encoder.rel_embeddings.weight": "relative_embeddings.weight",
    "encoder.LayerNorm.weight": "relative_embeddings.norm.weight",
    "encoder.LayerNorm.bias": "relative_embeddings.norm.bias",
}
# BERT's layer modules (under encoder.layer.{i}. -> layers.{i}.), the attention's under DeBERTa's names, and
# the layer's position projections.
_DEBERTA_ATTENTION = {"attention.self.query": "attention.self.query_proj",
                      "attention.self.key": "attention.self.key_proj",
                      "attention.self.value": "attention.self.value_proj"}
DEBERTA_LAYER_MODULES: Mapping[str, str] = {
    **{_DEBERTA_ATTENTION.get(bert, bert): ours for bert, ours in BERT_LAYER_MODULES.items()},
    "attention.self.pos_key_proj": "attention.disentangled.pos_key_proj",
    "attention.self.pos_query_proj": "attention.disentangled.pos_query_proj",
}
# A buffer (position_ids = arange) and the heads on top of the encoder (the MLM heads, new and legacy; the
# classifiers', whose sequence classifier the head loads).
DEBERTA_IGNORED_NAMES = ("embeddings.position_ids",)
DEBERTA_IGNORED_PREFIXES = ("pooler.", "classifier.", "cls.", "lm_predictions.", "mask_predictions.", "qa_outputs.")
_LAYER_NAME = re.compile(r"^encoder\.layer\.(\d+)\.(.+)\.(weight|bias)$")

deberta_to_encoder, encoder_to_deberta_name = table_maps(DEBERTA_NAMES, DEBERTA_LAYER_MODULES, _LAYER_NAME,
                                                         "encoder.layer.{index}.{module}.{suffix}")


def _refuse_unless(condition: bool, message: str) -> None:
    if not condition:
        raise CheckpointError(message)


def position_terms(hf: Mapping[str, Any]) -> tuple[str, ...]:
    """pos_att_type's terms ("p2c|c2p" or a list, as DebertaV2Config reads it), refusing any other."""
    declared = hf.get("pos_att_type") or []
    if isinstance(declared, str):
        declared = [term.strip() for term in declared.lower().split("|")]
    unknown = [term for term in declared if term not in DISENTANGLED_TERMS]
    _refuse_unless(not unknown, f"pos_att_type {unknown[0] if unknown else ''!r} is not supported; expected "
                                f"{' / '.join(DISENTANGLED_TERMS)} (DebertaV2Model computes no other)")
    return tuple(term for term in DISENTANGLED_TERMS if term in declared)


def deberta_config(hf: Mapping[str, Any], name: str, source: Mapping[str, Any] = ()) -> EncoderConfig:
    """EncoderConfig for a DeBERTa-v2 / v3 config.json; refuses what the encoder does not compute, naming it."""
    require(hf, ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size", "vocab_size",
                 "max_position_embeddings"))
    hidden, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    act = hf.get("hidden_act", "gelu")
    _refuse_unless(act in BERT_ACTIVATIONS, f"hidden_act {act!r} is not supported; expected one of "
                                            f"{', '.join(BERT_ACTIVATIONS)}")
    embedding = int(hf.get("embedding_size") or hidden)
    _refuse_unless(embedding == hidden, f"embedding_size {embedding} is not supported; expected hidden_size {hidden} "
                                        "(no embedding projection, embed_proj)")
    conv = int(hf.get("conv_kernel_size") or 0)
    _refuse_unless(conv <= 0, f"conv_kernel_size {conv} is not supported; expected 0 (no ConvLayer after the first "
                              "layer, as deberta-v2-xlarge has)")
    head_size = int(hf.get("attention_head_size") or hidden // heads)
    _refuse_unless(head_size * heads == hidden, f"attention_head_size {head_size} is not supported; expected "
                                                f"hidden_size / num_attention_heads = {hidden // heads}")
    terms = position_terms(hf)
    relative = bool(hf.get("relative_attention", False))
    _refuse_unless(terms or not relative, "relative_attention without pos_att_type is not supported (a position "
                                          "table no term reads)")
    buckets = int(hf.get("position_buckets", -1))
    max_relative = int(hf.get("max_relative_positions", -1))
    norms = [part.strip() for part in str(hf.get("norm_rel_ebd") or "none").lower().split("|")]
    _refuse_unless(relative or "layer_norm" not in norms, "norm_rel_ebd 'layer_norm' without relative_attention is "
                                                          "not supported (a LayerNorm of no position table)")
    return encoder_config(
        hf, name, source,
        max_positions=int(hf["max_position_embeddings"]),
        type_vocab_size=int(hf.get("type_vocab_size", 0)),
        layer_norm_eps=float(hf.get("layer_norm_eps", 1e-7)),
        norm_placement="post",
        positional="learned" if hf.get("position_biased_input", True) else "none",
        activation=BERT_ACTIVATIONS[act],
        # q·k, c2p and p2c alike: / sqrt(head_dim · (1 + terms)), pos_att_type counted even without relative_attention
        scaling="temperature",
        temperature=math.sqrt(head_size * (1 + len(terms))),
        disentangled_terms=terms if relative else (),
        disentangled_buckets=max(buckets, 0),
        disentangled_max_distance=max_relative if max_relative >= 1 else int(hf["max_position_embeddings"]),
        disentangled_share_key=bool(hf.get("share_att_key", False)),
        disentangled_norm="layer_norm" in norms,
    )


# The sequence classifier: ContextPooler's dense, then the classifier.
DEBERTA_HEADS: Mapping[str, Mapping[str, str]] = {
    "classification": {"pooler.dense": "head.dense", "classifier": "head.out"},
}


def deberta_head_config(hf: Mapping[str, Any], head: str) -> dict[str, Any]:
    """ContextPooler: the first token, dense (pooler_hidden_size must be hidden_size), pooler_hidden_act, no norm."""
    pooler = int(hf.get("pooler_hidden_size") or hf["hidden_size"])
    _refuse_unless(pooler == int(hf["hidden_size"]), f"pooler_hidden_size {pooler} is not supported; expected "
                                                     f"hidden_size {hf['hidden_size']}")
    act = hf.get("pooler_hidden_act", "gelu")
    _refuse_unless(act in HEAD_ACTIVATIONS, f"pooler_hidden_act {act!r} is not supported; expected one of "
                                            f"{', '.join(HEAD_ACTIVATIONS)}")
    return dict(head_pooling="cls", head_activation=act, head_norm=False, head_bias=True, head_out_bias=True)


FAMILY = Family(
    model_types=(DEBERTA_TYPE,),
    prefix=DEBERTA_PREFIX,
    config=deberta_config,
    to_encoder=deberta_to_encoder,
    name_in_checkpoint=encoder_to_deberta_name,
    ignored_names=DEBERTA_IGNORED_NAMES,
    ignored_prefixes=DEBERTA_IGNORED_PREFIXES,
    heads=DEBERTA_HEADS,
    head_config=deberta_head_config,
)
