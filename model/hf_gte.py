"""The GTE family ("new" architecture: gte-base-en-v1.5, gte-multilingual-base; transformers' GteModel): its
checkpoint ⇄ encoder names, config.json → EncoderConfig.

  gte  NomicBERT's layout (model/hf_nomic_bert.py: post-norm, rotary on the whole head, a gated MLP
       act(gate_proj)·up_proj, embeddings LayerNorm), with GTE's own: θ 160k by default, the exact GELU, a bias on
       q/k/v/o and on down_proj but none on gate/up (EncoderConfig.ffn_in_bias), token types when
       type_vocab_size > 0 (gte-multilingual-base: 1, gte-base-en-v1.5: 0); rope_type "linear" as
       EncoderConfig.rope_scale

Two layouts load:
  - model_type "gte": transformers' own (GteConfig's keys, q/k/v projections, decoder-style layer names);
  - model_type "new": the hub's remote-code one (Alibaba-NLP/new-impl: BERT's keys with rope_theta /
    rope_scaling, encoder.layer.{i}.attention.qkv_proj fused q, k, v, mlp.up_gate_proj fused up then gate,
    attn_ln / mlp_ln), whose switches must be the values above (GTE_HUB_SETTINGS).
A GteForSequenceClassification checkpoint is exported with its classifier (BERT's, as NomicBERT's).
The hub's rope_scaling type "ntk" (gte-base-en-v1.5's fixed NTK) is read as what its code computes: θ·factor and
a linear scale of factor^(2/head_dim) (fixed_ntk_as_linear). Refused by name: its mixed variant (mixed_b), every
other rope type but default / linear, RMSNorm layers, logn attention scaling, unpacked q/k/v.

Loaded by the shared strict loader (model/hf_pretrained.py) through `FAMILY`.
"""

from __future__ import annotations

import re
from typing import Any, Mapping

import torch

from model.checkpoint import CheckpointError
from model.config import EncoderConfig
from model.hf_family import Family, Mapped, table_maps
from model.hf_bert import bert_head_config
from model.hf_nomic_bert import ROTARY_BERT_HEADS, ROTARY_BERT_LAYER_MODULES, ROTARY_BERT_NAMES, rotary_bert_config

GTE_TYPES = ("gte", "new")
GTE_PREFIX = "gte."  # GteForMaskedLM, ...ForSequenceClassification keep the encoder under it
# The hub's remote-code layout (NewModel) -> ours: BERT's embedding names, its own layer names.
GTE_HUB_LAYER_MODULES: Mapping[str, str] = {
    "attention.o_proj": "attention.out_proj",
    "attn_ln": "attention_norm",
    "mlp.down_proj": "ffn.down",
    "mlp_ln": "ffn_norm",
}
# Fused rows in order: qkv_proj is q, k, v; up_gate_proj the linear half (transformers' up_proj, ours gate),
# then the activated one (gate_proj, ours up).
GTE_HUB_FUSED: Mapping[str, tuple[str, ...]] = {
    "attention.qkv_proj": ("attention.q_proj", "attention.k_proj", "attention.v_proj"),
    "mlp.up_gate_proj": ("ffn.gate", "ffn.up"),
}
GTE_HUB_LAYER = re.compile(r"^encoder\.layer\.(\d+)\.(.+)\.(weight|bias)$")
# The hub's switches and the values GteModel has (absent: the same); any other value is refused naming it.
GTE_HUB_SETTINGS: Mapping[str, tuple[Any, ...]] = {
    "position_embedding_type": (None, "rope"), "layer_norm_type": (None, "layer_norm"),
    "logn_attention_scale": (None, False), "logn_attention_clip1": (None, False), "pack_qkv": (None, True),
}
GTE_IGNORED_NAMES = ("embeddings.position_ids",)  # the hub's position buffer in older saves
GTE_IGNORED_PREFIXES = ("pooler.", "lm_head.", "classifier.", "rotary_emb.")

_builtin_to_encoder, encoder_to_gte_name = table_maps(ROTARY_BERT_NAMES, ROTARY_BERT_LAYER_MODULES)
_hub_to_encoder, _ = table_maps(ROTARY_BERT_NAMES, GTE_HUB_LAYER_MODULES, GTE_HUB_LAYER, fused=GTE_HUB_FUSED)


def gte_to_encoder(name: str, tensor: torch.Tensor) -> Mapped:
    """Either layout's tensor in our names (they share the embeddings' names only)."""
    return _builtin_to_encoder(name, tensor) or _hub_to_encoder(name, tensor)


def fixed_ntk_as_linear(hf: Mapping[str, Any]) -> Mapping[str, Any]:
    """The hub's rope_scaling {"type": "ntk", "factor": f} (gte-base-en-v1.5: f = 2, θ 500k) as what it computes,
    in transformers' terms. Its NTKScalingRotaryEmbedding fills its cos/sin cache at construction for
    max_position_embeddings · f positions, a length past max_position_embeddings, so it always takes the
    scaled frequencies: base θ·f, every frequency then divided by f^(2/head_dim); that is rope_theta θ·f with
    rope_type "linear" of factor f^(2/head_dim) (EncoderConfig.rope_scale), at every length. Its mixed variant
    (`mixed_b`: a factor per frequency) is refused naming it. Any other config.json is returned as is."""
    scaling = hf.get("rope_scaling") or {}
    if hf.get("model_type") != "new" or scaling.get("type", scaling.get("rope_type")) != "ntk":
        return hf
    if scaling.get("mixed_b") is not None:
        raise CheckpointError(f"rope_scaling 'ntk' with mixed_b {scaling['mixed_b']} (a factor per frequency) is "
                              "not supported; expected the fixed NTK (no mixed_b)")
    factor = scaling.get("factor")
    if not isinstance(factor, (int, float)) or factor <= 0:
        raise CheckpointError(f"rope_scaling 'ntk' needs a positive numeric factor, got {factor!r}")
    head_dim = int(hf["hidden_size"]) // int(hf["num_attention_heads"])
    theta = float(hf.get("rope_theta", 160_000.0)) * factor
    return {**hf, "rope_theta": theta, "rope_scaling": {"type": "linear", "factor": factor ** (2 / head_dim)}}


def gte_config(hf: Mapping[str, Any], name: str, source: Mapping[str, Any] = ()) -> EncoderConfig:
    """EncoderConfig for a GTE config.json (model_type "gte", or the hub's "new")."""
    for key, accepted in GTE_HUB_SETTINGS.items():
        if hf.get(key) not in accepted:
            raise CheckpointError(f"{key} {hf[key]!r} is not supported for {hf.get('model_type')}; expected "
                                  f"{' or '.join(repr(v) for v in accepted if v is not None)}")
    return rotary_bert_config({"type_vocab_size": 1, **fixed_ntk_as_linear(hf)}, name, source,
                              default_theta=160_000.0, default_act="gelu", linear_bias=True, ffn_in_bias=False)


FAMILY = Family(
    model_types=GTE_TYPES,
    prefix=GTE_PREFIX,
    config=gte_config,
    to_encoder=gte_to_encoder,
    name_in_checkpoint=encoder_to_gte_name,
    ignored_names=GTE_IGNORED_NAMES,
    ignored_prefixes=GTE_IGNORED_PREFIXES,
    heads=ROTARY_BERT_HEADS,
    head_config=bert_head_config,
)
