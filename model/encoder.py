"""The reference encoder stack: embeddings, encoder layers, pooling (SEEDS.md, "Encoder layer").

Read top to bottom: Embeddings -> EncoderLayer x N -> (final norm for pre-norm) -> outputs (+ the task
head's, model/heads.py, when config.head names one).
`Encoder.forward` takes exactly the exported graph's inputs, in graph order (`model.signature`).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from model.activations import ACTIVATION_FUNCTIONS
from model.attention import MaskInputs, MultiHeadAttention
from model.attention_paths import DENSE
from model.config import EncoderConfig
from model.disentangled_attention import RelativeEmbeddings
from model.heads import build_head
from model.masks import build_allowed, within_window
from model.norms import make_norm
from model.pooling import mean_pool
from model.relative_positions import RelativePositionBias

def sinusoidal_positions(length: int, d_model: int, device: torch.device | None = None) -> torch.Tensor:
    """PE[t, 2k] = sin(t / 10000^(2k/D)), PE[t, 2k+1] = cos(t / 10000^(2k/D)); shape (T, D).

    Computed from the positions (in float64, then rounded to float32) rather than read from a table,
    so it extends to any length (SEEDS.md), in PyTorch and in the exported graph alike."""
    position = torch.arange(length, dtype=torch.float64, device=device)[:, None]
    inv_freq = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float64, device=device)
                         * (-math.log(10000.0) / d_model))
    angles = position * inv_freq  # (T, ceil(D/2))
    table = torch.stack([torch.sin(angles), torch.cos(angles)], dim=-1).reshape(length, -1)
    return table[:, :d_model].to(torch.float32)


def rotary_inverse_frequencies(head_dim: int, theta: float) -> torch.Tensor:
    """1 / θ^(2k/d) for k < d/2, in float32 as transformers computes it (so positions match bit for bit)."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))


def llama3_frequencies(inv_freq: torch.Tensor, factor: float, low_freq_factor: float, high_freq_factor: float,
                       original: float) -> torch.Tensor:
    """Llama 3.1's scaled frequencies (transformers' rope_type "llama3"): wavelengths 2π/f longer than
    original / low_freq_factor divided by `factor`, shorter than original / high_freq_factor kept, those between
    interpolated by where original / wavelength falls between the two factors."""
    wavelength = 2 * math.pi / inv_freq
    scaled = torch.where(wavelength > original / low_freq_factor, inv_freq / factor, inv_freq)
    smooth = (original / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)
    between = (wavelength >= original / high_freq_factor) & (wavelength <= original / low_freq_factor)
    return torch.where(between, (1 - smooth) * scaled / factor + smooth * scaled, scaled)


