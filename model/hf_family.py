"""One Hugging Face checkpoint family as data: `Family`, what the shared strict loader
(model/hf_pretrained.py) needs to know of it, its task heads included. Each family is one module exporting
`FAMILY` (model/hf_bert.py, hf_roberta.py, hf_modernbert.py, hf_mpnet.py, hf_qwen.py, hf_gemma3.py,
hf_llama.py); the registry, the one tuple of them, is hf_pretrained.FAMILIES. Adding a family is one new module
and one entry there.

Also here: what the families' name maps and config readers share (`OUR_LAYER_NAME`, `checkpoint_name`,
`require`, `encoder_config`, `table_maps` with its fused row blocks, the rotary readers `plain_rope_theta` and
`rope_fields`), and the SwiGLU decoder that Llama, Mistral and Qwen2/3 share (`DECODER_NAMES`,
`PRE_NORM_DECODER_LAYER_MODULES`, `swiglu_decoder_config`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch

from model.checkpoint import CheckpointError
from model.config import ConfigError, EncoderConfig

# (our name, tensor, checkpoint name as shown) for one checkpoint tensor; a fused tensor gives several.
Mapped = list[tuple[str, torch.Tensor, str]]

# Our per-layer state-dict names: layers.{i}.{module}.{weight|bias}.
OUR_LAYER_NAME = re.compile(r"^layers\.(\d+)\.(.+)\.(weight|bias)$")


@dataclass(frozen=True)
class Family:
    """A checkpoint family: the config.json model_types it takes and how its checkpoints map to our encoder."""

    model_types: tuple[str, ...]  # config.json model_type values, e.g. ("roberta", "xlm-roberta")
    prefix: str  # what task models (...ForMaskedLM) put before the encoder's names: "bert.", "model."
    # config.json -> EncoderConfig (hf, name, metadata.json's source); a CheckpointError naming what it cannot compute
    config: Callable[[Mapping[str, Any], str, Mapping[str, Any]], EncoderConfig]
    # checkpoint name (prefix stripped), tensor -> [(our name, tensor, name as shown)]; [] when it has no counterpart
    to_encoder: Callable[[str, torch.Tensor], Mapped]
    # our name -> the checkpoint's (for messages about tensors a checkpoint lacks), None when unknown
    name_in_checkpoint: Callable[[str], str | None]
    # checkpoint tensors knowingly not used (prefix stripped): buffers, pretraining heads
    ignored_names: tuple[str, ...] = ()
    ignored_prefixes: tuple[str, ...] = ()
    # The family's task heads (model/heads.py; the shared loading: model/hf_heads.py): head kind
    # ("classification", "sparse") -> checkpoint module (after the prefix) -> ours. Suffixes (.weight / .bias; old
    # BERT LayerNorms' .gamma / .beta) carry over; two modules naming one of ours are transformers' tied copies.
    heads: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    # (config.json, head kind) -> the EncoderConfig head fields of the family's head (its activation, norm,
    # biases, pooling); a CheckpointError naming what it cannot compute
    head_config: Callable[[Mapping[str, Any], str], dict[str, Any]] | None = None

    @staticmethod
    def source_format(model_type: str) -> str:
        """metadata.json's source.format: "hf-bert", "hf-roberta", "hf-xlm-roberta", "hf-modernbert"."""
        return f"hf-{model_type}"


def checkpoint_name(name: str, names: Mapping[str, str], layer_modules: Mapping[str, str],
                    layer_name: str) -> str | None:
    """The checkpoint's name of one of our tensors by a family's tables (for messages about tensors a checkpoint
    lacks): `names` maps whole names (theirs -> ours), `layer_modules` per-layer modules, and `layer_name`
    formats a layer's ({index}, {module}, {suffix}) the checkpoint's way; None when the tables lack it."""
    for theirs, ours in names.items():
        if ours == name:
            return theirs
    match = OUR_LAYER_NAME.match(name)
    if match:
        index, module, suffix = match.groups()
        for theirs, ours in layer_modules.items():
            if ours == module:
                return layer_name.format(index=index, module=theirs, suffix=suffix)
    return None


# transformers' decoder-style layer names (Llama and its kin: Qwen2/3, Gemma3) -> ours: attention projections,
# the q/k norms where the model has them, the gated MLP. Families add their own layer norms.
DECODER_LAYER_MODULES: Mapping[str, str] = {
    "self_attn.q_proj": "attention.q_proj",
    "self_attn.k_proj": "attention.k_proj",
    "self_attn.v_proj": "attention.v_proj",
    "self_attn.o_proj": "attention.out_proj",
    "self_attn.q_norm": "attention.q_norm",
    "self_attn.k_norm": "attention.k_norm",
    "mlp.gate_proj": "ffn.up",  # the activated projection: act(x·gate_proj) · (x·up_proj)
    "mlp.up_proj": "ffn.gate",  # the linear one it multiplies
    "mlp.down_proj": "ffn.down",
}


