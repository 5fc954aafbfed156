"""The Qwen2 / Qwen3 families (transformers' Qwen2Model, Qwen3Model: gte-Qwen2, Qwen3-Embedding): decoder
embedders on the one encoder, as config choices.

  qwen2  pre-norm RMSNorm, rotary positions, grouped-query attention (num_key_value_heads), a bias on q/k/v
         only, SwiGLU (silu), causal attention as the model's natural mask (a request may choose another)
  qwen3  qwen2's layout with a head_dim of its own (Qwen3-0.6B: 128 with hidden 1024 and 16 heads), an
         RMSNorm over each head's q and k before rotary positions, and no bias (attention_bias=true refused)

Their embedding models pool the last real token (sentence-transformers' lasttoken, model/hf_pretrained.py),
after instructions given as prompts (config_sentence_transformers.json). Refused: sliding-window layers
(use_sliding_window), rope scaling other than the default, an activation other than silu.

Loaded by the shared strict loader (model/hf_pretrained.py) through `FAMILY`.
"""

from __future__ import annotations

from typing import Any, Mapping

from model.checkpoint import CheckpointError
from model.config import EncoderConfig
from model.hf_family import DECODER_LAYER_MODULES, Family, encoder_config, plain_rope_theta, require, table_maps

QWEN_TYPES = ("qwen2", "qwen3")
QWEN_PREFIX = "model."  # Qwen3ForCausalLM, Qwen2ForSequenceClassification, ... keep the encoder under it
QWEN_NAMES: Mapping[str, str] = {
    "embed_tokens.weight": "embeddings.tokens.weight",
    "norm.weight": "final_norm.weight",
}
QWEN_LAYER_MODULES: Mapping[str, str] = {
    **DECODER_LAYER_MODULES,
    "input_layernorm": "attention_norm",
    "post_attention_layernorm": "ffn_norm",
}
QWEN_IGNORED_NAMES = ("lm_head.weight",)  # the language-model head of *ForCausalLM checkpoints
QWEN_IGNORED_PREFIXES = ("rotary_emb.",)  # older checkpoints' inv_freq buffer
QWEN_ACTIVATIONS: Mapping[str, str] = {"silu": "silu"}


qwen_to_encoder, encoder_to_qwen_name = table_maps(QWEN_NAMES, QWEN_LAYER_MODULES)


def qwen_config(hf: Mapping[str, Any], name: str, source: Mapping[str, Any] = ()) -> EncoderConfig:
    """EncoderConfig for a Qwen2 / Qwen3 config.json; refuses what the encoder does not compute, naming it."""
    model_type = hf.get("model_type")
    require(hf, ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size", "vocab_size"))
    act = hf.get("hidden_act", "silu")
    if act not in QWEN_ACTIVATIONS:
        raise CheckpointError(f"hidden_act {act!r} is not supported; expected one of {', '.join(QWEN_ACTIVATIONS)}")
    sliding = [i for i, kind in enumerate(hf.get("layer_types") or []) if kind != "full_attention"]
    if hf.get("use_sliding_window") or sliding:
        raise CheckpointError(f"sliding-window layers (use_sliding_window, layer_types {sliding}) are not supported "
                              "for qwen2/qwen3; expected full attention in every layer")
    qwen3 = model_type == "qwen3"
    if qwen3 and hf.get("attention_bias"):
        raise CheckpointError("attention_bias=true is not supported for qwen3 (a bias on o_proj but not on the MLP)")
    heads = int(hf["num_attention_heads"])
    head_dim = int(hf.get("head_dim") or int(hf["hidden_size"]) // heads) if qwen3 else 0
    theta = plain_rope_theta(hf, None, "rope_theta", 10000.0)
    return encoder_config(
        hf, name, source,
        n_kv_heads=int(hf.get("num_key_value_heads") or heads),
        attention_head_dim=head_dim if head_dim * heads != int(hf["hidden_size"]) else 0,
        max_positions=int(hf.get("max_position_embeddings", 32768)),
        type_vocab_size=0,
        embedding_layer_norm=False,
        norm="rms",
        layer_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        norm_placement="pre",
        positional="rotary",
        rope_theta=theta,
        rope_theta_local=theta,
        activation=QWEN_ACTIVATIONS[act],
        ffn="gated",
        linear_bias=False,
        qkv_bias=not qwen3,  # Qwen2: q/k/v biased, o_proj and the MLP not; Qwen3: no bias
        qk_norm=qwen3,
        natural_mask="causal",
    )


FAMILY = Family(
    model_types=QWEN_TYPES,
    prefix=QWEN_PREFIX,
    config=qwen_config,
    to_encoder=qwen_to_encoder,
    name_in_checkpoint=encoder_to_qwen_name,
    ignored_names=QWEN_IGNORED_NAMES,
    ignored_prefixes=QWEN_IGNORED_PREFIXES,
)