def rotary_tables(length: int, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each (T, head_dim): angle t·f_k, the half-dim table repeated twice (rotate-half layout).

    Computed from the positions in the graph, so rotary positions extend to any length."""
    position = torch.arange(length, dtype=torch.float32, device=inv_freq.device)[:, None]
    angles = position * inv_freq[None]  # (T, head_dim / 2)
    angles = torch.cat([angles, angles], dim=-1)  # (T, head_dim)
    return torch.cos(angles), torch.sin(angles)


def learned_position_ids(input_ids: torch.Tensor, pad_token_id: int) -> torch.Tensor:
    """RoBERTa numbering (B, T): real tokens count pad_token_id + 1, + 2, ...; padding ids get pad_token_id."""
    real = (input_ids != pad_token_id).to(torch.int64)
    return torch.cumsum(real, dim=1) * real + pad_token_id


class Embeddings(nn.Module):
    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.config = config
        d = config.embedding_size or config.d_model  # the embeddings' width (factorised: embedding_size)
        self.tokens = nn.Embedding(config.vocab_size, d) if config.input_kind == "tokens" else None
        self.token_types = nn.Embedding(config.type_vocab_size, d) if config.type_vocab_size else None
        self.positions = nn.Embedding(config.max_positions, d) if config.positional == "learned" else None
        self.norm = make_norm(config, d) if config.embedding_layer_norm else None
        # ELECTRA-small's embeddings_project: embedding_size -> d_model, after the norm
        self.project = nn.Linear(d, config.d_model, bias=config.linear_bias) if config.embedding_size else None

    def forward(self, x: torch.Tensor, token_type_ids: torch.Tensor | None) -> torch.Tensor:
        h = self.tokens(x) if self.tokens is not None else x  # (B, T, D)
        if self.tokens is not None and self.config.embedding_scale != 1.0:
            h = h * self.config.embedding_scale
        length = h.shape[1]
        if self.positions is not None and self.config.position_ids == "after_padding":
            h = h + self.positions(learned_position_ids(x, self.config.pad_token_id))
        elif self.positions is not None:
            h = h + self.positions.weight[:length][None]
        elif self.config.positional == "sinusoidal":
            h = h + sinusoidal_positions(length, h.shape[-1], h.device)[None]
        if self.token_types is not None:
            h = h + self.token_types(token_type_ids)
        if self.norm is not None:
            h = self.norm(h)
        if self.project is not None:
            h = self.project(h)  # (B, T, embedding_size) -> (B, T, D)
        return h


class FeedForward(nn.Module):
    """FFN(x) = act(x·W_up + b)·W_down + b; gated (GLU): FFN(x) = (act(x·W_up) * (x·W_gate))·W_down, the
    activated projection `up` (ModernBERT: Wi's first half; Qwen: gate_proj) times the linear one `gate`
    (Wi's second half; Qwen: up_proj)."""

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.gated = config.ffn == "gated"
        self.up = nn.Linear(config.d_model, config.d_ff, bias=config.has_ffn_in_bias)
        self.gate = nn.Linear(config.d_model, config.d_ff, bias=config.has_ffn_in_bias) if self.gated else None
        self.down = nn.Linear(config.d_ff, config.d_model, bias=config.linear_bias)
        self.activation = ACTIVATION_FUNCTIONS[config.activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            return self.down(self.activation(self.up(x)) * self.gate(x))
        return self.down(self.activation(self.up(x)))


class EncoderLayer(nn.Module):
    """post-norm: x = N(x + MHA(x)); x = N(x + FFN(x)).  pre-norm: x = x + MHA(N(x)); ...
    sandwich (Gemma): x = x + N'(MHA(N(x))); x = x + N'(FFN(N(x))), N' the *_post_norm."""

    def __init__(self, config: EncoderConfig, path: str = DENSE, index: int = 0) -> None:
        super().__init__()
        self.placement = config.norm_placement
        # The attention plan: a local layer attends within config.local_window (intersected with the
        # request's mask), a global one as the request asks.
        self.window = config.layer_window(index)
        self.attention = MultiHeadAttention(config, path, window=self.window)
        self.attention_norm = nn.Identity() if index == 0 and not config.first_attention_norm else make_norm(config)
        self.ffn = FeedForward(config)
        self.ffn_norm = make_norm(config)
        if self.placement == "sandwich":
            self.attention_post_norm, self.ffn_post_norm = make_norm(config), make_norm(config)
        # Dropout after attention and FFN is inactive at inference; the reference omits it.

    def forward(self, x: torch.Tensor, masks: MaskInputs, rotary: tuple | None = None) -> torch.Tensor:
        if self.placement == "sandwich":
            x = x + self.attention_post_norm(self.attention(self.attention_norm(x), masks, rotary))
            return x + self.ffn_post_norm(self.ffn(self.ffn_norm(x)))
        if self.placement == "pre":
            x = x + self.attention(self.attention_norm(x), masks, rotary)
            return x + self.ffn(self.ffn_norm(x))
        x = self.attention_norm(x + self.attention(x, masks, rotary))
        return self.ffn_norm(x + self.ffn(x))


class Encoder(nn.Module):
    """The stack, with its attention path chosen once (model/attention_paths.py): "dense" takes
    `custom_mask` and serves every mask kind; "sparse"/"linear" have no custom_mask input and serve
    the kinds their path computes. The weights are the same on every path (`with_path`)."""

    def __init__(self, config: EncoderConfig, path: str = DENSE) -> None:
        super().__init__()
        self.config = config
        self.path = path
        self.embeddings = Embeddings(config)
        self.layers = nn.ModuleList(EncoderLayer(config, path, i) for i in range(config.n_layers))
        self.final_norm = make_norm(config) if config.norm_placement in ("pre", "sandwich") else None
        if config.positional == "rotary":  # fixed tables: non-persistent, never in a state dict
            for buffer, theta in (("rope_global", config.rope_theta), ("rope_local", config.rope_theta_local)):
                # linear scaling divides the float32 frequencies, as transformers does (exact for rope_scale 1)
                inv_freq = rotary_inverse_frequencies(config.head_dim, theta) / config.rope_scale
                if config.rope_llama3:
                    inv_freq = llama3_frequencies(inv_freq, *config.rope_llama3)
                self.register_buffer(buffer, inv_freq, persistent=False)
        # MPNet's relative position buckets: one bias table for every layer (relative_attention_bias.weight)
        self.relative_attention_bias = RelativePositionBias(config) if config.relative_attention_buckets else None
        # DeBERTa's disentangled attention: one relative position table for every layer (rel_embeddings)
        self.relative_embeddings = RelativeEmbeddings(config) if config.disentangled_terms else None
        self.head = build_head(config)  # None without a task head: the state dict is the headless one

    def forward(
        self,
        inputs: torch.Tensor,  # (B, T) int64 token ids, or (B, T, D) float features
        attention_mask: torch.Tensor,  # (B, T) int64, 1 = real token
        mask_kind: torch.Tensor,  # (B,) int64
        mask_causal: torch.Tensor,  # (B,) bool
        mask_window: torch.Tensor,  # (B,) int64
        mask_step: torch.Tensor,  # (B,) int64
        custom_mask: torch.Tensor | None = None,  # (B, T, T) bool; dense path only
        token_type_ids: torch.Tensor | None = None,  # (B, T) int64, BERT-family only
    ) -> tuple[torch.Tensor, ...]:
        """(last_hidden_state (B, T, D), mean_pooled (B, D)), then the head's output when there is a head:
        logits (B, num_labels) or sparse_embedding (B, vocab_size) (model/signature.py output_specs)."""
        masks = MaskInputs(attention_mask, mask_kind, mask_causal, mask_window, mask_step)
        if self.path == DENSE:
            if custom_mask is None:
                length = attention_mask.shape[1]
                custom_mask = torch.ones(attention_mask.shape[0], length, length, dtype=torch.bool)
            allowed = build_allowed(attention_mask, mask_kind, mask_causal, mask_window, mask_step, custom_mask)
            # A local layer's keys: the request's allowed keys within the plan's window (the rule).
            local = allowed & within_window(allowed.shape[1], self.config.local_window, allowed.device) \
                if self.config.local_layers else None
            masks = masks._replace(allowed=allowed, allowed_local=local)
        if self.relative_attention_bias is not None:  # computed once, added in every layer
            masks = masks._replace(position_bias=self.relative_attention_bias(attention_mask.shape[1]))
        if self.relative_embeddings is not None:  # computed once, projected in every layer
            masks = masks._replace(disentangled=self.relative_embeddings(attention_mask.shape[1]))
        h = self.embeddings(inputs, token_type_ids)  # (B, T, D)
        rotary = {}
        if self.config.positional == "rotary":
            rotary = {None: rotary_tables(h.shape[1], self.rope_global),
                      self.config.local_window: rotary_tables(h.shape[1], self.rope_local)}
        for layer in self.layers:
            h = layer(h, masks, rotary.get(layer.window))
        if self.final_norm is not None:
            h = self.final_norm(h)
        if self.head is None:
            return h, mean_pool(h, attention_mask)
        return h, mean_pool(h, attention_mask), self.head(h, attention_mask)


def with_path(model: Encoder, path: str) -> Encoder:
    """The same weights on another attention path (a new module; `model` is unchanged)."""
    if path == model.path:
        return model
    with torch.random.fork_rng(devices=[]):  # the fresh weights are overwritten: leave the RNG as it was
        other = Encoder(model.config, path)
    other.load_state_dict(model.state_dict())
    return other.eval()


def build_encoder(config: EncoderConfig) -> Encoder:
    """A seeded, eval-mode encoder: the same config always gives the same weights."""
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(config.seed)
    try:
        model = Encoder(config)
    finally:
        torch.random.set_rng_state(generator_state)
    return model.eval()
