"""The ELECTRA family (transformers' ElectraModel, the discriminator body: electra-small/base/large-discriminator
and the cross-encoders and classifiers fine-tuned from them): its checkpoint ⇄ encoder names, config.json →
EncoderConfig, its classification head.

  electra  BERT's layers, names and config keys (model/hf_bert.py) under "electra.", and factorised embeddings:
           when embedding_size differs from hidden_size (electra-small: 128 -> 256) the word / position /
           token-type embeddings and their LayerNorm are embedding_size wide and embeddings_project, a Linear
           embedding_size -> hidden_size, follows the LayerNorm (config embedding_size)

Ignored: the pretraining heads (ElectraForPreTraining's discriminator_predictions, ElectraForMaskedLM's
generator_predictions and generator_lm_head), as BERT's cls.; a checkpoint carrying another task head is refused
by the shared loader. Refused, naming it: what BERT's config reading refuses (model/hf_bert.py check_bert_config).

Heads: ElectraForSequenceClassification's ElectraClassificationHead, the first token -> classifier.dense ->
exact GELU -> classifier.out_proj (RoBERTa's names, GELU for its tanh).

Loaded by the shared strict loader (model/hf_pretrained.py) through `FAMILY`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Mapping

import torch

from model import hf_bert
from model.config import EncoderConfig
from model.hf_bert import bert_layout_config, check_bert_config
from model.hf_family import Mapped
from model.hf_roberta import ROBERTA_HEADS

ELECTRA_TYPE = "electra"
# Task models (ElectraForSequenceClassification, ElectraForPreTraining, ...) prefix the encoder's names with this.
ELECTRA_PREFIX = "electra."
# The factorised embeddings' projection (ElectraModel.embeddings_project) -> ours.
ELECTRA_PROJECTION_NAMES: Mapping[str, str] = {"embeddings_project.weight": "embeddings.project.weight",
                                               "embeddings_project.bias": "embeddings.project.bias"}
ELECTRA_IGNORED_PREFIXES = ("discriminator_predictions.", "generator_predictions.", "generator_lm_head.",
                            "classifier.", "qa_outputs.")


def electra_to_encoder(name: str, tensor: torch.Tensor) -> Mapped:
    """[(our name, tensor, name)] for an ElectraModel tensor: BERT's names and the embeddings' projection."""
    if name in ELECTRA_PROJECTION_NAMES:
        return [(ELECTRA_PROJECTION_NAMES[name], tensor, name)]
    return hf_bert.bert_to_encoder(name, tensor)


def encoder_to_electra_name(name: str) -> str | None:
    """The checkpoint's name of one of our tensors (for messages about tensors a checkpoint lacks)."""
    theirs = {ours: theirs for theirs, ours in ELECTRA_PROJECTION_NAMES.items()}
    return theirs.get(name) or hf_bert.encoder_to_bert_name(name)


def electra_config(hf: Mapping[str, Any], name: str, source: Mapping[str, Any] = ()) -> EncoderConfig:
    """EncoderConfig for an ELECTRA config.json: BERT's, with the embeddings' projection when embedding_size is
    not hidden_size (ElectraModel has embeddings_project exactly then)."""
    check_bert_config(hf)
    width = int(hf.get("embedding_size", hf["hidden_size"]))
    return bert_layout_config(hf, name, source, embedding_size=0 if width == int(hf["hidden_size"]) else width)


def electra_head_config(hf: Mapping[str, Any], head: str) -> dict[str, Any]:
    """ElectraClassificationHead: the first token, dense, the exact GELU (get_activation("gelu")), no norm."""
    return dict(head_pooling="cls", head_activation="gelu", head_norm=False, head_bias=True, head_out_bias=True)


# BERT's family but for the model_type, the task models' prefix, the embeddings' projection, the ignore prefixes
# and the classification head (RoBERTa's module names).
FAMILY = replace(hf_bert.FAMILY, model_types=(ELECTRA_TYPE,), prefix=ELECTRA_PREFIX, config=electra_config,
                 to_encoder=electra_to_encoder, name_in_checkpoint=encoder_to_electra_name,
                 ignored_prefixes=ELECTRA_IGNORED_PREFIXES,
                 heads={"classification": ROBERTA_HEADS["classification"]}, head_config=electra_head_config)
