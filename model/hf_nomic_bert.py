"""The NomicBERT family (nomic-embed-text-v1 / v1.5; transformers' NomicBertModel): its checkpoint ⇄ encoder
names, config.json → EncoderConfig.

  nomic_bert  post-norm (a LayerNorm after each residual), rotary positions on the whole head (rotate-half,
              θ 1000; transformers' rope_type "linear" as EncoderConfig.rope_scale), SwiGLU (silu), no bias
              in any linear (LayerNorms biased), token types (2), positions 0, 1, 2, ... whatever the padding

Two layouts of one model_type "nomic_bert" load:
  - transformers' own (NomicBertConfig's keys, q/k/v projections, decoder-style layer names), as
    save_pretrained writes it;
  - the hub's remote-code one (nomic-ai's configuration_hf_nomic_bert.py: n_embd, n_head, n_layer, n_inner,
    rotary_emb_base, activation_function ...; a fused Wqkv split into q, k, v here, fc11/fc12/fc2, norm1/norm2,
    emb_ln), whose switches must be the values the model above computes (NOMIC_HUB_SETTINGS).
A NomicBertForSequenceClassification checkpoint is exported with its classifier (BERT's: ROTARY_BERT_HEADS).
Refused by name: the MoE variant (nomic-embed-text-v2-moe: num_experts / moe_every_n_layers; transformers'
NomicBertModel has no MoE layers), dynamic NTK (rotary_scaling_factor), interleaved or partial rotary, other
rope types.

Loaded by the shared strict loader (model/hf_pretrained.py) through `FAMILY`; GTE (model/hf_gte.py) shares
this layout's names.
"""

from __future__ import annotations

import re
from typing import Any, Mapping

import torch

from model.checkpoint import CheckpointError
from model.config import EncoderConfig
from model.hf_bert import BERT_HEADS, bert_head_config
from model.hf_family import (DECODER_LAYER_MODULES, Family, Mapped, encoder_config, require, rope_fields,
                             table_maps)

NOMIC_BERT_TYPE = "nomic_bert"
NOMIC_BERT_PREFIX = "nomic_bert."  # NomicBertForMaskedLM, ...ForSequenceClassification keep the encoder under it
# transformers' rotary BERTs (NomicBertModel, GteModel) -> ours: BERT's embeddings (no position table), decoder
# layer names, and a LayerNorm after each residual (post-norm: ours attention_norm / ffn_norm).
ROTARY_BERT_NAMES: Mapping[str, str] = {
    "embeddings.word_embeddings.weight": "embeddings.tokens.weight",
    "embeddings.token_type_embeddings.weight": "embeddings.token_types.weight",
    "embeddings.LayerNorm.weight": "embeddings.norm.weight",
    "embeddings.LayerNorm.bias": "embeddings.norm.bias",
}
ROTARY_BERT_LAYER_MODULES: Mapping[str, str] = {
    **{theirs: ours for theirs, ours in DECODER_LAYER_MODULES.items() if not ours.endswith(("q_norm", "k_norm"))},
    "post_attention_layernorm": "attention_norm",
    "post_mlp_layernorm": "ffn_norm",
}
# The hub's remote-code layout (nomic-ai/nomic-bert-2048's NomicBertModel) -> ours. fc12 is the activated
# projection (transformers' gate_proj, ours up), fc11 the linear one it multiplies (up_proj, ours gate).
NOMIC_HUB_NAMES: Mapping[str, str] = {
    "embeddings.word_embeddings.weight": "embeddings.tokens.weight",
    "embeddings.token_type_embeddings.weight": "embeddings.token_types.weight",
    "emb_ln.weight": "embeddings.norm.weight",
    "emb_ln.bias": "embeddings.norm.bias",
}
NOMIC_HUB_LAYER_MODULES: Mapping[str, str] = {
    "attn.out_proj": "attention.out_proj",
    "mlp.fc12": "ffn.up",
    "mlp.fc11": "ffn.gate",
    "mlp.fc2": "ffn.down",
    "norm1": "attention_norm",
    "norm2": "ffn_norm",
}
NOMIC_HUB_FUSED: Mapping[str, tuple[str, ...]] = {"attn.Wqkv": ("attention.q_proj", "attention.k_proj",
                                                                 "attention.v_proj")}
NOMIC_HUB_LAYER = re.compile(r"^encoder\.layers\.(\d+)\.(.+)\.(weight|bias)$")
# The hub's config keys -> transformers' NomicBertConfig keys.
NOMIC_HUB_KEYS: Mapping[str, str] = {
    "n_embd": "hidden_size", "n_head": "num_attention_heads", "n_layer": "num_hidden_layers",
    "n_inner": "intermediate_size", "n_positions": "max_position_embeddings", "layer_norm_epsilon": "layer_norm_eps",
    "rotary_emb_base": "rope_theta",
}
# The hub's switches and the values the model above has (absent: the same); any other value is refused naming it.
NOMIC_HUB_SETTINGS: Mapping[str, tuple[Any, ...]] = {
    "activation_function": (None, "swiglu"), "prenorm": (None, False), "causal": (None, False),
    "rotary_emb_fraction": (None, 1.0), "rotary_emb_interleaved": (None, False), "rotary_emb_scale_base": (None,),
    "rotary_scaling_factor": (None,), "qkv_proj_bias": (None, False), "mlp_fc1_bias": (None, False),
    "mlp_fc2_bias": (None, False), "use_rms_norm": (None, False), "parallel_block": (None, False),
    "scale_attn_weights": (None, True), "scale_attn_by_inverse_layer_idx": (None, False),
}
NOMIC_MOE_KEYS = ("num_experts", "moe_every_n_layers", "moe_top_k")
NOMIC_IGNORED_PREFIXES = ("pooler.", "cls.", "classifier.", "rotary_emb.")
# transformers' activations we compute exactly ("gelu" is the erf GELU) for the gated MLP act(gate_proj)·up_proj.
ROTARY_BERT_ACTIVATIONS: Mapping[str, str] = {"silu": "silu", "gelu": "gelu", "relu": "relu"}

