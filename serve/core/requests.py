"""Our own request and result types, and request validation against the model and the limits.

The servicer converts protobuf into these; the batcher runs them. No gRPC, no protobuf here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from model.config import EncoderConfig
from model.mask_kinds import MaskKind
from serve.backend.feeds import Row
from serve.errors import ValidationError



@dataclass(frozen=True)
class MaskChoice:
    kind: MaskKind = MaskKind.BIDIRECTIONAL
    causal: bool = False
    window: int = 0
    step: int = 1
    custom: np.ndarray | None = None  # bool [T, T], or [B, Tmax, Tmax] (padded to the longest sequence)


@dataclass(frozen=True)
class EncodeRequest:
    # int64/int32 [T] token ids, or float32 [T, d_model] features; or, rows of one length, the one array
    # [B, T] / [B, T, d_model] they came in (KServe v2's tensor as sent: checked at once, never cut up)
    sequences: tuple[np.ndarray, ...] | np.ndarray
    mask: MaskChoice = field(default_factory=MaskChoice)
    hidden_states: bool = False
    pooling: str = ""  # one of POOLINGS; "": the model's default (resolved by the Engine)
    normalize: bool | None = None  # None: the model's default (resolved by the Engine)
    request_id: str = ""
    texts: tuple[str, ...] = ()  # tokenized by the Engine into `sequences` (serve/core/text.py)
    truncate: bool = False  # texts only: cut a text over the tokenizer's max_length instead of refusing it
    truncated: tuple[bool, ...] = ()  # texts only, set by the Engine: which texts were cut
    chunk: bool = False  # texts only: encode a long text as overlapping windows, pooled (serve/core/text.py)
    chunks: tuple[int, ...] = ()  # texts only, set by the Engine with chunk: rows (windows) per text


@dataclass(frozen=True)
class SequenceOutput:
    hidden_states: np.ndarray | None  # float32 [T, D]
    embedding: np.ndarray | None  # float32 [D]


@dataclass(frozen=True)
class EncodeResult:
    request_id: str
    outputs: tuple[SequenceOutput, ...]
    queue_s: float
    inference_s: float
    batch_size: int
    batch_length: int
    execution_provider: str
    token_counts: tuple[int, ...] = ()  # tokens each sequence ran with (its row length)
    truncated: tuple[bool, ...] = ()  # texts only: which were cut to the tokenizer's max_length
    attention_paths: tuple[str, ...] = ()  # the attention path each sequence ran on (model/attention_paths.py)
    chunks: tuple[int, ...] = ()  # texts only, with chunk: windows each text was encoded in


@dataclass(frozen=True)
class Limits:
    max_sequences_per_request: int
    max_sequence_length: int
    max_request_tokens: int = 0  # sequences x longest length (the padded work); 0: no limit

    def check_count(self, n: int, field: str) -> None:
        """The one rule on how many sequences (or texts) a request holds."""
        if n == 0:
            raise ValidationError(f"{field}: empty request; send at least one {field[:-1]}")
        if n > self.max_sequences_per_request:
            raise ValidationError(f"{field}: {n} {field} exceed max_sequences_per_request={self.max_sequences_per_request}")


def to_rows(request: EncodeRequest, config: EncoderConfig, limits: Limits) -> tuple[Row, ...]:
    """Validates `request`; ValidationError names the field and the limit it broke."""
    n = len(request.sequences)
    limits.check_count(n, "sequences")
    max_len = limits.max_sequence_length
    inputs = [_check_sequence(i, s, config, max_len) for i, s in enumerate(request.sequences)]
    block = request.sequences if isinstance(request.sequences, np.ndarray) else None
    _check_values(inputs, config, block)
    padded = n * max(len(x) for x in inputs)
    if limits.max_request_tokens and padded > limits.max_request_tokens:
        raise ValidationError(
            f"sequences: {n} sequences padded to length {padded // n} are {padded} tokens, "
            f"over max_request_tokens={limits.max_request_tokens}; split the request"
        )
    mask = request.mask
    customs = _check_mask(mask, [len(x) for x in inputs], max_len)
    return tuple(
        Row(x, int(mask.kind), bool(mask.causal), int(mask.window), int(mask.step) if mask.step else 1, c)
        for x, c in zip(inputs, customs)
    )


def _check_sequence(index: int, seq: np.ndarray, config: EncoderConfig, max_len: int) -> np.ndarray:
    """One sequence's dtype, shape and length (its values: `_check_values`, over all rows at once)."""
    tokens = config.input_kind == "tokens"
    if tokens:
        if seq.dtype.kind not in "iu" or seq.ndim != 1:
            raise ValidationError(f"sequences[{index}]: token ids must be INT64 or INT32 of shape [T], got "
                                  f"{seq.dtype} {list(seq.shape)}")
    elif seq.dtype != np.float32 or seq.ndim != 2 or seq.shape[1] != config.d_model:
        raise ValidationError(f"sequences[{index}]: this model takes raw features FLOAT32 [T, {config.d_model}], "
                              f"got {seq.dtype} {list(seq.shape)}")
    length = seq.shape[0]
    if length == 0:
        raise ValidationError(f"sequences[{index}]: empty sequence; send at least one token")
    if length > max_len:
        raise ValidationError(f"sequences[{index}]: length {length} exceeds max_sequence_length={max_len}")
    return seq.astype(np.int64, copy=False) if tokens else seq


