"""The core's own request and result types, and their validation against the model and the limits.

`Work` is what the task verbs (serve/core/tasks/) hand the core and the batcher runs; `to_rows` checks it
once and gives its rows in batch form. No gRPC, no protobuf, no protocol's field names here but the core's.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Mapping

import numpy as np

from model.config import EncoderConfig
from model.attention_paths import RowMask
from model.mask_kinds import MaskKind
from serve.backend.feeds import Rows, constant
from serve.errors import ValidationError, quote



@dataclass(frozen=True)
class MaskChoice:
    kind: MaskKind | None = None  # None: the model's natural mask (config.natural_mask; resolved by to_rows)
    causal: bool = False
    window: int = 0
    step: int = 1
    custom: np.ndarray | None = None  # bool [T, T], or [B, Tmax, Tmax] (padded to the longest sequence)


def mask_choice(kind: MaskKind | int | str | None = None, causal: bool = False, window: int = 0, step: int = 1,
                custom: np.ndarray | None = None, *, field: str = "mask.kind") -> MaskChoice:
    """The one reading of a mask kind as any protocol sends it: None (the model's natural mask), a MaskKind, its
    number (an int, or a string of digits), or its label in any case (`sliding_window`, `Sliding-Window`).
    Anything else is refused naming `field` and the kinds there are. The other fields are the core's to check
    (to_rows: each against the row lengths)."""
    return MaskChoice(None if kind is None else _mask_kind(kind, field), causal, window, step, custom)


def _mask_kind(value, field: str) -> MaskKind:
    if isinstance(value, MaskKind):
        return value
    if isinstance(value, str) and len(value) <= 64:  # longer is no kind (and int() of it is costly)
        try:
            return MaskKind(int(value)) if value.isdigit() else MaskKind.parse(value)
        except ValueError:
            pass
    elif isinstance(value, int) and not isinstance(value, bool) and value in MaskKind._value2member_map_:
        return MaskKind(value)
    raise ValidationError(f"{field}: unknown value {quote(value)}; expected one of "
                          f"{', '.join(k.label for k in MaskKind)}")


@dataclass(frozen=True, slots=True)
class Work:
    """What the core runs for one call: its rows and what to answer of them. The task verbs
    (serve/core/tasks/) make it, with every default already resolved: the core applies none.

    Rows are int64/int32 [T] token ids or float32 [T, d_model] features, one array per row; or the one
    array [B, T] / [B, T, d_model] they came in (KServe v2's tensor as sent: checked at once, never cut up)
    with each row's length (right padding; what lies past it is ignored; None: all T)."""

    sequences: tuple[np.ndarray, ...] | np.ndarray
    mask: MaskChoice = MaskChoice()
    hidden_states: bool = False  # answer the per-token hidden states
    pooling: str = "none"  # the pooled embedding to answer (serve/core/pooling.py POOLINGS); "none": none
    normalize: bool = False  # L2-normalise the pooled embeddings (a chunked text's: after pooling its windows)
    scores: bool = False  # answer the model's head output (a model with a head)
    request_id: str = ""
    lengths: np.ndarray | None = None
    types: tuple[np.ndarray, ...] = ()  # int64 [T] token type ids per row (sentence pairs); (): zeros
    truncated: tuple[bool, ...] = ()  # texts: which were cut to the tokenizer's max_length (reported back)
    chunks: tuple[int, ...] = ()  # texts cut into windows: rows per text (the verb pools them back)


@dataclass(frozen=True)
class SequenceOutput:
    """One row of a result (EncodeResult.outputs): views of the result's arrays."""

    hidden_states: np.ndarray | None  # float32 [T, D] of the row's own length
    embedding: np.ndarray | None  # float32 [D]
    scores: np.ndarray | None = None  # float32 [labels] or [vocab]: a head's output


@dataclass(frozen=True)
class EncodeResult:
    """A request's answer in batch form: one array per output, views of the run's output where the
    request ran as one piece of one run (serve/core/runs.py)."""

    request_id: str
    hidden_states: np.ndarray | None  # float32 [B, T, D], T the longest row; zeros past each row's length
    embeddings: np.ndarray | None  # float32 [B, D] (pooled, normalised when asked)
    queue_s: float
    inference_s: float
    batch_size: int
    batch_length: int
    execution_provider: str
    token_counts: tuple[int, ...] = ()  # tokens each sequence ran with (its row length)
    truncated: tuple[bool, ...] = ()  # texts only: which were cut to the tokenizer's max_length
    attention_paths: tuple[str, ...] = ()  # the attention path each sequence ran on (model/attention_paths.py)
    chunks: tuple[int, ...] = ()  # texts only, with chunk: windows each text was encoded in
    # a model with a head (serve/core/tasks/): its raw output per sequence, float32 [B, labels] logits
    # or [B, vocab] sparse weights
    scores: np.ndarray | None = None
    # the pooled embeddings in the output encodings a request asked for (serve/core/encodings.py), by name:
    # int8 / uint8 [B, D], binary / ubinary [B, ceil(D / 8)], float / base64 the float32 [B, D] embeddings
    encoded: Mapping[str, np.ndarray] | None = None

    def __len__(self) -> int:
        for rows in (self.embeddings, self.scores, self.hidden_states):
            if rows is not None:
                return len(rows)
        return len(self.token_counts)

    @functools.cached_property
    def outputs(self) -> tuple[SequenceOutput, ...]:
        """Row by row, for protocols that answer per sequence (Encode, OpenAI): views, no copies."""
        hidden, embeddings, scores = self.hidden_states, self.embeddings, self.scores
        return tuple(SequenceOutput(None if hidden is None else hidden[i, :n],
                                    None if embeddings is None else embeddings[i],
                                    None if scores is None else scores[i])
                     for i, n in enumerate(self.token_counts))


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


def to_rows(request: Work, config: EncoderConfig, limits: Limits, budget=None) -> Rows:
    """Validates `request` and gives its rows in batch form (one block, each row's length), each
    row's attention path and the attention memory they need decided by `budget`
    (serve/core/attention_budget.py; None: dense, not counted). ValidationError names the field and
    the limit it broke; TooLarge, the attention budget."""
    n = len(request.sequences)
    limits.check_count(n, "sequences")
    max_len = limits.max_sequence_length
    if isinstance(request.sequences, np.ndarray):
        block, lengths = _check_block(request.sequences, request.lengths, config, max_len)
    else:
        block, lengths = _pad(
            [_check_sequence(i, s, config, max_len) for i, s in enumerate(request.sequences)], config)
    _check_values(block, lengths, config)
    # a block whose rows are all as wide as it (the common case) needs no reduction to know these
    longest, tokens = (block.shape[1], n * block.shape[1]) if request.lengths is None and \
        isinstance(request.sequences, np.ndarray) else (int(lengths.max()), int(lengths.sum()))
    padded = n * longest
    if limits.max_request_tokens and padded > limits.max_request_tokens:
        raise ValidationError(
            f"sequences: {n} sequences padded to length {longest} are {padded} tokens, "
            f"over max_request_tokens={limits.max_request_tokens}; split the request"
        )
    mask = request.mask
    # the request chose none: the model's natural mask (config.natural_mask)
    kind = _natural(config.natural_mask) if mask.kind is None else mask.kind
    custom = _check_mask(kind, mask, lengths, max_len)
    step = int(mask.step) if mask.step else 1
    row_mask = RowMask(kind, int(mask.window), step)
    attention_bytes, paths = (0, ()) if budget is None else budget.check(lengths, row_mask)
    row_elements = 0 if budget is None else budget.row_elements(longest, row_mask)
    types = _pad_types(request.types, block.shape[1]) if len(request.types) else None
    return Rows(block, lengths, int(kind), bool(mask.causal), int(mask.window), step, custom, paths,
                attention_bytes=attention_bytes, types=types, row_elements=row_elements, longest=longest,
                tokens=tokens)


@functools.lru_cache(maxsize=None)
def _natural(label: str) -> MaskKind:
    return MaskKind.parse(label)


def _pad_types(types: tuple[np.ndarray, ...], width: int) -> np.ndarray:
    """Each sequence's token type ids as one block [n, width], zeros past its length."""
    block = np.zeros((len(types), width), np.int64)
    for i, row in enumerate(types):
        block[i, : len(row)] = row
    return block


def _check_block(block: np.ndarray, lengths: np.ndarray | None, config: EncoderConfig,
                 max_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows that came as one array [B, T] (or [B, T, D]), each `lengths[i]` long (None: T): checked
    at once; what lies past a row's length becomes padding (pad id, zero features)."""
    tokens = config.input_kind == "tokens"
    want = 2 if tokens else 3
    if block.ndim != want or (tokens and block.dtype.kind not in "iu") or (
            not tokens and (block.dtype != np.float32 or block.shape[2] != config.d_model)):
        _check_sequence(0, block[0], config, max_len)  # names the first row's dtype or shape
    n, width = block.shape[:2]
    block = block.astype(np.int64, copy=False) if tokens else block
    if lengths is None:  # every row is `width` long: one check of it
        if not 0 < width <= max_len:
            _check_sequence(0, block[0], config, max_len)
        return block, constant((n,), width, np.int64)
    lengths = np.asarray(lengths, np.int64)
    for i in np.flatnonzero((lengths == 0) | (lengths > max_len))[:1]:
        _check_sequence(int(i), block[i, : lengths[i]], config, max_len)
    if int(lengths.min()) < width:
        past = np.arange(width) >= lengths[:, None]
        block = np.where(past if tokens else past[:, :, None], config.pad_token_id if tokens else 0, block)
    return block, lengths


def _pad(inputs: list[np.ndarray], config: EncoderConfig) -> tuple[np.ndarray, np.ndarray]:
    """Checked rows as one right-padded block and their lengths."""
    lengths = np.fromiter((len(x) for x in inputs), np.int64, len(inputs))
    longest = int(lengths.max())
    if int(lengths.min()) == longest:
        return (inputs[0][None] if len(inputs) == 1 else np.stack(inputs)), lengths
    if config.input_kind == "tokens":
        block = np.full((len(inputs), longest), config.pad_token_id, np.int64)
    else:
        block = np.zeros((len(inputs), longest, config.d_model), np.float32)
    for i, x in enumerate(inputs):
        block[i, : len(x)] = x
    return block, lengths


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


def _check_values(block: np.ndarray, lengths: np.ndarray, config: EncoderConfig) -> None:
    """Token ids in the vocabulary, features finite: one pass over the block (its padding holds the
    pad id or zeros, which pass); a failure names the first row that broke the rule."""
    if config.input_kind == "tokens":
        # one pass: as unsigned, a negative id reads as a huge one (the int64 block's bits, not copied)
        if int(block.view(np.uint64).max()) < config.vocab_size:
            return
        bad = (block < 0) | (block >= config.vocab_size)
        index = int(np.flatnonzero(bad.any(axis=1))[0])
        row = block[index, : lengths[index]]
        low, high = int(row.min()), int(row.max())
        raise ValidationError(f"sequences[{index}]: token id {low if low < 0 else high} out of range "
                              f"[0, {config.vocab_size})")
    finite = np.isfinite(block)
    if finite.all():
        return
    index = int(np.flatnonzero(~finite.all(axis=(1, 2)))[0])
    raise ValidationError(f"sequences[{index}]: features contain NaN or infinity")


def _check_mask(kind: MaskKind, mask: MaskChoice, lengths: np.ndarray, max_len: int) -> np.ndarray | None:
    """The mask's fields checked (`kind`: its kind, the model's natural one where the request chose none);
    kind=custom: the custom mask as Rows holds it (bool [n, T, T], T the longest row, False past each row's
    own length)."""
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
        return None
    custom = mask.custom
    if custom is None:
        raise ValidationError("mask.custom: kind=custom needs a BOOL [T, T] or [B, T, T] tensor")
    if custom.dtype != np.bool_:
        raise ValidationError(f"mask.custom: dtype must be BOOL, got {custom.dtype}")
    n, longest = len(lengths), int(lengths.max())
    if custom.ndim == 2:
        bad = np.flatnonzero(lengths != custom.shape[0]) if custom.shape[0] == custom.shape[1] else [0]
        if len(bad):
            i = int(bad[0])
            raise ValidationError(
                f"mask.custom: shape {list(custom.shape)} does not match sequences[{i}] of length {lengths[i]} "
                f"(needs [{lengths[i]}, {lengths[i]}]; for sequences of unequal length send [B, Tmax, Tmax])"
            )
        return np.broadcast_to(custom, (n, *custom.shape))
    if custom.ndim != 3:
        raise ValidationError(f"mask.custom: shape {list(custom.shape)} must be [T, T] or [B, T, T]")
    # [B, Tmax, Tmax]: one matrix per sequence, padded to the longest; row i uses its top-left
    # [T_i, T_i] (entries past its own length are ignored). Equal lengths: the exact form.
    if custom.shape != (n, longest, longest):
        raise ValidationError(
            f"mask.custom: shape {list(custom.shape)} must be [{n}, {longest}, {longest}]: one matrix per "
            f"sequence ({n}), padded to the longest sequence ({longest}); entries past a shorter "
            f"sequence's length are ignored"
        )
    if int(lengths.min()) == longest:
        return custom
    inside = np.arange(longest) < lengths[:, None]
    return custom & inside[:, :, None] & inside[:, None, :]
