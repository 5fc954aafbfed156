"""The ModernBERT family (transformers' ModernBertModel; 4.48+ and 5 config layouts): its checkpoint ⇄
encoder names, config.json → EncoderConfig.

  modernbert  pre-norm (layer 0 without its attention norm), rotary positions (θ per layer kind), GeGLU,
              no biases, fused Wqkv (split into q/k/v here), and the attention plan from layer_types /
              global_attn_every_n_layers: sliding layers are local with window local_attention // 2
              (|i − j| <= 64 for ModernBERT's 128)

Loaded by the shared strict loader (model/hf_pretrained.py) through `FAMILY`.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from model.checkpoint import CheckpointError
from model.config import HEAD_POOLINGS, EncoderConfig
from model.hf_family import OUR_LAYER_NAME, Family, Mapped, checkpoint_name, encoder_config, require, sliding_layers

MODERNBERT_TYPE = "modernbert"
# Task models (ModernBertForMaskedLM, ...) prefix the encoder's names with this.
MODERNBERT_PREFIX = "model."
# ModernBERT (transformers' ModernBertModel) name -> ours. Wqkv is fused: its rows are q, k, v in this
# order ((3·D, D), split in three). Layer 0 has no attn_norm (ours: attention_norm is the identity).
MODERNBERT_NAMES: Mapping[str, str] = {
    "embeddings.tok_embeddings.weight": "embeddings.tokens.weight",
    "embeddings.norm.weight": "embeddings.norm.weight",
    "embeddings.norm.bias": "embeddings.norm.bias",
    "final_norm.weight": "final_norm.weight",
    "final_norm.bias": "final_norm.bias",
}
MODERNBERT_LAYER_MODULES: Mapping[str, str] = {
    "attn_norm": "attention_norm",
    "attn.Wo": "attention.out_proj",
    "mlp_norm": "ffn_norm",
    "mlp.Wo": "ffn.down",
}
# Fused checkpoint tensors -> ours, their row blocks in order: Wqkv (3·D, D) is q, k, v; the GeGLU's Wi
# (2·d_ff, D) its activated input half then its gate half.
MODERNBERT_FUSED: Mapping[str, tuple[str, ...]] = {
    "attn.Wqkv": ("attention.q_proj", "attention.k_proj", "attention.v_proj"),
    "mlp.Wi": ("ffn.up", "ffn.gate"),
}
MODERNBERT_IGNORED_PREFIXES = ("head.", "decoder.", "classifier.", "drop.")
# transformers' ModernBERT activations we compute exactly ("gelu" is the erf GELU).
MODERNBERT_ACTIVATIONS: Mapping[str, str] = {"gelu": "gelu", "relu": "relu"}


def modernbert_to_encoder(name: str, tensor: torch.Tensor) -> Mapped:
    """[(our name, tensor, checkpoint name as shown)] for a ModernBertModel tensor; [] when none.
    A fused tensor gives its row blocks (MODERNBERT_FUSED: Wqkv three, Wi two)."""
    if name in MODERNBERT_NAMES:
        return [(MODERNBERT_NAMES[name], tensor, name)]
    match = OUR_LAYER_NAME.match(name)  # ModernBERT's layers are named as ours: layers.{i}.{module}.{suffix}
    if not match:
        return []
    index, module, suffix = match.groups()
    if module in MODERNBERT_LAYER_MODULES:
        return [(f"layers.{index}.{MODERNBERT_LAYER_MODULES[module]}.{suffix}", tensor, name)]
    parts = MODERNBERT_FUSED.get(module, ())
    if parts and tensor.shape[0] % len(parts) == 0:
        rows = tensor.shape[0] // len(parts)
        return [(f"layers.{index}.{ours}.{suffix}", part, f"{name}[{i * rows}:{(i + 1) * rows}]")
                for i, (ours, part) in enumerate(zip(parts, tensor.split(rows, dim=0)))]
    return []


def encoder_to_modernbert_name(name: str) -> str | None:
    """The ModernBERT name of one of our tensors (for messages about tensors a checkpoint lacks)."""
    match = OUR_LAYER_NAME.match(name)
    for fused, parts in MODERNBERT_FUSED.items():
        if match and match.group(2) in parts:
            index, module, suffix = match.groups()
            return f"layers.{index}.{fused}.{suffix} ({module.rsplit('.', 1)[-1].removesuffix('_proj')} rows)"
    return checkpoint_name(name, MODERNBERT_NAMES, MODERNBERT_LAYER_MODULES, "layers.{index}.{module}.{suffix}")


# --------------------------------------------------------------------------------------------
# config.json


def _modernbert_thetas(hf: Mapping[str, Any]) -> tuple[float, float]:
    """(global θ, local θ): transformers 5's rope_parameters, or the older global/local_rope_theta."""
    params = hf.get("rope_parameters") or {}
    thetas = []
    for kind, old, default in (("full_attention", "global_rope_theta", 160_000.0),
                               ("sliding_attention", "local_rope_theta", 10_000.0)):
        entry = params.get(kind) or {}
        rope_type = entry.get("rope_type", "default")
        if rope_type != "default" or hf.get("rope_scaling"):
            raise CheckpointError(f"rope_type {rope_type!r} / rope_scaling for {kind} is not supported; "
                                  "expected plain rotary positions ('default')")
        thetas.append(float(entry.get("rope_theta", hf.get(old, default))))
    return thetas[0], thetas[1]


