"""Hugging Face task heads (model/heads.py): how a head is loaded, whatever its family. Each family's own heads
(which checkpoint modules make each head, which config.json keys set it up) are in its family file
(`Family.heads`, `Family.head_config`: model/hf_bert.py, hf_roberta.py, hf_modernbert.py, hf_mpnet.py,
hf_deberta.py); here, what they share: which head a directory declares, its tensors in our names, the
sentence-transformers files that declare one, and the task metadata.json records. model/hf_pretrained.py loads
the encoder and calls in here for the head.

  classification  a *ForSequenceClassification checkpoint (a cross-encoder, a classifier; sentence-transformers'
                  CrossEncoder saves one), loaded strictly: every head tensor is used
  sparse          SPLADE: a *ForMaskedLM checkpoint's MLM head + sentence-transformers' SpladePooling (max, relu);
                  a SparseEncoder directory declares it (modules.json), `--head sparse` forces it
  answer_tokens   an LLM reranker (Qwen3-Reranker; bge-reranker-v2-gemma's recipe on Gemma3): a *ForCausalLM
                  checkpoint's lm_head rows of its answer tokens ("no", "yes"; "Yes"), under a prompt template
                  (model/tasks.py RERANK_TEMPLATES) that `--reranker-template NAME` names; the rows are the word
                  embeddings' when the checkpoint ties them

The MLM decoder's weight is tied to the word embeddings in Hugging Face checkpoints: read from the checkpoint's
decoder weight when it has one, else from the embedding matrix.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import torch

from model.checkpoint import CheckpointError
from model.config import ConfigError, EncoderConfig
from model.hf_family import Family
from model.tasks import RERANK_TEMPLATES, TaskError, default_labels, score_activation, task_for, template_entry

# The MLM decoder's weight (ours) and what it is tied to (ours): the word embeddings.
TIED_DECODER = ("head.out.weight", "embeddings.tokens.weight")
_SUFFIXES = {"weight": "weight", "bias": "bias", "gamma": "weight", "beta": "bias"}

SEQUENCE_CLASSIFICATION = "ForSequenceClassification"

# sentence-transformers modules of the heads (by class name; old and new homes alike, see hf_pretrained._module_kind).
ST_SPLADE_POOLING = "sentence_transformers.sparse_encoder.models.SpladePooling"
PYLATE_DENSE = "pylate.models.Dense.Dense"  # a PyLate ColBERT's projection (model/hf_colbert.py)
# SpladePooling settings we compute; any other is refused naming it.
SPLADE_SETTINGS: Mapping[str, str] = {"pooling_strategy": "max", "activation_function": "relu"}
CROSS_ENCODER_TASK = "sequence-classification"  # sentence_bert_config.json's transformer_task of a CrossEncoder
CAUSAL_LM = "ForCausalLM"  # the architectures an LLM reranker's answer_tokens head reads the lm_head of


def detect_head(hf: Mapping[str, Any], st_kinds: list[str | None], requested: str | None, drop_head: bool,
                template: str | None = None) -> str:
    """The head to load: answer_tokens under a reranker `template` (`--reranker-template`; only of a
    *ForCausalLM checkpoint), none when dropped (`--encoder-only`), else the one asked for (`--head`), else
    sparse for a sentence-transformers SparseEncoder (a SpladePooling module), multivector for a PyLate
    ColBERT (its Dense module), classification for a
    *ForSequenceClassification architecture, else none (a base or MLM checkpoint exports its encoder)."""
    if template is not None:
        architectures = list(hf.get("architectures") or [])
        if not any(a.endswith(CAUSAL_LM) for a in architectures):
            raise CheckpointError(f"--reranker-template {template}: an LLM reranker is a *{CAUSAL_LM} checkpoint "
                                  f"(its lm_head scores the answer tokens); this one is {architectures or 'unnamed'}")
        return "answer_tokens"
    if drop_head:
        return "none"
    if requested:
        return requested
    if ST_SPLADE_POOLING in st_kinds:
        return "sparse"
    if PYLATE_DENSE in st_kinds:
        return "multivector"
    if any(a.endswith(SEQUENCE_CLASSIFICATION) for a in hf.get("architectures") or []):
        return "classification"
    return "none"


def head_fields(family: Family, hf: Mapping[str, Any], head: str, tokens: tuple[int, ...] = ()) -> dict[str, Any]:
    """EncoderConfig head fields for the family's head (model/heads.py), from config.json (`tokens`: an
    answer_tokens head's vocabulary ids, answer_token_ids)."""
    if head == "none":
        return {}
    if head not in family.heads or family.head_config is None:
        raise CheckpointError(f"model_type {hf.get('model_type')!r} has no {head} head here; its family exports "
                              f"{', '.join(family.heads) or 'no task head'}")
    fields: dict[str, Any] = {"head": head, **family.head_config(hf, head)}
    if head == "classification":
        fields["num_labels"] = len(hf["id2label"]) if hf.get("id2label") else int(hf.get("num_labels", 2))
    if head == "answer_tokens":
        fields.update(num_labels=1, head_tokens=tuple(tokens))
    return fields


