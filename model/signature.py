"""The exported graph's signature: input and output names, dtypes and dims, in graph order.

Torch-free: the exporter derives its contract from it and the server checks a loaded graph
against it. `Encoder.forward` takes the inputs positionally in this order.
"""

from __future__ import annotations

from model.attention_paths import DENSE
from model.config import EncoderConfig
from model.mask_kinds import MASK_INPUTS

# The two outputs of every graph; a model with a task head (config.head) has a third, `head_output`.
OUTPUT_NAMES = ("last_hidden_state", "mean_pooled")
HEAD_OUTPUT_NAMES = {"classification": "logits", "sparse": "sparse_embedding", "multivector": "token_vectors",
                     "m3": "m3_tokens", "answer_tokens": "logits"}


def input_specs(config: EncoderConfig, path: str = DENSE) -> tuple[tuple[str, str, tuple[str | int, ...]], ...]:
    """(name, dtype, dims) per graph input; str dims are symbolic axes. Only the dense path's graph
    takes `custom_mask` (the long-input paths serve no custom rows, and hold no [B, T, T] tensor)."""
    if config.input_kind == "tokens":
        first = ("input_ids", "int64", ("batch", "sequence"))
    else:
        first = ("inputs_embeds", "float32", ("batch", "sequence", config.d_model))
    specs = [first, ("attention_mask", "int64", ("batch", "sequence"))]
    specs += [(name, dtype, dims) for name, (dtype, dims) in MASK_INPUTS.items()
              if path == DENSE or name != "custom_mask"]
    if config.type_vocab_size:
        specs.append(("token_type_ids", "int64", ("batch", "sequence")))
    return tuple(specs)


def head_output(config: EncoderConfig) -> tuple[str, str, tuple[str | int, ...]] | None:
    """(name, dtype, dims) of the task head's output, or None for a headless model: raw classification
    logits [batch, num_labels], SPLADE's sparse_embedding [batch, vocab_size], or ColBERT's token_vectors
    [batch, sequence, vector_dim] (model/heads.py)."""
    if config.head == "classification":
        return HEAD_OUTPUT_NAMES["classification"], "float32", ("batch", config.num_labels)
    if config.head == "sparse":
        return HEAD_OUTPUT_NAMES["sparse"], "float32", ("batch", config.vocab_size)
    if config.head == "multivector":
        return HEAD_OUTPUT_NAMES["multivector"], "float32", ("batch", "sequence", config.vector_dim)
    if config.head == "m3":
        return HEAD_OUTPUT_NAMES["m3"], "float32", ("batch", "sequence", config.d_model + 1)
    if config.head == "answer_tokens":  # one logit: the answer tokens' (model/heads.py AnswerTokenHead)
        return HEAD_OUTPUT_NAMES["answer_tokens"], "float32", ("batch", 1)
    return None


def output_specs(config: EncoderConfig) -> tuple[tuple[str, str, tuple[str | int, ...]], ...]:
    """The graph's outputs in order: the two base outputs, then the head's output when there is a head."""
    d = config.d_model
    base = (("last_hidden_state", "float32", ("batch", "sequence", d)), ("mean_pooled", "float32", ("batch", d)))
    head = head_output(config)
    return base if head is None else (*base, head)


def input_names(config: EncoderConfig, path: str = DENSE) -> tuple[str, ...]:
    return tuple(name for name, _, _ in input_specs(config, path))