def modernbert_config(hf: Mapping[str, Any], name: str, source: Mapping[str, Any] = ()) -> EncoderConfig:
    """EncoderConfig for a ModernBERT config.json (transformers 4.48+ or 5 layout)."""
    act = hf.get("hidden_activation", "gelu")
    if act not in MODERNBERT_ACTIVATIONS:
        raise CheckpointError(f"hidden_activation {act!r} is not supported; expected one of "
                              f"{', '.join(MODERNBERT_ACTIVATIONS)} (the tanh GELU is not the exact GELU)")
    require(hf, ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size", "vocab_size"))
    if hf.get("head_dim") not in (None, hf["hidden_size"] // hf["num_attention_heads"]):
        raise CheckpointError(f"head_dim {hf['head_dim']} other than hidden_size / num_attention_heads is not supported")
    attention_bias, mlp_bias = bool(hf.get("attention_bias", False)), bool(hf.get("mlp_bias", False))
    if attention_bias != mlp_bias:
        raise CheckpointError(f"attention_bias={attention_bias} with mlp_bias={mlp_bias} is not supported "
                              "(one bias switch for every linear)")
    layers, every = int(hf["num_hidden_layers"]), int(hf.get("global_attn_every_n_layers", 3))
    local = sliding_layers(hf, layers, ["sliding_attention" if i % every else "full_attention" for i in range(layers)])
    global_theta, local_theta = _modernbert_thetas(hf)
    return encoder_config(
        hf, name, source,
        max_positions=int(hf.get("max_position_embeddings", 8192)),
        type_vocab_size=0,
        layer_norm_eps=float(hf.get("norm_eps", 1e-5)),
        norm_placement="pre",
        positional="rotary",
        rope_theta=global_theta,
        rope_theta_local=local_theta,
        activation=MODERNBERT_ACTIVATIONS[act],
        ffn="gated",
        linear_bias=attention_bias,
        norm_bias=bool(hf.get("norm_bias", False)),
        first_attention_norm=False,
        local_layers=local,
        local_window=int(hf.get("local_attention", 128)) // 2,
    )


# ModernBERT's task heads: head.dense -> classifier_activation -> head.norm, then the classifier (or the MLM
# decoder); the pooling of its classifier is config.json's classifier_pooling.
MODERNBERT_HEADS: Mapping[str, Mapping[str, str]] = {
    "classification": {"head.dense": "head.dense", "head.norm": "head.norm", "classifier": "head.out"},
    "sparse": {"head.dense": "head.dense", "head.norm": "head.norm", "decoder": "head.out"},
}
# transformers' activation names we compute exactly, for classifier_activation ("gelu" is the erf GELU); the tanh
# approximations (gelu_new, gelu_pytorch_tanh, ...) are refused, as hidden_act is.
MODERNBERT_HEAD_ACTIVATIONS: Mapping[str, str] = {"gelu": "gelu", "relu": "relu", "tanh": "tanh"}


def modernbert_head_config(hf: Mapping[str, Any], head: str) -> dict[str, Any]:
    act = hf.get("classifier_activation", "gelu")
    if act not in MODERNBERT_HEAD_ACTIVATIONS:
        raise CheckpointError(f"classifier_activation {act!r} is not supported; expected one of "
                              f"{', '.join(MODERNBERT_HEAD_ACTIVATIONS)} (the tanh GELU approximations are not exact)")
    fields = dict(head_activation=MODERNBERT_HEAD_ACTIVATIONS[act], head_norm=True,
                  head_bias=bool(hf.get("classifier_bias", False)),
                  head_out_bias=True if head == "classification" else bool(hf.get("decoder_bias", True)))
    if head == "classification":
        pooling = hf.get("classifier_pooling", "cls")  # mean: over valid tokens, as ours
        if pooling not in HEAD_POOLINGS:
            raise CheckpointError(f"classifier_pooling {pooling!r} is not supported; expected one of "
                                  f"{', '.join(HEAD_POOLINGS)}")
        fields["head_pooling"] = pooling
    return fields


FAMILY = Family(
    model_types=(MODERNBERT_TYPE,),
    prefix=MODERNBERT_PREFIX,
    config=modernbert_config,
    to_encoder=modernbert_to_encoder,
    name_in_checkpoint=encoder_to_modernbert_name,
    ignored_prefixes=MODERNBERT_IGNORED_PREFIXES,
    heads=MODERNBERT_HEADS,
    head_config=modernbert_head_config,
)