def _check_values(inputs: list[np.ndarray], config: EncoderConfig, block: np.ndarray | None = None) -> None:
    """Token ids in the vocabulary, features finite: one pass over every row at once (`block`: the
    rows' own array, when they came as one); a failure names the first row that broke the rule."""
    flat = block if block is not None else inputs[0] if len(inputs) == 1 else np.concatenate(inputs)
    if config.input_kind == "tokens":
        if int(flat.min()) >= 0 and int(flat.max()) < config.vocab_size:
            return
        for index, seq in enumerate(inputs):
            low, high = int(seq.min()), int(seq.max())
            if low < 0 or high >= config.vocab_size:
                raise ValidationError(f"sequences[{index}]: token id {low if low < 0 else high} out of range "
                                      f"[0, {config.vocab_size})")
    if np.isfinite(flat).all():
        return
    index = next(i for i, seq in enumerate(inputs) if not np.isfinite(seq).all())
    raise ValidationError(f"sequences[{index}]: features contain NaN or infinity")


def _check_mask(mask: MaskChoice, lengths: list[int], max_len: int) -> list[np.ndarray | None]:
    kind = mask.kind
    if mask.causal and not kind.takes_causal_flag and kind != MaskKind.CAUSAL:
        raise ValidationError(
            f"mask.causal: the causal flag combines with sliding_window, dilated or local_strided, "
            f"not {kind.label} (use kind=causal)"
        )
    if kind.uses_window and not 0 <= mask.window <= max_len:
        raise ValidationError(f"mask.window: {mask.window} out of range [0, {max_len}] for {kind.label}")
    if kind.uses_step and not 1 <= mask.step <= max_len:
        raise ValidationError(f"mask.step: {mask.step} out of range [1, {max_len}] for {kind.label}")
    if kind != MaskKind.CUSTOM:
        if mask.custom is not None:
            raise ValidationError(f"mask.custom: only used with kind=custom, not {kind.label}")
        return [None] * len(lengths)
    custom = mask.custom
    if custom is None:
        raise ValidationError("mask.custom: kind=custom needs a BOOL [T, T] or [B, T, T] tensor")
    if custom.dtype != np.bool_:
        raise ValidationError(f"mask.custom: dtype must be BOOL, got {custom.dtype}")
    n, longest = len(lengths), max(lengths)
    if custom.ndim == 2:
        matrices = [custom] * n
    elif custom.ndim == 3:
        # [B, Tmax, Tmax]: one matrix per sequence, padded to the longest; row i uses its top-left
        # [T_i, T_i] (entries past its own length are ignored). Equal lengths: the exact form.
        if custom.shape != (n, longest, longest):
            raise ValidationError(
                f"mask.custom: shape {list(custom.shape)} must be [{n}, {longest}, {longest}]: one matrix per "
                f"sequence ({n}), padded to the longest sequence ({longest}); entries past a shorter "
                f"sequence's length are ignored"
            )
        return [m[:length, :length] for m, length in zip(custom, lengths)]
    else:
        raise ValidationError(f"mask.custom: shape {list(custom.shape)} must be [T, T] or [B, T, T]")
    for i, (m, length) in enumerate(zip(matrices, lengths)):
        if m.shape != (length, length):
            raise ValidationError(
                f"mask.custom: shape {list(custom.shape)} does not match sequences[{i}] of length {length} "
                f"(needs [{length}, {length}]; for sequences of unequal length send [B, Tmax, Tmax])"
            )
    return matrices
