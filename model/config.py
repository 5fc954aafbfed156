"""The one configuration object of the encoder: the single source of truth.

It is frozen (nanoGPT mutates its config in place; that is the bug we avoid), passed whole to
every module, saved beside every export as JSON and read back by the server. This module imports
no torch, so the server can read a config without it.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Mapping

# Every variant switch and the values it accepts. `python -m export --variant` and the
# error messages read these tuples; nothing else spells the choices out.
SCALINGS = ("sqrt_dk", "temperature", "cosine", "length")
# post: x = N(x + f(x)); pre: x = x + f(N(x)); sandwich (Gemma 2/3): x = x + N_after(f(N_before(x))).
NORM_PLACEMENTS = ("post", "pre", "sandwich")
# The normalisation of every norm in the stack: LayerNorm; RMSNorm w·x/rms(x) (Qwen, Llama); Gemma's RMSNorm
# (1 + w)·x/rms(x), its weight stored as the offset from 1.
NORMS = ("layer", "rms", "rms_gemma")
POSITIONALS = ("sinusoidal", "learned", "rotary", "none")
# How learned positions are numbered: 0, 1, 2, ... (BERT), or RoBERTa's: real tokens count from
# pad_token_id + 1 (cumulative count of non-padding ids), padding tokens get pad_token_id.
POSITION_IDS = ("range", "after_padding")
# "gelu" is the exact (erf) GELU; "gelu_tanh" its tanh approximation (Gemma's gelu_pytorch_tanh); "silu"
# x·sigmoid(x) (SwiGLU with ffn="gated": Qwen, Llama).
ACTIVATIONS = ("relu", "gelu", "gelu_tanh", "silu")
# Feed-forward: act(x·W1)·W2 ("standard"), or gated (GLU: act(x·W_in)·(x·W_gate), then W2; GeGLU
# with activation="gelu", as ModernBERT: one up projection of 2·d_ff, its first half the input).
FFN_KINDS = ("standard", "gated")
ATTENTION_KINDS = ("softmax", "additive", "linear", "performer")
INPUT_KINDS = ("tokens", "features")
# The mask a request gets when it names none: bidirectional (encoders), causal (decoder embedders: Qwen2/3).
NATURAL_MASKS = ("bidirectional", "causal")
# Task heads on the encoder (model/heads.py): none (embeddings only), a sequence classifier (cross-encoders,
# classifiers: logits [B, num_labels]), SPLADE's sparse head (max over tokens of log1p(relu(MLM logits))), a
# late-interaction (ColBERT) head: every token projected to vector_dim and L2-normalised, [B, T, vector_dim],
# bge-m3's three heads in one per-token output [B, T, D + 1] (model/heads.py M3Head), or an LLM reranker's answer
# tokens (a few lm_head rows at the last real token: logits [B, 1]).
HEADS = ("none", "classification", "sparse", "multivector", "m3", "answer_tokens")
# What a classification head reads: the first token's hidden state, or the mean over valid tokens.
HEAD_POOLINGS = ("cls", "mean")
# The activation inside a head's transform (dense -> act -> optional LayerNorm): "gelu" is the exact (erf) GELU.
HEAD_ACTIVATIONS = ("tanh", "gelu", "relu")
# DeBERTa's disentangled attention terms (model/disentangled_attention.py): content-to-position (c2p: each
# query with the positions of its keys) and position-to-content (p2c: each key with the position of the query).
DISENTANGLED_TERMS = ("c2p", "p2c")


class ConfigError(ValueError):
    """A configuration that cannot describe an encoder; the message names the field."""


@dataclass(frozen=True)
class EncoderConfig:
    """Shape and variant of the reference encoder stack (see ../shared/SEEDS.md)."""

    name: str = "default"
    d_model: int = 256
    n_heads: int = 4
    n_layers: int = 4
    d_ff: int = 1024
    # Input: "tokens" (ids through an embedding table of vocab_size rows) or "features"
    # (raw float vectors [B, T, d_model] embedded elsewhere).
    input_kind: str = "tokens"
    vocab_size: int = 8192
    # Rows of the learned position table (positional="learned"), and the length a checkpoint was
    # trained to. Sinusoidal positions are computed from the position, so they do not stop here.
    max_positions: int = 1024
    # BERT-family extras: token-type embeddings (0 = none), LayerNorm after the embeddings.
    type_vocab_size: int = 0
    embedding_layer_norm: bool = False
    # Factorised embeddings (ELECTRA-small's embeddings_project): 0 = none, the embeddings are d_model wide; > 0 =
    # the token / position / token-type embeddings and their norm are embedding_size wide, then a
    # Linear(embedding_size, d_model) (embeddings.project) maps them to the layers' width. Tokens input only.
    embedding_size: int = 0
    layer_norm_eps: float = 1e-5
    pad_token_id: int = 0
    # Variant switches.
    scaling: str = "sqrt_dk"
    temperature: float = 1.0  # used by scaling="temperature" (1 = no scaling) and "cosine"
    norm_placement: str = "post"
    positional: str = "sinusoidal"
    activation: str = "relu"
    attention: str = "softmax"
    ffn: str = "standard"
    position_ids: str = "range"  # positional="learned" only
    # Rotary positions (positional="rotary"): θ of global layers and of local layers.
    rope_theta: float = 10000.0
    rope_theta_local: float = 10000.0
    # Linear rotary scaling (transformers' rope_type "linear"): every rotary frequency divided by this, i.e.
    # positions t / rope_scale. 1: none.
    rope_scale: float = 1.0
    # Llama 3.1's rotary scaling (transformers' rope_type "llama3"), applied to every rotary frequency f after
    # rope_scale: (factor, low_freq_factor, high_freq_factor, original_max_position_embeddings); long wavelengths
    # (2π/f > original / low) divided by factor, short ones (< original / high) kept, those between interpolated.
    # (): none.
    rope_llama3: tuple[float, ...] = ()
    # Bias-free projections (ModernBERT: no bias in any linear nor in any LayerNorm).
    linear_bias: bool = True
    norm_bias: bool = True
    # Bias on the q/k/v projections: None = as linear_bias (Qwen2: q/k/v biased, nothing else).
    qkv_bias: bool | None = None
    # Bias on the FFN's input projections (up, and gate when gated): None = as linear_bias (GTE: none on its
    # gate/up projections, a bias on down_proj and on every attention linear).
    ffn_in_bias: bool | None = None
    norm: str = "layer"  # NORMS: every norm of the stack (embeddings, layers, final, q/k, the head's)
    # Attention widths: head_dim (0: d_model // n_heads; Qwen3-0.6B: 128 with d_model 1024 and 16 heads)
    # and grouped-query attention's key/value heads (0: n_heads; each serves n_heads // n_kv_heads queries).
    attention_head_dim: int = 0
    n_kv_heads: int = 0
    # A norm (`norm`, over head_dim) on each head's q and k before rotary positions (Qwen3, Gemma3).
    qk_norm: bool = False
    # The token embeddings are multiplied by this (Gemma: sqrt(d_model)).
    embedding_scale: float = 1.0
    natural_mask: str = "bidirectional"  # NATURAL_MASKS
    # Pre-norm stacks whose first layer takes the (normalised) embeddings without its own attention
    # norm (ModernBERT: layer 0's attn_norm is the identity).
    first_attention_norm: bool = True
    # The attention plan: the layers listed here are local (each query sees keys at |i - j| <=
    # local_window, intersected with the request's own mask), every other layer is global.
    local_layers: tuple[int, ...] = ()
    local_window: int = 0
    # Random features m of performer attention (FAVOR+, φ(x) = exp(ω·x − ‖x‖²/2)/√m, ω ~ N(0, I)
    # drawn from `seed`); used by attention="performer" only.
    performer_features: int = 64
    # Relative position buckets (MPNet, T5's bidirectional scheme): each (query i, key j) pair falls in one
    # of relative_attention_buckets buckets by j - i (exact up to a quarter of them each way, then log-spaced
    # up to relative_attention_max_distance, beyond which all share the last), and a learned per-head bias
    # per bucket is added to every layer's softmax scores after scaling. 0: none. Dense attention only.
    relative_attention_buckets: int = 0
    relative_attention_max_distance: int = 128
    # Disentangled attention (DeBERTa-v2/v3; model/disentangled_attention.py): the terms named here (of
    # DISENTANGLED_TERMS) are added to every layer's softmax scores, scaled as the content term (`scaling`):
    # c2p(i, j) = q_i · K_r[δ(i, j)] and p2c(i, j) = k_j · Q_r[δ'(i, j)], K_r / Q_r a table of 2·span relative
    # position embeddings shared by every layer (LayerNorm first if disentangled_norm), projected by the layer's
    # own position projections, or its k / q projections when disentangled_share_key. δ: the bucket of i - j,
    # clamped to the table; with disentangled_buckets > 0 (span = disentangled_buckets) distances past half of
    # them are log-spaced up to disentangled_max_distance, else (span = disentangled_max_distance) exact.
    # (): none. Dense attention only.
    disentangled_terms: tuple[str, ...] = ()
    disentangled_buckets: int = 0
    disentangled_max_distance: int = 512
    disentangled_share_key: bool = False
    disentangled_norm: bool = False
    # Task head (model/heads.py; docs/export-format.md "Task heads"). The defaults are the headless encoder.
    #   classification: pool (head_pooling) -> dense(D, D, bias=head_bias) -> head_activation -> LayerNorm if
    #                   head_norm -> out(D, num_labels, bias=head_out_bias): logits [B, num_labels]
    #   sparse (SPLADE): per token dense -> head_activation -> LayerNorm if head_norm -> out(D, vocab_size,
    #                   bias=head_out_bias), then log1p(relu(.)), max over valid tokens: [B, vocab_size]
    #   multivector (ColBERT): per token out(D, vector_dim, no bias), L2-normalised: [B, T, vector_dim]
    #   m3 (bge-m3): per token colbert(D, D) L2-normalised (position 0: the normalised hidden state, the dense
    #                embedding) and relu(sparse(D, 1)): [B, T, D + 1]
    #   answer_tokens (an LLM reranker): the last real token's hidden state times the lm_head rows of
    #                   head_tokens (vocabulary ids, the positive answer last: Qwen3-Reranker's "no", "yes") ->
    #                   one logit [B, 1]: the last token's minus the logsumexp of the others (one token: its own),
    #                   so sigmoid(logit) = softmax over the answer tokens' logits, taken at the last one
    # The head's LayerNorm takes layer_norm_eps and norm_bias, as the encoder's.
    head: str = "none"
    num_labels: int = 1  # classification only
    vector_dim: int = 0  # multivector only: the width of each token's vector
    head_pooling: str = "cls"  # classification only
    head_activation: str = "tanh"
    head_norm: bool = False
    head_bias: bool = True
    head_out_bias: bool = True
    head_tokens: tuple[int, ...] = ()  # answer_tokens only: the lm_head rows it keeps, in this order
    # Seed for the weights when no checkpoint is loaded: exports are reproducible.
    seed: int = 0
    # Free-form provenance (e.g. the checkpoint a config was read from); not used in the math.
    source: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "local_layers", tuple(int(i) for i in self.local_layers))
        terms = self.disentangled_terms.split(",") if isinstance(self.disentangled_terms, str) \
            else self.disentangled_terms
        object.__setattr__(self, "disentangled_terms", tuple(str(t).strip() for t in terms if str(t).strip()))
        llama3 = self.rope_llama3.split(",") if isinstance(self.rope_llama3, str) else self.rope_llama3
        object.__setattr__(self, "rope_llama3", tuple(float(v) for v in llama3 if str(v).strip()))
        tokens = self.head_tokens.split(",") if isinstance(self.head_tokens, str) else self.head_tokens
        object.__setattr__(self, "head_tokens", tuple(int(v) for v in tokens if str(v).strip()))
        for name, allowed in (
            ("scaling", SCALINGS),
            ("norm_placement", NORM_PLACEMENTS),
            ("positional", POSITIONALS),
            ("activation", ACTIVATIONS),
            ("attention", ATTENTION_KINDS),
            ("input_kind", INPUT_KINDS),
            ("ffn", FFN_KINDS),
            ("position_ids", POSITION_IDS),
            ("norm", NORMS),
            ("natural_mask", NATURAL_MASKS),
            ("head", HEADS),
            ("head_pooling", HEAD_POOLINGS),
            ("head_activation", HEAD_ACTIVATIONS),
        ):
            value = getattr(self, name)
            if value not in allowed:
                raise ConfigError(f"{name}={value!r} is not one of {', '.join(allowed)}")
        for name in ("d_model", "n_heads", "n_layers", "d_ff", "max_positions", "performer_features", "num_labels"):
            if int(getattr(self, name)) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.d_model % self.n_heads and not self.attention_head_dim:
            raise ConfigError(
                f"n_heads={self.n_heads} does not divide d_model={self.d_model}"
            )
        if self.attention_head_dim < 0 or self.n_kv_heads < 0:
            raise ConfigError("attention_head_dim and n_kv_heads must be >= 0 (0: the default)")
        if self.n_heads % self.kv_heads:
            raise ConfigError(f"n_kv_heads={self.n_kv_heads} does not divide n_heads={self.n_heads}")
        if (self.kv_heads != self.n_heads or self.qk_norm) and self.attention not in ("softmax",):
            raise ConfigError("n_kv_heads and qk_norm need attention='softmax'")
        if self.embedding_size < 0:
            raise ConfigError(f"embedding_size must be >= 0 (0: no projection), got {self.embedding_size}")
        if self.embedding_size and self.input_kind != "tokens":
            raise ConfigError("embedding_size needs input_kind='tokens' (features arrive d_model wide)")
        if self.embedding_scale <= 0:
            raise ConfigError(f"embedding_scale must be > 0, got {self.embedding_scale}")
        if self.input_kind == "tokens" and self.vocab_size < 1:
            raise ConfigError("vocab_size must be >= 1 for input_kind='tokens'")
        if self.input_kind == "features" and self.type_vocab_size:
            raise ConfigError("type_vocab_size needs input_kind='tokens'")
        if self.temperature <= 0:
            raise ConfigError(f"temperature must be > 0, got {self.temperature}")
        if self.layer_norm_eps <= 0:
            raise ConfigError(f"layer_norm_eps must be > 0, got {self.layer_norm_eps}")
        if self.position_ids != "range" and (self.positional != "learned" or self.input_kind != "tokens"):
            raise ConfigError(f"position_ids={self.position_ids!r} needs positional='learned' and input_kind='tokens'")
        if self.position_ids == "after_padding" and self.pad_token_id + 2 > self.max_positions:
            raise ConfigError(f"position_ids='after_padding' needs max_positions > pad_token_id + 1 "
                              f"(got {self.max_positions}, pad_token_id {self.pad_token_id})")
        if self.positional == "rotary" and self.head_dim % 2:
            raise ConfigError(f"positional='rotary' needs an even head_dim, got {self.head_dim}")
        if self.rope_theta <= 0 or self.rope_theta_local <= 0:
            raise ConfigError("rope_theta and rope_theta_local must be > 0")
        if self.rope_scale <= 0:
            raise ConfigError(f"rope_scale must be > 0, got {self.rope_scale}")
        if self.rope_llama3:
            if len(self.rope_llama3) != 4 or min(self.rope_llama3) <= 0:
                raise ConfigError(f"rope_llama3={list(self.rope_llama3)} must be 4 positive numbers: factor, "
                                  "low_freq_factor, high_freq_factor, original_max_position_embeddings")
            if self.rope_llama3[2] <= self.rope_llama3[1]:
                raise ConfigError(f"rope_llama3's high_freq_factor ({self.rope_llama3[2]:g}) must be above its "
                                  f"low_freq_factor ({self.rope_llama3[1]:g})")
        if not self.first_attention_norm and self.norm_placement != "pre":
            raise ConfigError("first_attention_norm=False needs norm_placement='pre'")
        layers = tuple(self.local_layers)
        if any(not 0 <= i < self.n_layers for i in layers) or len(set(layers)) != len(layers) \
                or list(layers) != sorted(layers):
            raise ConfigError(f"local_layers must be distinct layer indices in 0..{self.n_layers - 1}, "
                              f"ascending; got {list(layers)}")
        if self.local_window < 0:
            raise ConfigError(f"local_window must be >= 0, got {self.local_window}")
        if layers and self.attention != "softmax":
            raise ConfigError("local_layers (an attention plan) needs attention='softmax'")
        if self.relative_attention_buckets:
            if self.relative_attention_buckets < 4:
                raise ConfigError(f"relative_attention_buckets must be 0 (none) or >= 4, "
                                  f"got {self.relative_attention_buckets}")
            if self.relative_attention_max_distance <= self.relative_attention_buckets // 4:
                raise ConfigError(f"relative_attention_max_distance must be > relative_attention_buckets // 4 "
                                  f"(the exact buckets each way), got {self.relative_attention_max_distance}")
            if self.attention != "softmax":
                raise ConfigError("relative_attention_buckets needs attention='softmax' (a bias on its scores)")
        if self.disentangled_terms:
            self._check_disentangled()
        if (self.head == "multivector") != (self.vector_dim > 0):
            raise ConfigError(f"vector_dim={self.vector_dim} must be >= 1 with head='multivector' and 0 otherwise")
        if self.head == "sparse" and self.input_kind != "tokens":
            raise ConfigError("head='sparse' needs input_kind='tokens' (its output has one entry per vocabulary id)")
        if (self.head == "answer_tokens") != bool(self.head_tokens):
            raise ConfigError(f"head_tokens={list(self.head_tokens)} go with head='answer_tokens' only, and it needs "
                              "at least one")
        if self.head == "answer_tokens" and (self.num_labels != 1 or self.input_kind != "tokens" or not all(
                0 <= t < self.vocab_size for t in self.head_tokens)):
            raise ConfigError(f"head='answer_tokens' needs num_labels=1, input_kind='tokens' and head_tokens within "
                              f"[0, vocab_size={self.vocab_size}), got {list(self.head_tokens)}")

    def _check_disentangled(self) -> None:
        terms = self.disentangled_terms
        wrong = [t for t in terms if t not in DISENTANGLED_TERMS]
        if wrong or len(set(terms)) != len(terms):
            raise ConfigError(f"disentangled_terms={list(terms)} must be distinct values of "
                              f"{', '.join(DISENTANGLED_TERMS)}")
        if self.disentangled_buckets and self.disentangled_buckets < 4:
            raise ConfigError(f"disentangled_buckets must be 0 (exact distances) or >= 4, "
                              f"got {self.disentangled_buckets}")
        if self.disentangled_max_distance <= self.disentangled_buckets // 2 + 1:
            raise ConfigError(f"disentangled_max_distance must be > disentangled_buckets // 2 + 1 (where the log "
                              f"buckets end), got {self.disentangled_max_distance}")
        if self.attention != "softmax" or self.relative_attention_buckets or self.kv_heads != self.n_heads:
            raise ConfigError("disentangled_terms needs attention='softmax' (terms on its scores), no "
                              "relative_attention_buckets and n_kv_heads = n_heads")

    @property
    def disentangled_span(self) -> int:
        """Half the rows of the disentangled position table: the buckets, or the exact distances without them."""
        return self.disentangled_buckets or self.disentangled_max_distance

    @property
    def head_dim(self) -> int:
        return self.attention_head_dim or self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        """Key/value heads (grouped-query attention), n_heads without it."""
        return self.n_kv_heads or self.n_heads

    @property
    def has_qkv_bias(self) -> bool:
        return self.linear_bias if self.qkv_bias is None else bool(self.qkv_bias)

    @property
    def has_ffn_in_bias(self) -> bool:
        return self.linear_bias if self.ffn_in_bias is None else bool(self.ffn_in_bias)

    @property
    def position_limit(self) -> int | None:
        """The longest sequence the model itself can take: a learned position table stops at
        max_positions (RoBERTa numbering: max_positions - pad_token_id - 1); sinusoidal and rotary
        positions (computed in the graph) and none extend to any length."""
        if self.positional != "learned":
            return None
        if self.position_ids == "after_padding":
            return self.max_positions - self.pad_token_id - 1
        return self.max_positions

    def is_local(self, layer: int) -> bool:
        """Whether layer `layer` is local in the attention plan (see local_layers)."""
        return layer in self.local_layers

    def layer_window(self, layer: int) -> int | None:
        """The local window of layer `layer`, or None for a global layer."""
        return self.local_window if self.is_local(layer) else None

    def replace(self, **changes: Any) -> "EncoderConfig":
        """A new config with `changes`; unknown fields are a ConfigError, not a TypeError."""
        return from_dict({**to_dict(self), **changes})


def to_dict(config: EncoderConfig) -> dict[str, Any]:
    data = dataclasses.asdict(config)
    data["source"] = dict(config.source)
    data["local_layers"] = list(config.local_layers)
    data["disentangled_terms"] = list(config.disentangled_terms)
    data["rope_llama3"] = list(config.rope_llama3)
    data["head_tokens"] = list(config.head_tokens)
    return data


def _as_bool(value: Any) -> bool:
    """A bool field's value: a bool, or the text `--set field=...` gives ("1", "true", "yes", "on": true)."""
    return value.lower() in ("1", "true", "yes", "on") if isinstance(value, str) else bool(value)


