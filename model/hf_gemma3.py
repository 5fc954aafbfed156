"""The Gemma3 text family (transformers' Gemma3TextModel, model_type gemma3_text: EmbeddingGemma) on the one
encoder, as config choices.

  gemma3_text  Gemma's RMSNorm (1 + w), a norm before and after each block (norm_placement "sandwich"), the
               token embeddings times sqrt(hidden_size), grouped-query attention with its own head_dim,
               q/k norms, scores scaled by query_pre_attn_scalar^-1/2 (scaling "temperature"), tanh-GELU
               gated FFN, rotary positions with a θ per layer kind, and interleaved sliding / full layers
               as the attention plan. EmbeddingGemma's use_bidirectional_attention: bidirectional as the
               natural mask, sliding layers see |i − j| <= sliding_window // 2 (transformers' exclusive
               bound sliding_window // 2 + 1); without it the model is causal and a sliding layer sees
               i − j <= sliding_window − 1.

A Gemma3ForCausalLM exported with `--reranker-template bge-gemma` is an LLM reranker in
bge-reranker-v2-gemma's recipe: its head (model/heads.py answer_tokens) keeps the lm_head row of "Yes" (the
word embeddings' when tied, as Gemma3 ties them); a final_logit_softcapping is refused for it.

Refused, naming it: attention logit soft-capping, rope scaling other than the default, attention biases,
an activation other than gelu_pytorch_tanh. Loaded by the shared strict loader (model/hf_pretrained.py)
through `FAMILY`.
"""

from __future__ import annotations

from typing import Any, Mapping

from model.checkpoint import CheckpointError
from model.config import EncoderConfig
from model.hf_family import (DECODER_LAYER_MODULES, Family, encoder_config, plain_rope_theta, require, sliding_layers,
                             table_maps)

GEMMA3_TYPES = ("gemma3_text",)
GEMMA3_PREFIX = "model."  # Gemma3ForCausalLM keeps the encoder under it
GEMMA3_NAMES: Mapping[str, str] = {
    "embed_tokens.weight": "embeddings.tokens.weight",
    "norm.weight": "final_norm.weight",
}
GEMMA3_LAYER_MODULES: Mapping[str, str] = {
    **DECODER_LAYER_MODULES,  # its gated MLP: gelu_tanh(x·gate_proj) · (x·up_proj)
    "input_layernorm": "attention_norm",
    "post_attention_layernorm": "attention_post_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "ffn_post_norm",
}
GEMMA3_IGNORED_NAMES = ("lm_head.weight",)  # tied to the embeddings in Gemma3ForCausalLM
GEMMA3_ACTIVATIONS: Mapping[str, str] = {"gelu_pytorch_tanh": "gelu_tanh"}


gemma3_to_encoder, encoder_to_gemma3_name = table_maps(GEMMA3_NAMES, GEMMA3_LAYER_MODULES)


def gemma3_config(hf: Mapping[str, Any], name: str, source: Mapping[str, Any] = ()) -> EncoderConfig:
    """EncoderConfig for a Gemma3 text config.json; refuses what the encoder does not compute, naming it."""
    require(hf, ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size", "vocab_size"))
    act = hf.get("hidden_activation", "gelu_pytorch_tanh")
    if act not in GEMMA3_ACTIVATIONS:
        raise CheckpointError(f"hidden_activation {act!r} is not supported; expected one of {', '.join(GEMMA3_ACTIVATIONS)}")
    for field in ("attn_logit_softcapping", "attention_bias"):
        if hf.get(field):
            raise CheckpointError(f"{field}={hf[field]!r} is not supported for gemma3_text")
    layers, heads = int(hf["num_hidden_layers"]), int(hf["num_attention_heads"])
    every = int(hf.get("sliding_window_pattern", 6))  # older configs: every 6th layer full
    local = sliding_layers(hf, layers, ["sliding_attention" if (i + 1) % every else "full_attention"
                                        for i in range(layers)])
    bidirectional = bool(hf.get("use_bidirectional_attention"))
    window = int(hf.get("sliding_window") or 4096)
    head_dim = int(hf.get("head_dim") or int(hf["hidden_size"]) // heads)
    return encoder_config(
        hf, name, source,
        n_kv_heads=int(hf.get("num_key_value_heads") or heads),
        attention_head_dim=head_dim if head_dim * heads != int(hf["hidden_size"]) else 0,
        max_positions=int(hf.get("max_position_embeddings", 131072)),
        type_vocab_size=0,
        embedding_layer_norm=False,
        embedding_scale=float(int(hf["hidden_size"]) ** 0.5),
        norm="rms_gemma",
        layer_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        norm_placement="sandwich",
        positional="rotary",
        rope_theta=plain_rope_theta(hf, "full_attention", "rope_theta", 1_000_000.0),
        rope_theta_local=plain_rope_theta(hf, "sliding_attention", "rope_local_base_freq", 10_000.0),
        scaling="temperature",  # scores · query_pre_attn_scalar^-1/2
        temperature=float(hf.get("query_pre_attn_scalar", head_dim)) ** 0.5,
        activation=GEMMA3_ACTIVATIONS[act],
        ffn="gated",
        linear_bias=False,
        qk_norm=True,
        local_layers=local,
        local_window=window // 2 if bidirectional else window - 1,
        natural_mask="bidirectional" if bidirectional else "causal",
    )


def gemma3_head_config(hf: Mapping[str, Any], head: str) -> dict[str, Any]:
    """The answer_tokens head's fields (none of its own); the lm_head logits' soft-capping is refused."""
    if hf.get("final_logit_softcapping"):
        raise CheckpointError(f"final_logit_softcapping={hf['final_logit_softcapping']!r} is not supported for an "
                              "LLM reranker's answer tokens (their logits are read uncapped)")
    return {}


FAMILY = Family(
    model_types=GEMMA3_TYPES,
    prefix=GEMMA3_PREFIX,
    config=gemma3_config,
    to_encoder=gemma3_to_encoder,
    name_in_checkpoint=encoder_to_gemma3_name,
    ignored_names=GEMMA3_IGNORED_NAMES,
    heads={"answer_tokens": {"lm_head": "head.out"}},
    head_config=gemma3_head_config,
)
