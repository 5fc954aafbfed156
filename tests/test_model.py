"""Behaviour of the reference encoder in PyTorch: no NaN on empty rows, padding invariance,
the two linear-attention forms agree, the positional table follows the formula."""

import math

import numpy as np
import pytest
import torch

from export.cases import EVERY_MASK, MaskSpec, make_feeds
from model.attention import linear_attention_prefix, masked_softmax
from model.encoder import build_encoder, sinusoidal_positions
from model.signature import input_names
from model.mask_kinds import MaskKind

ATOL = 1e-5


def _run(model, config, feeds):
    args = [torch.from_numpy(feeds[name]) for name in input_names(config)]
    with torch.no_grad():
        return [t.numpy() for t in model(*args)]


def test_masked_softmax_gives_zeros_for_a_row_with_no_allowed_key():
    scores = torch.randn(2, 3)
    allowed = torch.tensor([[True, False, True], [False, False, False]])
    probs = masked_softmax(scores, allowed)
    assert torch.isfinite(probs).all()
    assert probs[1].abs().sum() == 0 and probs[0, 1] == 0
    assert torch.allclose(probs[0].sum(), torch.tensor(1.0))


@pytest.mark.parametrize("variant", ["default", "additive", "linear", "scale-cosine", "scale-length", "pre-norm"])
def test_fully_masked_rows_stay_finite(tiny_variants, variant):
    config = tiny_variants[variant]
    model = build_encoder(config)
    for spec in (MaskSpec(MaskKind.CAUSAL), MaskSpec(MaskKind.CUSTOM, custom_seed=3)):
        feeds = make_feeds(config, [0, 4, 9], spec, left_pad=True)
        hidden, pooled = _run(model, config, feeds)
        assert np.isfinite(hidden).all() and np.isfinite(pooled).all()
        np.testing.assert_array_equal(pooled[0], 0.0)  # a row with no valid token pools to zeros


@pytest.mark.parametrize("variant", ["default", "additive", "linear", "scale-length", "pos-learned", "features"])
@pytest.mark.parametrize("spec", EVERY_MASK, ids=lambda s: s.label())
def test_a_sequence_alone_equals_itself_inside_a_padded_batch(tiny_variants, variant, spec):
    config = tiny_variants[variant]
    model = build_encoder(config)
    batch = make_feeds(config, [7, 19, 3], spec, seed=1)
    hidden, pooled = _run(model, config, batch)
    alone = {name: value[:1, :7] if value.ndim >= 2 else value[:1] for name, value in batch.items()}
    alone["custom_mask"] = batch["custom_mask"][:1, :7, :7]
    hidden_alone, pooled_alone = _run(model, config, alone)
    np.testing.assert_allclose(hidden[0, :7], hidden_alone[0], atol=ATOL)
    np.testing.assert_allclose(pooled[0], pooled_alone[0], atol=ATOL)


@pytest.mark.parametrize("causal", [False, True])
def test_masked_linear_attention_equals_the_linear_time_form(causal):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 11, 8) for _ in range(3))
    allowed = torch.tril(torch.ones(11, 11, dtype=torch.bool)) if causal else torch.ones(11, 11, dtype=torch.bool)
    fq, fk = torch.nn.functional.elu(q) + 1, torch.nn.functional.elu(k) + 1
    weights = torch.where(allowed, fq @ fk.transpose(-2, -1), 0.0)
    quadratic = (weights @ v) / weights.sum(-1, keepdim=True)
    np.testing.assert_allclose(quadratic.numpy(), linear_attention_prefix(q, k, v, causal).numpy(), atol=1e-5)


@pytest.mark.parametrize("t", [37, 1023, 32767])
def test_sinusoidal_positions_follow_the_formula_at_any_length(t):
    table = sinusoidal_positions(t + 1, 16).numpy()
    for k in (0, 3, 7):
        assert table[t, 2 * k] == pytest.approx(math.sin(t / 10000 ** (2 * k / 16)), abs=1e-6)
        assert table[t, 2 * k + 1] == pytest.approx(math.cos(t / 10000 ** (2 * k / 16)), abs=1e-6)


def test_sinusoidal_positions_are_not_in_the_state_dict(tiny_config):
    assert not any("sinusoidal" in key for key in build_encoder(tiny_config).state_dict())


def test_same_config_gives_the_same_weights(tiny_config):
    a, b = build_encoder(tiny_config).state_dict(), build_encoder(tiny_config).state_dict()
    assert all(torch.equal(a[key], b[key]) for key in a)


def test_length_scaling_uses_the_row_length_not_the_padded_length(tiny_variants):
    """1/sqrt(d_k * T): T is the row's real length, so padding does not change the result."""
    config = tiny_variants["scale-length"]
    model = build_encoder(config)
    short = make_feeds(config, [5], MaskSpec(), seed=2)
    padded = make_feeds(config, [5], MaskSpec(), seed=2, padded_to=40)
    padded["input_ids"][:, :5] = short["input_ids"]
    np.testing.assert_allclose(_run(model, config, short)[1], _run(model, config, padded)[1], atol=ATOL)