def with_head(config: EncoderConfig, family: Family, hf: Mapping[str, Any], head: str,
              tokens: tuple[int, ...] = ()) -> EncoderConfig:
    """`config` with the head's fields (head_fields); a CheckpointError naming what does not fit."""
    fields = head_fields(family, hf, head, tokens)
    try:
        return config.replace(**fields)
    except ConfigError as exc:
        raise CheckpointError(f"config.json does not describe a valid {head} head: {exc}") from exc


@dataclass
class HeadTensors:
    """A checkpoint's head tensors in our names (`ours`, with `back`: our name -> the checkpoint's), every
    checkpoint name under the head's modules (`seen`), and those of them that fit nothing (`unused`, as shown)."""

    ours: dict[str, torch.Tensor] = field(default_factory=dict)
    back: dict[str, str] = field(default_factory=dict)
    seen: list[str] = field(default_factory=list)
    unused: list[str] = field(default_factory=list)


def map_head_tensors(family: Family, head: str, tensors: Mapping[str, torch.Tensor], names: list[str],
                     prefix: str, encoder: Mapping[str, torch.Tensor], encoder_names: Mapping[str, str],
                     rows: tuple[int, ...] = (), tied: bool = True) -> HeadTensors:
    """The head's tensors among `names` (checkpoint names the encoder did not take), by the family's heads; the
    decoder weight, when the checkpoint has none and is `tied`, from the word embeddings it is tied to
    (`encoder`: the encoder's tensors in our names, `encoder_names`: their checkpoint names). An answer_tokens
    head keeps only the `rows` (vocabulary ids) of the lm_head (or of the tied embeddings)."""
    found = HeadTensors()
    if head == "none":
        return found
    modules = family.heads[head]
    for name in names:
        bare = name[len(prefix):] if name.startswith(prefix) else name
        module, _, suffix = bare.rpartition(".")
        if not any(bare.startswith(m + ".") for m in modules):
            continue  # not this head's (an NSP head, a pooler beside an MLM head, ...): stays ignored
        found.seen.append(name)
        target = f"{modules[module]}.{_SUFFIXES[suffix]}" if module in modules and suffix in _SUFFIXES else None
        if target is None:
            found.unused.append(name)
        elif target not in found.ours:
            found.ours[target], found.back[target] = tensors[name], name
        elif not torch.equal(found.ours[target], tensors[name]):  # else a tied copy
            found.unused.append(f"{name} (differs from its tied copy {found.back[target]})")
    decoder, embeddings = TIED_DECODER
    if head in ("sparse", "answer_tokens") and decoder not in found.ours and embeddings in encoder and tied:
        found.ours[decoder], found.back[decoder] = encoder[embeddings], f"{encoder_names[embeddings]} (tied)"
    if head == "answer_tokens" and decoder in found.ours:  # (vocab, D) -> (k, D): only the answers' rows
        found.ours[decoder] = found.ours[decoder][list(rows)].clone()
        found.back[decoder] = f"{found.back[decoder]} rows {list(rows)}"
    return found


def head_name_in_checkpoint(family: Family, head: str, name: str) -> str | None:
    """The checkpoint's name of one of our head tensors (for messages about tensors a checkpoint lacks)."""
    if head == "none" or not name.startswith("head."):
        return None
    module, _, suffix = name.rpartition(".")
    theirs = [m for m, ours in family.heads[head].items() if ours == module]
    return " or ".join(f"{m}.{suffix}" for m in theirs) or None


