"""The RoBERTa family: model_type roberta and xlm-roberta. BERT's layers and names (model/hf_bert.py);
positions numbered from pad_token_id + 1 (RoBERTa's position ids: config position_ids="after_padding"),
one token type, task models under "roberta.", the MLM head under "lm_head.".

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


# BERT's family but for the model_types, the task models' prefix, the config reading and the ignore prefixes.
FAMILY = replace(hf_bert.FAMILY, model_types=ROBERTA_TYPES, prefix=ROBERTA_PREFIX, config=roberta_config,
                 ignored_prefixes=ROBERTA_IGNORED_PREFIXES)