_builtin_to_encoder, encoder_to_nomic_name = table_maps(ROTARY_BERT_NAMES, ROTARY_BERT_LAYER_MODULES)
_hub_to_encoder, _ = table_maps(NOMIC_HUB_NAMES, NOMIC_HUB_LAYER_MODULES, NOMIC_HUB_LAYER, fused=NOMIC_HUB_FUSED)


def nomic_to_encoder(name: str, tensor: torch.Tensor) -> Mapped:
    """Either layout's tensor in our names (their names do not overlap but for the embeddings)."""
    return _builtin_to_encoder(name, tensor) or _hub_to_encoder(name, tensor)


# The sequence classifier of NomicBertForSequenceClassification / GteForSequenceClassification: BERT's (the
# first token through pooler.dense and tanh, then classifier). No other head (their MLM heads are not read).
ROTARY_BERT_HEADS: Mapping[str, Mapping[str, str]] = {"classification": BERT_HEADS["classification"]}


def rotary_bert_activation(hf: Mapping[str, Any], default: str) -> str:
    act = hf.get("hidden_act", default)
    if act not in ROTARY_BERT_ACTIVATIONS:
        raise CheckpointError(f"hidden_act {act!r} is not supported; expected one of "
                              f"{', '.join(ROTARY_BERT_ACTIVATIONS)} (the tanh GELU is not the exact GELU)")
    return ROTARY_BERT_ACTIVATIONS[act]


def rotary_bert_config(hf: Mapping[str, Any], name: str, source: Mapping[str, Any], *, default_theta: float,
                       default_act: str, **fields: Any) -> EncoderConfig:
    """EncoderConfig of a rotary post-norm BERT in transformers' keys (NomicBertConfig, GteConfig): gated MLP,
    embeddings LayerNorm, token types when type_vocab_size > 0, rotary positions (rope_fields); `fields` the
    family's biases."""
    require(hf, ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size", "vocab_size"))
    heads, width = int(hf["num_attention_heads"]), int(hf["hidden_size"])
    head_dim = int(hf.get("head_dim") or width // heads)
    return encoder_config(
        hf, name, source,
        attention_head_dim=head_dim if head_dim * heads != width else 0,
        max_positions=int(hf.get("max_position_embeddings", 2048)),
        type_vocab_size=int(hf.get("type_vocab_size", 0)),
        layer_norm_eps=float(hf.get("layer_norm_eps", 1e-12)),
        norm_placement="post",
        positional="rotary",
        **rope_fields(hf, "rope_theta", default_theta),
        activation=rotary_bert_activation(hf, default_act),
        ffn="gated",
        **fields,
    )


def from_hub_keys(hf: Mapping[str, Any]) -> dict[str, Any]:
    """A config.json in the hub's remote-code keys as NomicBertConfig's (unchanged when it has none of them);
    a switch at a value the model does not compute is refused naming it."""
    for key, accepted in NOMIC_HUB_SETTINGS.items():
        if hf.get(key) not in accepted:
            raise CheckpointError(f"{key} {hf[key]!r} is not supported for nomic_bert; expected "
                                  f"{' or '.join(repr(v) for v in accepted if v is not None) or 'none'}")
    settings = {NOMIC_HUB_KEYS.get(key, key): value for key, value in hf.items()
                if not (key in NOMIC_HUB_KEYS and value is None)}  # n_inner null: refused as absent
    if "activation_function" in hf:
        settings["hidden_act"] = "silu"  # swiglu: silu(fc12 x) · fc11 x
    return settings


def nomic_config(hf: Mapping[str, Any], name: str, source: Mapping[str, Any] = ()) -> EncoderConfig:
    """EncoderConfig for a NomicBERT config.json (transformers' keys or the hub's remote-code keys)."""
    moe = [key for key in NOMIC_MOE_KEYS if hf.get(key)]
    if moe:
        raise CheckpointError(f"the NomicBERT MoE variant ({', '.join(f'{k}={hf[k]}' for k in moe)}; "
                              "nomic-embed-text-v2-moe) is not supported: transformers' NomicBertModel has no "
                              "MoE layers to compare with")
    return rotary_bert_config({"type_vocab_size": 2, **from_hub_keys(hf)}, name, source, default_theta=1000.0,
                              default_act="silu", linear_bias=False)


FAMILY = Family(
    model_types=(NOMIC_BERT_TYPE,),
    prefix=NOMIC_BERT_PREFIX,
    config=nomic_config,
    to_encoder=nomic_to_encoder,
    name_in_checkpoint=encoder_to_nomic_name,
    ignored_prefixes=NOMIC_IGNORED_PREFIXES,
    heads=ROTARY_BERT_HEADS,
    head_config=bert_head_config,
)
