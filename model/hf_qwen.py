"""The Qwen2 / Qwen3 families (transformers' Qwen2Model, Qwen3Model: gte-Qwen2, Qwen3-Embedding): decoder
embedders on the one encoder, as config choices.

  qwen2  pre-norm RMSNorm, rotary positions, grouped-query attention (num_key_value_heads), a bias on q/k/v
         only, SwiGLU (silu), causal attention as the model's natural mask (a request may choose another)
  qwen3  qwen2's layout with a head_dim of its own (Qwen3-0.6B: 128 with hidden 1024 and 16 heads), an
         RMSNorm over each head's q and k before rotary positions, and no bias (attention_bias=true refused)

Their embedding models pool the last real token (sentence-transformers' lasttoken, model/hf_pretrained.py),
after instructions given as prompts (config_sentence_transformers.json). Refused: sliding-window layers
(use_sliding_window), rope scaling other than the default, an activation other than silu.

A Qwen3ForCausalLM exported with `--reranker-template qwen3` is an LLM reranker (Qwen3-Reranker): its head
(model/heads.py answer_tokens) keeps the lm_head rows of "no" and "yes" (the word embeddings' when tied).

Loaded by the shared strict loader (model/hf_pretrained.py) through `FAMILY`.
"""

from __future__ import annotations

from typing import Any, Mapping

from model.checkpoint import CheckpointError
from model.config import EncoderConfig
from model.hf_family import (DECODER_IGNORED_NAMES, DECODER_IGNORED_PREFIXES, DECODER_NAMES,
                             PRE_NORM_DECODER_LAYER_MODULES, Family, swiglu_decoder_config, table_maps)

QWEN_TYPES = ("qwen2", "qwen3")
QWEN_PREFIX = "model."  # Qwen3ForCausalLM, Qwen2ForSequenceClassification, ... keep the encoder under it


qwen_to_encoder, encoder_to_qwen_name = table_maps(DECODER_NAMES, PRE_NORM_DECODER_LAYER_MODULES)


def qwen_config(hf: Mapping[str, Any], name: str, source: Mapping[str, Any] = ()) -> EncoderConfig:
    """EncoderConfig for a Qwen2 / Qwen3 config.json (the shared SwiGLU decoder's: hf_family.swiglu_decoder_config);
    refuses what the encoder does not compute, naming it."""
    sliding = [i for i, kind in enumerate(hf.get("layer_types") or []) if kind != "full_attention"]
    if hf.get("use_sliding_window") or sliding:
        raise CheckpointError(f"sliding-window layers (use_sliding_window, layer_types {sliding}) are not supported "
                              "for qwen2/qwen3; expected full attention in every layer")
    qwen3 = hf.get("model_type") == "qwen3"
    if qwen3 and hf.get("attention_bias"):
        raise CheckpointError("attention_bias=true is not supported for qwen3 (a bias on o_proj but not on the MLP)")
    qwen2 = {} if qwen3 else dict(attention_head_dim=0)  # Qwen2 computes hidden / heads whatever head_dim says
    return swiglu_decoder_config(
        hf, name, source, **qwen2,
        qkv_bias=not qwen3,  # Qwen2: q/k/v biased, o_proj and the MLP not; Qwen3: no bias
        qk_norm=qwen3,
    )


FAMILY = Family(
    model_types=QWEN_TYPES,
    prefix=QWEN_PREFIX,
    config=qwen_config,
    to_encoder=qwen_to_encoder,
    name_in_checkpoint=encoder_to_qwen_name,
    ignored_names=DECODER_IGNORED_NAMES,
    ignored_prefixes=DECODER_IGNORED_PREFIXES,
    heads={"answer_tokens": {"lm_head": "head.out"}},
    head_config=lambda hf, head: {},  # answer_tokens: its rows are the template's (model/hf_heads.py)
)