# transformers' decoder models' whole names (Llama, Mistral, Qwen2/3) -> ours
DECODER_NAMES: Mapping[str, str] = {
    "embed_tokens.weight": "embeddings.tokens.weight",
    "norm.weight": "final_norm.weight",
}
# ... and their pre-norm layers (Llama, Mistral, Qwen2/3): one norm before attention, one before the MLP
PRE_NORM_DECODER_LAYER_MODULES: Mapping[str, str] = {
    **DECODER_LAYER_MODULES,
    "input_layernorm": "attention_norm",
    "post_attention_layernorm": "ffn_norm",
}
DECODER_IGNORED_NAMES = ("lm_head.weight",)  # the language-model head of *ForCausalLM checkpoints
DECODER_IGNORED_PREFIXES = ("rotary_emb.",)  # older checkpoints' inv_freq buffer


def table_maps(names: Mapping[str, str], layer_modules: Mapping[str, str], layer_pattern: re.Pattern = OUR_LAYER_NAME,
               layer_name: str = "layers.{index}.{module}.{suffix}",
               fused: Mapping[str, tuple[str, ...]] | None = None):
    """(to_encoder, name_in_checkpoint) of a family whose tensors map through two tables: whole names (theirs ->
    ours) and per-layer modules, its layers named by `layer_pattern` (index, module, suffix) and, the other way,
    by `layer_name`. `fused`: per-layer modules whose rows are several of ours stacked in order (a fused Wqkv:
    q, k, v), split into equal row blocks."""
    fused = fused or {}

    def to_encoder(name: str, tensor: torch.Tensor) -> Mapped:
        if name in names:
            return [(names[name], tensor, name)]
        match = layer_pattern.match(name)
        if not match:
            return []
        index, module, suffix = match.groups()
        if module in layer_modules:
            return [(f"layers.{index}.{layer_modules[module]}.{suffix}", tensor, name)]
        parts = fused.get(module, ())
        if parts and tensor.shape[0] % len(parts) == 0:
            rows = tensor.shape[0] // len(parts)
            return [(f"layers.{index}.{ours}.{suffix}", block, f"{name}[{i * rows}:{(i + 1) * rows}]")
                    for i, (ours, block) in enumerate(zip(parts, tensor.split(rows, dim=0)))]
        return []

    def name_in_checkpoint(name: str) -> str | None:
        match = OUR_LAYER_NAME.match(name)
        for module, parts in fused.items():
            if match and match.group(2) in parts:
                index, ours, suffix = match.groups()
                shown = layer_name.format(index=index, module=module, suffix=suffix)
                return f"{shown} (row block {parts.index(ours) + 1} of {len(parts)})"
        return checkpoint_name(name, names, layer_modules, layer_name)

    return to_encoder, name_in_checkpoint


# transformers' rope_type values the encoder computes: plain rotary positions (θ), and linear scaling (θ, every
# frequency divided by `factor`: EncoderConfig.rope_scale).
ROPE_TYPES = ("default", "linear", "llama3")


