"""The DistilBERT family (transformers' DistilBertModel: distilbert-base-*, its cross-encoders and classifiers):
its checkpoint ⇄ encoder names, config.json → EncoderConfig, its task heads.

  distilbert  BERT's post-norm layers under its own names (transformer.layer.{i}.attention.q_lin/k_lin/v_lin/
              out_lin, sa_layer_norm, ffn.lin1/lin2, output_layer_norm), learned positions 0, 1, 2, ..., no token
              types, every LayerNorm at eps 1e-12 (fixed in transformers' code, not in config.json), and its own
              config keys (dim, n_heads, n_layers, hidden_dim, activation)

sinusoidal_pos_embds=true is loaded as any other: transformers fills the position table with sines at
initialisation and saves it, so the table in the checkpoint is what both compute. Refused, naming it: an
activation other than the exact GELU or ReLU.

Heads: DistilBertForSequenceClassification's first token -> pre_classifier -> ReLU -> classifier; the MLM head
(DistilBertForMaskedLM: vocab_transform -> activation -> vocab_layer_norm -> vocab_projector) as SPLADE's.

Loaded by the shared strict loader (model/hf_pretrained.py) through `FAMILY`.
"""

from __future__ import annotations

import re
from typing import Any, Mapping

from model.checkpoint import CheckpointError
from model.config import EncoderConfig
from model.hf_bert import BERT_ACTIVATIONS
from model.hf_family import Family, encoder_config, require, table_maps

DISTILBERT_TYPE = "distilbert"
# Task models (DistilBertForMaskedLM, DistilBertForSequenceClassification, ...) prefix the encoder's names with this.
DISTILBERT_PREFIX = "distilbert."
DISTILBERT_NAMES: Mapping[str, str] = {
    "embeddings.word_embeddings.weight": "embeddings.tokens.weight",
    "embeddings.position_embeddings.weight": "embeddings.positions.weight",
    "embeddings.LayerNorm.weight": "embeddings.norm.weight",
    "embeddings.LayerNorm.bias": "embeddings.norm.bias",
}
# Per-layer modules under transformer.layer.{i}. -> layers.{i}.
DISTILBERT_LAYER_MODULES: Mapping[str, str] = {
    "attention.q_lin": "attention.q_proj",
    "attention.k_lin": "attention.k_proj",
    "attention.v_lin": "attention.v_proj",
    "attention.out_lin": "attention.out_proj",
    "sa_layer_norm": "attention_norm",
    "ffn.lin1": "ffn.up",
    "ffn.lin2": "ffn.down",
    "output_layer_norm": "ffn_norm",
}
# A buffer (position_ids = arange) and the heads on top of the encoder: MLM, classifier, QA.
DISTILBERT_IGNORED_NAMES = ("embeddings.position_ids",)
DISTILBERT_IGNORED_PREFIXES = ("vocab_transform.", "vocab_layer_norm.", "vocab_projector.", "pre_classifier.",
                               "classifier.", "qa_outputs.")
DISTILBERT_LAYER_NORM_EPS = 1e-12  # transformers' DistilBERT: nn.LayerNorm(dim, eps=1e-12) everywhere
_LAYER_NAME = re.compile(r"^transformer\.layer\.(\d+)\.(.+)\.(weight|bias)$")

distilbert_to_encoder, encoder_to_distilbert_name = table_maps(DISTILBERT_NAMES, DISTILBERT_LAYER_MODULES, _LAYER_NAME,
                                                               "transformer.layer.{index}.{module}.{suffix}")


def distilbert_activation(hf: Mapping[str, Any]) -> str:
    """Our activation for config.json's `activation` (the FFN's and the MLM head's); others refused naming it."""
    act = hf.get("activation", "gelu")
    if act not in BERT_ACTIVATIONS:
        raise CheckpointError(f"activation {act!r} is not supported; expected one of {', '.join(BERT_ACTIVATIONS)} "
                              "(the tanh GELU approximations are not the encoder's exact GELU)")
    return BERT_ACTIVATIONS[act]


def distilbert_config(hf: Mapping[str, Any], name: str, source: Mapping[str, Any] = ()) -> EncoderConfig:
    """EncoderConfig for a DistilBERT config.json (its own keys: dim, n_heads, n_layers, hidden_dim); refuses what
    the encoder does not compute, naming it."""
    activation = distilbert_activation(hf)
    require(hf, ("dim", "n_heads", "n_layers", "hidden_dim", "vocab_size", "max_position_embeddings"))
    sizes = dict(hidden_size=hf["dim"], num_attention_heads=hf["n_heads"], num_hidden_layers=hf["n_layers"],
                 intermediate_size=hf["hidden_dim"])
    return encoder_config(
        {**hf, **sizes}, name, source,
        max_positions=int(hf["max_position_embeddings"]),
        type_vocab_size=0,
        layer_norm_eps=DISTILBERT_LAYER_NORM_EPS,
        norm_placement="post",
        positional="learned",
        position_ids="range",
        activation=activation,
    )


# DistilBERT's task heads: pre_classifier + classifier on the first token; the MLM head (its projector tied to the
# word embeddings).
DISTILBERT_HEADS: Mapping[str, Mapping[str, str]] = {
    "classification": {"pre_classifier": "head.dense", "classifier": "head.out"},
    "sparse": {"vocab_transform": "head.dense", "vocab_layer_norm": "head.norm", "vocab_projector": "head.out"},
}


def distilbert_head_config(hf: Mapping[str, Any], head: str) -> dict[str, Any]:
    """The classifier: the first token, pre_classifier, ReLU, no norm; the MLM transform: vocab_transform,
    `activation` (as the FFN's), vocab_layer_norm (eps 1e-12, the encoder's)."""
    if head == "classification":
        return dict(head_pooling="cls", head_activation="relu", head_norm=False, head_bias=True, head_out_bias=True)
    return dict(head_activation=distilbert_activation(hf), head_norm=True, head_bias=True, head_out_bias=True)


FAMILY = Family(
    model_types=(DISTILBERT_TYPE,),
    prefix=DISTILBERT_PREFIX,
    config=distilbert_config,
    to_encoder=distilbert_to_encoder,
    name_in_checkpoint=encoder_to_distilbert_name,
    ignored_names=DISTILBERT_IGNORED_NAMES,
    ignored_prefixes=DISTILBERT_IGNORED_PREFIXES,
    heads=DISTILBERT_HEADS,
    head_config=distilbert_head_config,
)
