"""The RoBERTa family: model_type roberta and xlm-roberta. BERT's layers and names (model/hf_bert.py);
positions numbered from pad_token_id + 1 (RoBERTa's position ids: config position_ids="after_padding"),
one token type, task models under "roberta.", the MLM head under "lm_head.", the classifier under
"classifier." (its heads: ROBERTA_HEADS).

Loaded by the shared strict loader (model/hf_pretrained.py) through `FAMILY`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Mapping

from model import hf_bert
from model.checkpoint import CheckpointError
from model.config import EncoderConfig
from model.hf_bert import bert_layout_config, check_bert_config

ROBERTA_TYPES = ("roberta", "xlm-roberta")
# Task models (RobertaForMaskedLM, ...) prefix the encoder's names with this, for both model_types.
ROBERTA_PREFIX = "roberta."
ROBERTA_IGNORED_PREFIXES = ("pooler.", "lm_head.", "classifier.", "qa_outputs.")


def roberta_config(hf: Mapping[str, Any], name: str, source: Mapping[str, Any] = ()) -> EncoderConfig:
    """EncoderConfig for a RoBERTa / XLM-RoBERTa config.json: BERT's, with position ids after pad_token_id
    (which it therefore needs)."""
    check_bert_config(hf)
    if hf.get("pad_token_id") is None:
        raise CheckpointError(f"a {hf.get('model_type')} config.json needs pad_token_id "
                              "(its position ids start after it)")
    return bert_layout_config(hf, name, source, position_ids="after_padding")


# RoBERTa's task heads: classifier.dense + out_proj (no pooler), the MLM head under lm_head.
ROBERTA_HEADS: Mapping[str, Mapping[str, str]] = {
    "classification": {"classifier.dense": "head.dense", "classifier.out_proj": "head.out"},
    "sparse": {"lm_head.dense": "head.dense", "lm_head.layer_norm": "head.norm", "lm_head.decoder": "head.out",
               "lm_head": "head.out"},
}


def roberta_head_config(hf: Mapping[str, Any], head: str) -> dict[str, Any]:
    """The classifier as BERT's (first token, dense, tanh); lm_head's transform: dense, exact GELU, LayerNorm."""
    if head == "classification":
        return hf_bert.bert_head_config(hf, head)
    return dict(head_activation="gelu", head_norm=True, head_bias=True, head_out_bias=True)


# BERT's family but for the model_types, the task models' prefix, the config reading, the ignore prefixes and
# the heads.
FAMILY = replace(hf_bert.FAMILY, model_types=ROBERTA_TYPES, prefix=ROBERTA_PREFIX, config=roberta_config,
                 ignored_prefixes=ROBERTA_IGNORED_PREFIXES, heads=ROBERTA_HEADS, head_config=roberta_head_config)
