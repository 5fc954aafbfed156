"""PyTorch <-> ONNX Runtime parity of the real exported files, for every config variant and every
mask kind, batch 1..8, lengths 1, primes and >= 512; no NaN anywhere."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from export.cases import EVERY_MASK, MaskSpec, make_feeds
from export.contract import FP32_TOLERANCE, ExportContract
from export.validate import reference_outputs
from model.config import (ACTIVATIONS, ATTENTION_KINDS, FFN_KINDS, INPUT_KINDS, NATURAL_MASKS, NORM_PLACEMENTS, NORMS,
                          POSITION_IDS, POSITIONALS)
from model.encoder import build_encoder
from model.mask_kinds import MaskKind

ATOL = FP32_TOLERANCE["limit"]  # max |PyTorch - ONNX Runtime| on hidden states and pooled vectors
from tests.conftest import PARITY_CONFIGS

VARIANTS = list(PARITY_CONFIGS)
# (lengths of the rows in one batch): length 1, primes, a batch of 8, and >= 512.
SHAPES = [[1], [13, 2, 7], [31, 3, 17, 29, 1, 23, 11, 0], [521, 509]]


class Loaded:
    def __init__(self, result):
        self.config = result.metadata.config
        self.path = str(result.directory / "model.onnx")
        self.session = ort.InferenceSession(self.path, providers=["CPUExecutionProvider"])
        self.model = build_encoder(self.config)
        self.contract = ExportContract(self.config)

    def compare(self, feeds):
        actual = self.session.run(None, feeds)
        expected = reference_outputs(self.model, self.contract, feeds)
        return actual, expected


@pytest.fixture(scope="module")
def loaded(exported_variants):
    return {name: Loaded(result) for name, result in exported_variants.items()}


def _assert_parity(actual, expected, feeds):
    hidden, pooled = actual
    assert hidden.shape == expected[0].shape and hidden.dtype == np.float32
    assert pooled.shape == expected[1].shape and pooled.dtype == np.float32
    assert np.isfinite(hidden).all() and np.isfinite(pooled).all()
    valid = feeds["attention_mask"].astype(bool)
    np.testing.assert_allclose(hidden[valid], expected[0][valid], atol=ATOL, rtol=0)
    np.testing.assert_allclose(pooled, expected[1], atol=ATOL, rtol=0)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("spec", EVERY_MASK, ids=lambda s: s.label())
def test_onnx_matches_pytorch_for_every_variant_and_mask(loaded, variant, spec):
    entry = loaded[variant]
    for index, lengths in enumerate(SHAPES):
        feeds = make_feeds(entry.config, lengths, spec, seed=index)
        _assert_parity(*entry.compare(feeds), feeds)


@pytest.mark.parametrize("variant", VARIANTS)
def test_onnx_matches_pytorch_when_rows_choose_different_masks(loaded, variant):
    entry = loaded[variant]
    feeds = make_feeds(entry.config, [9, 4, 16, 1, 12, 7, 3, 15, 10], list(EVERY_MASK), seed=3)
    _assert_parity(*entry.compare(feeds), feeds)


@pytest.mark.parametrize("variant", VARIANTS)
def test_exported_graph_has_symbolic_batch_and_sequence_axes(loaded, variant):
    graph = onnx.load(loaded[variant].path).graph
    for value in [*graph.input, *graph.output]:
        dims = [d.dim_param or d.dim_value for d in value.type.tensor_type.shape.dim]
        assert dims[0] == "batch", (value.name, dims)
        if value.name not in ("mask_kind", "mask_causal", "mask_window", "mask_step", "mean_pooled"):
            assert dims[1] == "sequence", (value.name, dims)


def test_parity_configs_cover_every_value_of_every_switch(loaded):
    configs = [entry.config for entry in loaded.values()]
    # scaling "temperature" appears both as 1 (no scaling) and as a real temperature
    scalings = {(c.scaling, c.temperature == 1.0 if c.scaling == "temperature" else None)
                for c in configs if c.attention == "softmax"}
    assert {("sqrt_dk", None), ("temperature", True), ("temperature", False), ("cosine", None),
            ("length", None)} <= scalings
    for field, values in (("norm_placement", NORM_PLACEMENTS), ("positional", POSITIONALS),
                          ("activation", ACTIVATIONS), ("attention", ATTENTION_KINDS),
                          ("input_kind", INPUT_KINDS), ("ffn", FFN_KINDS), ("position_ids", POSITION_IDS),
                          ("linear_bias", (True, False)), ("norm_bias", (True, False)),
                          ("first_attention_norm", (True, False)), ("norm", NORMS),
                          ("natural_mask", NATURAL_MASKS), ("qk_norm", (True, False))):
        assert {getattr(c, field) for c in configs} == set(values), field
    assert any(c.local_layers for c in configs) and any(not c.local_layers for c in configs)
    assert any(c.kv_heads < c.n_heads for c in configs) and any(c.head_dim * c.n_heads != c.d_model for c in configs)
    assert any(c.relative_attention_buckets for c in configs) and any(c.embedding_scale != 1.0 for c in configs)


def test_causal_rows_with_left_padding_give_finite_outputs(loaded):
    entry = loaded["default"]
    feeds = make_feeds(entry.config, [0, 3, 8], MaskSpec(MaskKind.CAUSAL), left_pad=True)
    _assert_parity(*entry.compare(feeds), feeds)


MASKS = st.one_of(
    st.sampled_from([MaskSpec(MaskKind.BIDIRECTIONAL), MaskSpec(MaskKind.CAUSAL)]),
    st.builds(MaskSpec, st.just(MaskKind.SLIDING_WINDOW), st.integers(0, 40), st.just(1), st.booleans()),
    st.builds(MaskSpec, st.just(MaskKind.DILATED), st.just(0), st.integers(1, 40), st.booleans()),
    st.builds(MaskSpec, st.just(MaskKind.LOCAL_STRIDED), st.integers(0, 10), st.integers(1, 20), st.booleans()),
    st.builds(MaskSpec, st.just(MaskKind.CUSTOM), custom_seed=st.integers(0, 1000)),
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lengths=st.lists(st.integers(0, 90), min_size=1, max_size=8), data=st.data(), left=st.booleans())
def test_default_model_parity_holds_for_random_shapes_and_masks(loaded, lengths, data, left):
    entry = loaded["default"]
    masks = [data.draw(MASKS) for _ in lengths]
    feeds = make_feeds(entry.config, lengths, masks, seed=len(lengths), left_pad=left)
    _assert_parity(*entry.compare(feeds), feeds)