def rope_fields(hf: Mapping[str, Any], old_key: str, default: float) -> dict[str, Any]:
    """EncoderConfig's rotary fields (rope_theta and rope_theta_local, rope_scale, rope_llama3) of a model with one
    rotary setting: transformers 5's rope_parameters, or the older `old_key` θ with transformers 4's rope_scaling.
    rope_type 'default', 'linear' (its factor: rope_scale) or 'llama3' (Llama 3.1's: factor, low_freq_factor,
    high_freq_factor, original_max_position_embeddings); any other (dynamic, yarn, longrope, ...) is refused
    naming it, as is a partial_rotary_factor (the encoder rotates the whole head)."""
    old, new = hf.get("rope_scaling") or {}, hf.get("rope_parameters") or {}
    kinds = {key: d.get("rope_type", d.get("type", "default")) for key, d in (("rope_scaling", old),
                                                                            ("rope_parameters", new)) if d}
    for rope_type in kinds.values():
        if rope_type not in ROPE_TYPES:
            raise CheckpointError(f"rope_type {rope_type!r} is not supported; expected one of {', '.join(ROPE_TYPES)}")
    if len(set(kinds.values())) > 1:
        raise CheckpointError(f"rope_scaling and rope_parameters disagree: {kinds}")
    params = {**old, **new}
    rope_type = params.get("rope_type", params.get("type", "default"))
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    if partial not in (None, 1, 1.0):
        raise CheckpointError(f"partial_rotary_factor {partial} is not supported (the whole head is rotated)")
    needs = {"default": (), "linear": ("factor",),
             "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}[rope_type]
    absent = [key for key in needs if not isinstance(params.get(key), (int, float))]
    if absent:
        raise CheckpointError(f"rope_type {rope_type!r} needs numeric {', '.join(absent)}")
    theta = float(params.get("rope_theta", hf.get(old_key, default)))
    return dict(rope_theta=theta, rope_theta_local=theta,
                rope_scale=float(params["factor"]) if rope_type == "linear" else 1.0,
                rope_llama3=tuple(float(params[key]) for key in needs) if rope_type == "llama3" else ())


def plain_rope_theta(hf: Mapping[str, Any], kind: str | None, old_key: str, default: float) -> float:
    """θ of plain ('default') rotary positions: transformers 5's rope_parameters (its entry for layer `kind`,
    e.g. "sliding_attention", where the family has one per kind) or the older config key `old_key`. Any
    other rope_type, there or in transformers 4's rope_scaling, is refused naming it."""
    params = hf.get("rope_parameters") or {}
    entry = (params.get(kind) or {}) if kind else params
    scaling = hf.get("rope_scaling") or {}
    for rope_type in (entry.get("rope_type", "default"), scaling.get("rope_type", scaling.get("type", "default"))):
        if rope_type != "default":
            where = f" for {kind}" if kind else ""
            raise CheckpointError(f"rope_type {rope_type!r}{where} is not supported; expected plain rotary positions "
                                  "('default')")
    return float(entry.get("rope_theta", hf.get(old_key, default)))


def sliding_layers(hf: Mapping[str, Any], layers: int, default: list[str]) -> tuple[int, ...]:
    """The indices of config.json's sliding_attention layers (its layer_types, else the family's `default`
    pattern): the attention plan's local layers. Anything but `layers` of full_attention / sliding_attention
    is refused naming it."""
    layer_types = hf.get("layer_types")
    layer_types = default if layer_types is None else layer_types
    unknown = sorted(set(layer_types) - {"sliding_attention", "full_attention"})
    if unknown or len(layer_types) != layers:
        raise CheckpointError(f"layer_types {layer_types} is not {layers} of full_attention / sliding_attention")
    return tuple(i for i, kind in enumerate(layer_types) if kind == "sliding_attention")


def require(hf: Mapping[str, Any], keys: tuple[str, ...]) -> None:
    """Refuses a config.json without all of `keys`, naming those it lacks."""
    absent = [k for k in keys if k not in hf]
    if absent:
        raise CheckpointError(f"config.json lacks {', '.join(absent)}")


def encoder_config(hf: Mapping[str, Any], name: str, source: Mapping[str, Any], **fields: Any) -> EncoderConfig:
    """EncoderConfig of a token encoder from config.json's sizes (hidden_size, num_attention_heads,
    num_hidden_layers, intermediate_size, vocab_size, pad_token_id) and the family's `fields` (which
    override these defaults); its ConfigError as a CheckpointError about config.json."""
    pad = hf.get("pad_token_id")
    defaults = dict(
        name=name,
        d_model=int(hf["hidden_size"]),
        n_heads=int(hf["num_attention_heads"]),
        n_layers=int(hf["num_hidden_layers"]),
        d_ff=int(hf["intermediate_size"]),
        input_kind="tokens",
        vocab_size=int(hf["vocab_size"]),
        embedding_layer_norm=True,
        pad_token_id=int(pad) if pad is not None else 0,
        scaling="sqrt_dk",  # softmax(QKᵀ / sqrt(head_dim))
        attention="softmax",
        source=dict(source),
    )
    try:
        return EncoderConfig(**{**defaults, **fields})
    except ConfigError as exc:
        raise CheckpointError(f"config.json does not describe a valid encoder: {exc}") from exc


def swiglu_decoder_config(hf: Mapping[str, Any], name: str, source: Mapping[str, Any], **fields: Any) -> EncoderConfig:
    """EncoderConfig of a Llama-style decoder embedder (Llama, Mistral, Qwen2/3): pre-norm RMSNorm, rotary
    positions (rope_fields: plain, linear or Llama 3.1's), grouped-query attention (num_key_value_heads) with config.json's
    head_dim, a SwiGLU MLP (hidden_act silu), no bias, causal as the natural mask; the family's `fields`
    override these (Qwen2's q/k/v bias, Qwen3's q/k norms, Mistral's window). hidden_act other than silu is
    refused naming it."""
    require(hf, ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size", "vocab_size"))
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise CheckpointError(f"hidden_act {act!r} is not supported; expected one of silu")
    hidden, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    head_dim = int(hf.get("head_dim") or hidden // heads)
    decoder = dict(
        n_kv_heads=int(hf.get("num_key_value_heads") or heads),
        attention_head_dim=head_dim if head_dim * heads != hidden else 0,
        max_positions=int(hf.get("max_position_embeddings", 32768)),
        type_vocab_size=0,
        embedding_layer_norm=False,
        norm="rms",
        layer_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        norm_placement="pre",
        positional="rotary",
        **rope_fields(hf, "rope_theta", 10000.0),
        activation="silu",
        ffn="gated",
        linear_bias=False,
        natural_mask="causal",
    )
    return encoder_config(hf, name, source, **{**decoder, **fields})