# --------------------------------------------------------------------------------------------
# sentence-transformers: a SparseEncoder's SpladePooling, a CrossEncoder's activation.


def check_splade_pooling(directory: Path, module: Mapping[str, Any]) -> None:
    """Refuses SpladePooling settings other than SPLADE_SETTINGS (max pooling of log1p(relu)), naming them."""
    path = directory / module.get("path", "") / "config.json"
    settings = json.loads(path.read_text()) if path.is_file() else {}
    wrong = [f"{key}={settings[key]!r}" for key, want in SPLADE_SETTINGS.items() if settings.get(key, want) != want]
    if wrong:
        raise CheckpointError(f"{path}: SpladePooling with {', '.join(wrong)} is not supported; the sparse head "
                              f"computes {', '.join(f'{k}={v!r}' for k, v in SPLADE_SETTINGS.items())}")


def check_transformer_task(directory: Path, module: Mapping[str, Any], head: str) -> None:
    """A sentence-transformers Transformer module's transformer_task must be the head's: fill-mask under a
    SpladePooling (MLM logits), sequence-classification for a CrossEncoder."""
    path = directory / module.get("path", "") / "sentence_bert_config.json"
    task = json.loads(path.read_text()).get("transformer_task") if path.is_file() else None
    expected = {"sparse": "fill-mask", "classification": CROSS_ENCODER_TASK}.get(head)
    if task is not None and expected is not None and task != expected:
        raise CheckpointError(f"{path}: transformer_task {task!r} does not give the {head} head's input "
                              f"(expected {expected!r})")


def cross_encoder_activation_fn(directory: Path, hf: Mapping[str, Any]) -> str | None:
    """The activation_fn a sentence-transformers CrossEncoder saved: config.json's "sentence_transformers"
    (v4, v5), config_sentence_transformers.json (v6), or the pre-v4 sbert_ce_default_activation_function."""
    declared = (hf.get("sentence_transformers") or {}).get("activation_fn")
    st_file = directory / "config_sentence_transformers.json"
    if declared is None and st_file.is_file():
        declared = json.loads(st_file.read_text()).get("activation_fn")
    return declared if declared is not None else hf.get("sbert_ce_default_activation_function")


def answer_token_ids(tokenizer_file: Path | None, template: str) -> tuple[int, ...]:
    """The vocabulary ids of reranker `template`'s answer tokens (transformers' convert_tokens_to_ids: the
    token itself, never a text's tokenization) in tokenizer.json; a CheckpointError naming one it lacks."""
    if template not in RERANK_TEMPLATES:
        raise CheckpointError(f"reranker template {template!r} is not one of {', '.join(RERANK_TEMPLATES)}")
    if tokenizer_file is None or not tokenizer_file.is_file():
        raise CheckpointError(f"--reranker-template {template}: the checkpoint has no tokenizer.json to find its "
                              "answer tokens in")
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    ids = [tokenizer.token_to_id(token) for token in RERANK_TEMPLATES[template]["answers"]]
    missing = [token for token, i in zip(RERANK_TEMPLATES[template]["answers"], ids) if i is None]
    if missing:
        raise CheckpointError(f"{tokenizer_file}: the reranker template {template!r} answers with token(s) "
                              f"{missing}, not in its vocabulary")
    return tuple(int(i) for i in ids)


def task_from_checkpoint(directory: Path, hf: Mapping[str, Any], config: EncoderConfig,
                         template: str | None = None) -> dict:
    """metadata.json's "task" (model/tasks.py) for a loaded checkpoint: labels from id2label in label-id
    order, the score activation from the CrossEncoder's activation_fn, else problem_type, else num_labels;
    an LLM reranker's from its `template` name and its answer ids (config.head_tokens)."""
    try:
        if config.head == "answer_tokens":
            return task_for(config, template=template_entry(template, config.head_tokens))
        if config.head != "classification":
            return task_for(config)
        id2label = {int(k): str(v) for k, v in (hf.get("id2label") or {}).items()}
        labels = [id2label.get(i, name) for i, name in enumerate(default_labels(config.num_labels))]
        activation = score_activation(config.num_labels, activation_fn=cross_encoder_activation_fn(directory, hf),
                                      problem_type=hf.get("problem_type"))
        return task_for(config, labels=labels, activation=activation)
    except TaskError as exc:
        raise CheckpointError(f"{directory}: {exc}") from exc