def from_dict(data: Mapping[str, Any]) -> EncoderConfig:
    known = {f.name: f for f in dataclasses.fields(EncoderConfig)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ConfigError(f"unknown config field(s): {', '.join(unknown)}")
    coerced: dict[str, Any] = {}
    for key, value in data.items():
        default = known[key].default
        if key in ("qkv_bias", "ffn_in_bias"):  # a bool, or None: as linear_bias
            coerced[key] = None if value is None or value == "" else _as_bool(value)
        elif key == "local_layers":
            coerced[key] = tuple(int(v) for v in (value.split(",") if isinstance(value, str) else value) if str(v).strip())
        elif isinstance(default, bool):
            coerced[key] = _as_bool(value)
        elif isinstance(default, int):
            coerced[key] = int(value)
        elif isinstance(default, float):
            coerced[key] = float(value)
        else:
            coerced[key] = value
    return EncoderConfig(**coerced)


def to_json(config: EncoderConfig) -> str:
    return json.dumps(to_dict(config), indent=2, sort_keys=True)


def from_json(text: str) -> EncoderConfig:
    return from_dict(json.loads(text))


# Named presets: the default model and one config per variant switch, so that every switch is
# exported and parity-tested. `python -m export --variant NAME` writes these.
VARIANT_PRESETS: Mapping[str, Mapping[str, Any]] = {
    "default": {},
    "scale-none": {"scaling": "temperature", "temperature": 1.0},
    "scale-temperature": {"scaling": "temperature", "temperature": 4.0},
    "scale-cosine": {"scaling": "cosine", "temperature": 0.1},
    "scale-length": {"scaling": "length"},
    "pre-norm": {"norm_placement": "pre"},
    "pos-learned": {"positional": "learned"},
    "pos-none": {"positional": "none"},
    "gelu": {"activation": "gelu"},
    "additive": {"attention": "additive"},
    "linear": {"attention": "linear"},
    "performer": {"attention": "performer"},
    "features": {"input_kind": "features"},
}


def variants(base: EncoderConfig | None = None, only=None) -> dict[str, EncoderConfig]:
    """The presets applied to `base`; `only`: just these names (a preset that cannot apply to `base`,
    e.g. "features" to a config with a sparse head, is a ConfigError only when asked for)."""
    base = base or EncoderConfig()
    names = list(VARIANT_PRESETS) if only is None else [n for n in only if n in VARIANT_PRESETS]
    return {name: base.replace(name=name if name != "default" else base.name, **VARIANT_PRESETS[name])
            for name in names}
