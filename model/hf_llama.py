"""The Llama and Mistral families (transformers' LlamaModel, MistralModel: e5-mistral-7b-instruct, SFR-Embedding,
NVIDIA's bidirectional Llama retrievers) on the one encoder, as config choices. One module for the three
model_types: they are one layer (transformers' MistralModel is LlamaModel's code) whose differences are all in
config.json, read here.

  llama          the shared SwiGLU decoder (hf_family.swiglu_decoder_config: pre-norm RMSNorm, rotary
                 positions, grouped-query attention with config.json's head_dim, silu gates, causal as the
                 natural mask); attention_bias and mlp_bias together (a bias on every projection) or neither
  llama_bidirec  NVIDIA's LlamaBidirectionalModel (llama-embed-nemotron, llama-nemoretriever: the model_type of
                 their LlamaBidirectionalConfig, architectures LlamaBidirectionalModel): llama with
                 bidirectional attention as the natural mask; likewise a llama config.json with is_causal
                 false (transformers 5 then builds a bidirectional mask for LlamaModel)
  mistral        llama without biases, and its sliding_window (Mistral-7B-v0.1, e5-mistral: 4096; later
                 ones null): every layer local in the attention plan, seeing i − j < sliding_window on top of
                 the causal mask, as transformers' sliding-window causal mask

Their embedding models pool the last real token (sentence-transformers' lasttoken) after instructions given as
prompts; NVIDIA's bidirectional ones the mean (their sentence-transformers files say which). lm_head.weight of
*ForCausalLM checkpoints is ignored (tied or not). Refused, naming them: rope scaling other than the default
(Llama 3.1+'s "llama3" included), an activation other than silu, attention_bias without mlp_bias or the other
way round, is_causal false on mistral. Loaded by the shared strict loader (model/hf_pretrained.py) through
`FAMILY`.
"""

from __future__ import annotations

from typing import Any, Mapping

from model.checkpoint import CheckpointError
from model.config import EncoderConfig
from model.hf_family import (DECODER_IGNORED_NAMES, DECODER_IGNORED_PREFIXES, DECODER_NAMES,
                             PRE_NORM_DECODER_LAYER_MODULES, Family, swiglu_decoder_config, table_maps)

LLAMA_TYPES = ("llama", "llama_bidirec", "mistral")
BIDIRECTIONAL_LLAMA = "llama_bidirec"  # NVIDIA's LlamaBidirectionalConfig.model_type
LLAMA_PREFIX = "model."  # LlamaForCausalLM, MistralForCausalLM keep the encoder under it


llama_to_encoder, encoder_to_llama_name = table_maps(DECODER_NAMES, PRE_NORM_DECODER_LAYER_MODULES)


def llama_config(hf: Mapping[str, Any], name: str, source: Mapping[str, Any] = ()) -> EncoderConfig:
    """EncoderConfig for a Llama / bidirectional Llama / Mistral config.json; refuses what the encoder does not
    compute, naming it."""
    mistral = hf.get("model_type") == "mistral"
    bidirectional = hf.get("model_type") == BIDIRECTIONAL_LLAMA or hf.get("is_causal") is False
    if mistral and bidirectional:
        raise CheckpointError("is_causal=false is not supported for mistral (a bidirectional sliding window); "
                              "expected a causal model")
    # MistralModel has no bias whatever config.json says; Llama's two flags, together only (one linear_bias)
    bias = {"attention_bias": False, "mlp_bias": False} if mistral else \
        {key: bool(hf.get(key)) for key in ("attention_bias", "mlp_bias")}
    if len(set(bias.values())) > 1:
        raise CheckpointError(f"attention_bias={bias['attention_bias']} with mlp_bias={bias['mlp_bias']} is not "
                              "supported; expected both true (a bias on every projection) or both false")
    layers = int(hf.get("num_hidden_layers") or 1)
    window = int(hf.get("sliding_window") or 0) if mistral else 0  # llama has none (LlamaModel ignores the key)
    return swiglu_decoder_config(
        hf, name, source,
        linear_bias=bias["mlp_bias"],
        natural_mask="bidirectional" if bidirectional else "causal",
        # Mistral's window on every layer: causal and i − j <= sliding_window − 1
        local_layers=tuple(range(layers)) if window else (),
        local_window=window - 1 if window else 0,
    )


FAMILY = Family(
    model_types=LLAMA_TYPES,
    prefix=LLAMA_PREFIX,
    config=llama_config,
    to_encoder=llama_to_encoder,
    name_in_checkpoint=encoder_to_llama_name,
    ignored_names=DECODER_IGNORED_NAMES,
    ignored_prefixes=DECODER_IGNORED_PREFIXES,
)
