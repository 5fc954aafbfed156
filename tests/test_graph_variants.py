"""The derived graph variants (optimized, int8, fp16): each exports, passes its validation, loads in
ONNX Runtime and stays within its documented tolerance of PyTorch on inputs the export never saw."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from export.cases import EVERY_MASK, MaskSpec, make_feeds
from export.contract import FP32_TOLERANCE
from export.exporter import export_model
from export.graphs import GRAPHS
from export.optimize import fuse_attention
from export.validate import compare
from model.config import EncoderConfig
from model.encoder import build_encoder
from model.signature import input_names

VARIANTS = ("optimized", "int8", "fp16")
SMALL = dict(d_model=32, n_heads=4, n_layers=2, d_ff=64, vocab_size=97, max_positions=64)


@pytest.fixture(scope="module")
def small_config():
    return EncoderConfig(name="variants", **SMALL)


@pytest.fixture(scope="module")
def small_export(small_config, tmp_path_factory):
    out = tmp_path_factory.mktemp("variants")
    return export_model(small_config, out, graphs=("fp32", *VARIANTS), long_length=40)


def _reference(config, feeds):
    model = build_encoder(config)
    args = [torch.from_numpy(np.ascontiguousarray(feeds[name])) for name in input_names(config)]
    with torch.no_grad():
        return [t.numpy() for t in model(*args)]


@pytest.mark.parametrize("variant", VARIANTS)
def test_variant_is_written_and_passes_validation(small_export, variant):
    entry = small_export.metadata.graphs[variant]
    assert entry.file == GRAPHS[variant].file
    assert (small_export.directory / entry.file).exists()
    assert entry.tolerance == GRAPHS[variant].tolerance
    assert entry.validation["passed"] is True
    assert entry.validation["cases"] > 30


@pytest.mark.parametrize("variant", VARIANTS)
def test_variant_matches_pytorch_on_unseen_inputs(small_config, small_export, variant):
    path = small_export.directory / GRAPHS[variant].file
    session = ort.InferenceSession(str(path), providers=list(GRAPHS[variant].validate_on))
    tolerance = GRAPHS[variant].tolerance
    lengths = [41, 3, 0, 64, 17, 9, 22, 1, 30]  # a fully padded row, the longest length, odd sizes
    feeds = make_feeds(small_config, lengths, list(EVERY_MASK), seed=123)
    actual = session.run(["last_hidden_state", "mean_pooled"], feeds)
    expected = _reference(small_config, feeds)
    for got, want in zip(actual, expected):
        assert got.shape == want.shape and got.dtype == np.float32
        assert np.isfinite(got).all()
    score = compare(actual, expected, feeds, tolerance["metric"])
    if tolerance["metric"] == "max_abs":
        assert score <= tolerance["limit"]
    else:
        assert score >= tolerance["limit"]


def test_int8_file_is_smaller_than_fp32(small_export):
    graphs = small_export.metadata.graphs
    assert graphs["int8"].bytes < graphs["fp32"].bytes


def test_optimized_graph_runs_attention_as_one_fused_op_per_layer(small_config, small_export):
    ops = [n.op_type for n in onnx.load(str(small_export.directory / GRAPHS["optimized"].file)).graph.node]
    assert ops.count("Attention") == small_config.n_layers
    assert "Softmax" not in ops and "Where" not in ops
    # bias + residual + LayerNorm stay unfused: ORT's CPU SkipLayerNormalization measured slower
    assert "SkipLayerNormalization" not in ops and ops.count("LayerNormalization") == 2 * small_config.n_layers


@pytest.mark.parametrize("activation, fused_op", [("gelu", "BiasGelu"), ("gelu_tanh", "FastGelu")])
def test_optimized_graph_runs_each_gelu_as_one_op_equal_to_pytorch(small_config, tmp_path, activation, fused_op):
    """export/optimize.py fuse_gelu: the FFN's GELU (as torch's exporter decomposes it) is one contrib op with its
    bias, in every layer, and the graph still answers what PyTorch computes on inputs the export never saw."""
    config = small_config.replace(name="gelu", activation=activation)
    result = export_model(config, tmp_path, graphs=("optimized",), long_length=24)
    path = result.directory / GRAPHS["optimized"].file
    ops = [n.op_type for n in onnx.load(str(path)).graph.node]
    assert ops.count(fused_op) == config.n_layers
    assert not {"Erf", "Tanh", "Pow"} & set(ops)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feeds = make_feeds(config, [41, 3, 64, 17, 1], list(EVERY_MASK)[:5], seed=321)
    actual = session.run(["last_hidden_state", "mean_pooled"], feeds)
    assert compare(actual, _reference(config, feeds), feeds, "max_abs") <= GRAPHS["optimized"].tolerance["limit"]


@pytest.mark.slow
@pytest.mark.parametrize("change, fused", [
    ({"scaling": "temperature", "temperature": 4.0, "norm_placement": "pre", "activation": "gelu"}, True),
    ({"input_kind": "features"}, True),
    ({"scaling": "cosine", "temperature": 0.1}, False),  # q, k normalised between projection and QKᵀ
    ({"scaling": "length"}, False),  # the scale is a per-row tensor, not a constant
    ({"attention": "linear"}, False),
])
def test_attention_fusion_applies_only_where_the_pattern_matches(small_config, tmp_path, change, fused):
    """Unmatched variants keep their unfused attention; either way the optimized graph keeps
    parity."""
    config = small_config.replace(name="fusion", n_layers=1, **change)
    result = export_model(config, tmp_path, graphs=("optimized",), long_length=24)
    fp32 = onnx.load(str(result.directory / GRAPHS["fp32"].file))
    _, count = fuse_attention(fp32, config)
    assert count == (config.n_layers if fused else 0)
    assert result.metadata.graphs["optimized"].validation["passed"] is True


def test_fused_attention_gives_zeros_for_a_query_with_no_allowed_key(small_config, small_export):
    """A custom mask row with no allowed key: the fused kernel alone would give a uniform average;
    the graph must give what PyTorch gives (attention output zero, so only biases and residual)."""
    path = small_export.directory / GRAPHS["optimized"].file
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feeds = make_feeds(small_config, [12, 12], MaskSpec(kind=EVERY_MASK[-1].kind, custom_seed=3), seed=4)
    feeds["custom_mask"][:, 5, :] = False
    actual = session.run(["last_hidden_state", "mean_pooled"], feeds)
    expected = _reference(small_config, feeds)
    np.testing.assert_allclose(actual[0][:, 5], expected[0][:, 5], atol=FP32_TOLERANCE["limit"], rtol=0)


def test_unfused_masked_softmax_as_arithmetic_gives_the_same_bits(small_config, tmp_path):
    """export/optimize.py masks_as_arithmetic on a block fuse_attention leaves (cosine scaling): no Where left
    over the heads' scores, and every output bit for bit the fp32 graph's, over every mask kind (a custom mask
    row with no allowed key included) and padded rows; both run with no further graph optimisation."""
    from export.optimize import masks_as_arithmetic

    config = small_config.replace(name="arithmetic", scaling="cosine", temperature=0.1)
    result = export_model(config, tmp_path, graphs=("fp32",), long_length=24)
    fp32 = onnx.load(str(result.directory / GRAPHS["fp32"].file))
    rewritten, blocks = masks_as_arithmetic(onnx.load(str(result.directory / GRAPHS["fp32"].file)))
    assert blocks == config.n_layers
    assert sum(n.op_type == "Where" for n in rewritten.graph.node) < sum(n.op_type == "Where" for n in fp32.graph.node)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    before, after = (ort.InferenceSession(m.SerializeToString(), options, providers=["CPUExecutionProvider"])
                     for m in (fp32, rewritten))
    for mask in [*EVERY_MASK, MaskSpec(kind=EVERY_MASK[-1].kind, custom_seed=3)]:
        feeds = make_feeds(config, [9, 12, 3], mask, seed=5, padded_to=14)
        for want, got in zip(before.run(None, feeds), after.run(None, feeds)):
            np.testing.assert_array_equal(got, want)
