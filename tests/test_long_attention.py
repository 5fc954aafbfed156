"""Long inputs: the sparse and linear attention graphs (model/attention_paths.py, export/long_graphs.py)
equal the dense PyTorch encoder on every kind they compute, and hold no tensor with two
sequence-sized axes. The graphs are the real exported files, run in real ONNX Runtime."""

from __future__ import annotations


import numpy as np
import onnx
import onnxruntime as ort
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from export.cases import MaskSpec, make_feeds
from export.contract import FP32_TOLERANCE, ExportContract
from export.exporter import export_onnx
from export.validate import reference_outputs
from model.attention_paths import DENSE, LINEAR, SPARSE, RowMask, cheapest, score_elements
from model.encoder import build_encoder
from model.export_format import read_metadata
from model.mask_kinds import MaskKind

ATOL = FP32_TOLERANCE["limit"]
LENGTHS = [1, 7, 129, 1000, 2049]  # the lengths: 1, a prime, past a block, long, past 2k
BIG = 5000  # a window or step past every length here


class LongGraph:
    """One long-input graph of a tiny config, beside its dense PyTorch reference."""

    def __init__(self, config, path: str, file) -> None:
        self.config, self.path, self.file = config, path, str(file)
        self.contract = ExportContract(config, path=path)
        self.dense = ExportContract(config)
        self.model = build_encoder(config)
        self.session = ort.InferenceSession(str(file), providers=["CPUExecutionProvider"])

    def check(self, feeds) -> float:
        """Runs the graph and the dense PyTorch encoder on `feeds`; asserts parity; returns the max error."""
        hidden, pooled = self.session.run(None, {s.name: feeds[s.name] for s in self.contract.inputs})
        want_hidden, want_pooled = reference_outputs(self.model, self.dense, feeds)
        assert hidden.shape == want_hidden.shape and hidden.dtype == np.float32
        assert np.isfinite(hidden).all() and np.isfinite(pooled).all()
        valid = feeds["attention_mask"].astype(bool)
        np.testing.assert_allclose(hidden[valid], want_hidden[valid], atol=ATOL, rtol=0)
        np.testing.assert_allclose(pooled, want_pooled, atol=ATOL, rtol=0)
        return float(np.abs(pooled - want_pooled).max(initial=0.0))


@pytest.fixture(scope="module")
def long_graphs(tmp_path_factory, tiny_config, serve_long_export_dir):
    """The tiny config's sparse graph (through export_model, so validated at export too), and the sparse
    graph of length scaling + pre-norm, linear and performer graphs (through export_onnx)."""
    out = tmp_path_factory.mktemp("long")
    metadata = read_metadata(serve_long_export_dir)
    assert metadata.graphs["sparse"].attention_path == SPARSE
    graphs = {"sparse": LongGraph(metadata.config, SPARSE, serve_long_export_dir / "model.sparse.onnx")}
    for name, change, path in (
        ("sparse-length-prenorm", dict(scaling="length", norm_placement="pre"), SPARSE),
        ("linear", dict(attention="linear"), LINEAR),
        ("performer", dict(attention="performer"), LINEAR),
    ):
        config = tiny_config.replace(name=name, **change)
        file = out / f"{name}.onnx"
        export_onnx(build_encoder(config), ExportContract(config, path=path), file)
        graphs[name] = LongGraph(config, path, file)
    return graphs


def _sparse_specs():
    specs = [MaskSpec(MaskKind.SLIDING_WINDOW, window=w, causal=c) for w in (0, 1, 5, 64, BIG) for c in (False, True)]
    specs += [MaskSpec(MaskKind.DILATED, step=k, causal=c) for k in (1, 2, 7, BIG) for c in (False, True)]
    specs += [MaskSpec(MaskKind.LOCAL_STRIDED, window=w, step=k, causal=c)
              for w, k in ((5, 7), (64, 2), (0, BIG)) for c in (False, True)]
    return specs


@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("spec", _sparse_specs(), ids=lambda s: s.label())
def test_sparse_graph_equals_dense_pytorch(long_graphs, spec, length):
    """Every window/step/causal choice; up to 129 tokens a full row and a padded row in one batch (the
    dense reference is the slow part at 1000 and 2049; padding is covered by the shorter ones)."""
    graph = long_graphs["sparse"]
    lengths = [length, length // 2 + 1] if length <= 129 else [length]
    graph.check(make_feeds(graph.config, lengths, spec, seed=length))


@pytest.mark.parametrize("spec", [MaskSpec(MaskKind.SLIDING_WINDOW, window=9, causal=True),
                                  MaskSpec(MaskKind.LOCAL_STRIDED, window=3, step=5)], ids=lambda s: s.label())
def test_sparse_graph_with_a_per_row_scale_equals_dense_pytorch(long_graphs, spec):
    """Length scaling (1/sqrt(d_k·T), T per row) and pre-norm: the scale is folded into q per row."""
    graph = long_graphs["sparse-length-prenorm"]
    graph.check(make_feeds(graph.config, [300, 41, 0], spec, seed=3))


def test_sparse_rows_with_different_kinds_and_windows_share_one_run(long_graphs):
    """Rows of one batch ask for different kinds and windows (one step): padded to the batch's largest
    window and masked inside the band; a fully padded row and left padding give finite zeros-safe rows."""
    graph = long_graphs["sparse"]
    rows = [MaskSpec(MaskKind.SLIDING_WINDOW, window=0), MaskSpec(MaskKind.SLIDING_WINDOW, window=70, causal=True),
            MaskSpec(MaskKind.DILATED, step=6), MaskSpec(MaskKind.LOCAL_STRIDED, window=3, step=6, causal=True),
            MaskSpec(MaskKind.SLIDING_WINDOW, window=2)]
    graph.check(make_feeds(graph.config, [1000, 129, 640, 7, 0], rows, seed=11))
    graph.check(make_feeds(graph.config, [300, 77], rows[1], seed=12, left_pad=True))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_sparse_graph_equals_dense_pytorch_on_random_batches(long_graphs, data):
    graph = long_graphs["sparse"]
    rows = data.draw(st.integers(1, 4))
    step = data.draw(st.integers(1, 60))
    kinds = st.sampled_from([MaskKind.SLIDING_WINDOW, MaskKind.DILATED, MaskKind.LOCAL_STRIDED])
    specs = [MaskSpec(kind, window=data.draw(st.integers(0, 90)), step=step, causal=data.draw(st.booleans()))
             for kind in (data.draw(kinds) for _ in range(rows))]
    lengths = [data.draw(st.integers(0, 300)) for _ in range(rows)]
    graph.check(make_feeds(graph.config, lengths, specs, seed=data.draw(st.integers(0, 99))))


@pytest.mark.parametrize("name", ["linear", "performer"])
@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("kind", [MaskKind.BIDIRECTIONAL, MaskKind.CAUSAL], ids=lambda k: k.label)
def test_linear_graph_equals_dense_pytorch(long_graphs, name, kind, length):
    graph = long_graphs[name]
    graph.check(make_feeds(graph.config, [length, length // 2 + 1], MaskSpec(kind), seed=length))


@pytest.mark.parametrize("name", ["linear", "performer"])
def test_linear_graph_mixes_bidirectional_and_causal_rows_and_padding(long_graphs, name):
    graph = long_graphs[name]
    rows = [MaskSpec(MaskKind.CAUSAL), MaskSpec(MaskKind.BIDIRECTIONAL)] * 2
    graph.check(make_feeds(graph.config, [200, 65, 0, 130], rows, seed=5))
    graph.check(make_feeds(graph.config, [90, 7], MaskSpec(MaskKind.CAUSAL), seed=6, left_pad=True))


# --- cost: no [T, T] tensor -------------------------------------------------------------------------


def _intermediate_shapes(path: str, feeds: dict) -> dict[str, tuple[int, ...]]:
    """Every intermediate tensor's shape in one real run (each node output made a graph output)."""
    model = onnx.shape_inference.infer_shapes(onnx.load(path))
    known = {v.name: v for v in model.graph.value_info}
    outputs = {o.name for o in model.graph.output}
    for node in model.graph.node:
        for name in node.output:
            if name in known and name not in outputs:
                model.graph.output.append(known[name])
                outputs.add(name)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    inputs = {i.name for i in session.get_inputs()}
    return {n: np.shape(a) for n, a in zip(names, session.run(names, {k: v for k, v in feeds.items() if k in inputs}))}


def _two_sequence_axes(shapes_short, shapes_long) -> list[str]:
    """Tensors with two axes that grow with the sequence (doubling the length doubles both)."""
    return [name for name, short in shapes_short.items()
            if name in shapes_long and len(short) == len(shapes_long[name])
            and sum(1 for a, b in zip(short, shapes_long[name]) if b >= 2 * a and a > 1) >= 2]


@pytest.mark.parametrize("spec", [MaskSpec(MaskKind.SLIDING_WINDOW, window=8),
                                  MaskSpec(MaskKind.SLIDING_WINDOW, window=8, causal=True)], ids=lambda s: s.label())
def test_sparse_graph_holds_no_tensor_with_two_sequence_axes(long_graphs, tiny_config, spec):
    graph = long_graphs["sparse"]
    short = _intermediate_shapes(graph.file, make_feeds(tiny_config, [512], spec))
    long = _intermediate_shapes(graph.file, make_feeds(tiny_config, [1024], spec))
    assert len(short) > 100  # the run really exposed the graph's intermediates
    assert _two_sequence_axes(short, long) == []


def test_linear_graph_holds_no_tensor_with_two_sequence_axes(long_graphs):
    graph = long_graphs["linear"]
    spec = MaskSpec(MaskKind.CAUSAL)
    short = _intermediate_shapes(graph.file, make_feeds(graph.config, [512], spec))
    long = _intermediate_shapes(graph.file, make_feeds(graph.config, [1024], spec))
    assert _two_sequence_axes(short, long) == []


def test_the_dense_graph_does_hold_tensors_with_two_sequence_axes(tmp_path, tiny_config):
    """The check above can fail: the dense graph's [B, T, T] mask and scores are caught by it."""
    file = tmp_path / "dense.onnx"
    export_onnx(build_encoder(tiny_config), ExportContract(tiny_config), file)
    spec = MaskSpec(MaskKind.SLIDING_WINDOW, window=8)
    short = _intermediate_shapes(str(file), make_feeds(tiny_config, [64], spec))
    long = _intermediate_shapes(str(file), make_feeds(tiny_config, [128], spec))
    assert len(_two_sequence_axes(short, long)) >= 4


# --- which path a row takes ----------------------------------------------------------------------------


def test_a_long_window_row_takes_the_sparse_path_and_a_bidirectional_row_the_dense_one(tiny_config):
    paths = (DENSE, SPARSE)
    assert cheapest(32768, RowMask(MaskKind.SLIDING_WINDOW, 128), tiny_config, paths) == SPARSE
    assert cheapest(32768, RowMask(MaskKind.BIDIRECTIONAL), tiny_config, paths) == DENSE
    assert cheapest(32768, RowMask(MaskKind.CUSTOM), tiny_config, paths) == DENSE
    assert cheapest(32768, RowMask(MaskKind.SLIDING_WINDOW, 128), tiny_config, (DENSE,)) == DENSE


def test_a_short_row_with_a_window_past_its_length_stays_dense(tiny_config):
    """Where the band would cover the whole row, the banded path computes more than dense: dense wins."""
    assert cheapest(40, RowMask(MaskKind.SLIDING_WINDOW, 64), tiny_config, (DENSE, SPARSE)) == DENSE


def test_sparse_work_grows_linearly_with_the_length_for_a_fixed_window(tiny_config):
    mask = RowMask(MaskKind.SLIDING_WINDOW, 128)
    ratio = score_elements(SPARSE, 32768, mask, tiny_config) / score_elements(SPARSE, 4096, mask, tiny_config)
    assert ratio == pytest.approx(8, rel=0.01)
    assert score_elements(DENSE, 32768, mask, tiny_config) / score_elements(DENSE, 4096, mask, tiny_config) == 64


def test_linear_configs_serve_bidirectional_and_causal_rows_on_the_linear_path(tiny_config):
    config = tiny_config.replace(attention="performer")
    assert cheapest(4096, RowMask(MaskKind.CAUSAL), config, (DENSE, LINEAR)) == LINEAR
    assert cheapest(4096, RowMask(MaskKind.SLIDING_WINDOW, 8), config, (DENSE, LINEAR)) == DENSE


# --- a model's own attention plan (ModernBERT: global every third layer, local window 64) --------------

def _plan(tiny_config):
    return tiny_config.replace(n_layers=22, local_layers=tuple(i for i in range(22) if i % 3), local_window=64)


def test_with_a_plan_a_long_bidirectional_row_takes_the_sparse_path_and_a_short_one_stays_dense(tiny_config):
    plan = _plan(tiny_config)
    assert cheapest(8192, RowMask(MaskKind.BIDIRECTIONAL), plan, (DENSE, SPARSE)) == SPARSE
    assert cheapest(8192, RowMask(MaskKind.CAUSAL), plan, (DENSE, SPARSE)) == SPARSE
    assert cheapest(8192, RowMask(MaskKind.CUSTOM), plan, (DENSE, SPARSE)) == DENSE
    assert cheapest(64, RowMask(MaskKind.BIDIRECTIONAL), plan, (DENSE, SPARSE)) == DENSE


def test_a_plan_costs_its_mean_layer_and_needs_the_memory_of_its_largest(tiny_config):
    plan, row = _plan(tiny_config), RowMask(MaskKind.BIDIRECTIONAL)
    work = score_elements(SPARSE, 8192, row, plan) / score_elements(DENSE, 8192, row, plan)
    assert work == pytest.approx(8 / 22, rel=0.1)  # 8 global layers of 22 are dense, 14 local ones ~free
    # the memory of one layer at its peak: the local layers' band T·3·64, above a global layer's tile of
    # QUERY_TILE·T queries (export/long_graphs.py): never T x T
    assert score_elements(SPARSE, 8192, row, plan, peak=True) == 8192 * 3 * 64
    assert score_elements(SPARSE, 8192, RowMask(MaskKind.SLIDING_WINDOW, 16), plan, peak=True) < 8192 * 3 * 64 * 2


# --- the band in groups of blocks (export/long_graphs.py `_band`): a Loop over groups of G blocks, G sized so
# a group's scores stay in L2 (BAND_GROUP_BYTES). At the export's validation lengths a tiny model's band is
# one group; with BAND_GROUP_BYTES = 1 every block is its own group, so every group boundary is crossed.

@pytest.fixture(scope="module")
def one_block_groups(tmp_path_factory, tiny_config):
    import export.long_graphs as long_graphs

    config = tiny_config.replace(name="one-block-groups", n_layers=2, local_layers=(1,), local_window=8)
    saved, long_graphs.BAND_GROUP_BYTES = long_graphs.BAND_GROUP_BYTES, 1
    try:
        file = tmp_path_factory.mktemp("groups") / "sparse.onnx"
        export_onnx(build_encoder(config), ExportContract(config, path=SPARSE), file)
    finally:
        long_graphs.BAND_GROUP_BYTES = saved
    return LongGraph(config, SPARSE, file)


@pytest.mark.parametrize("spec", [MaskSpec(MaskKind.SLIDING_WINDOW, window=5, causal=True),
                                  MaskSpec(MaskKind.LOCAL_STRIDED, window=5, step=7),
                                  MaskSpec(MaskKind.BIDIRECTIONAL), MaskSpec(MaskKind.CAUSAL)],
                         ids=lambda s: s.label())
def test_band_groups_of_one_block_each_equal_dense_pytorch(one_block_groups, spec):
    """A plan (a global and a local layer): the local layer's band and, for the window and strided rows, the
    global layer's band run as one Loop iteration per block, in a padded batch."""
    one_block_groups.check(make_feeds(one_block_groups.config, [129, 40, 1], spec, seed=11))


def test_a_wrong_band_group_boundary_fails_the_exports_validation(monkeypatch, tmp_path, tiny_config):
    """Groups after the first start one block early (each re-computes its predecessor's last block and
    loses its own last one): the export's validation against dense PyTorch refuses the graph."""
    from onnxscript import opset18 as op

    import export.long_graphs as long_graphs
    from export.exporter import export_model
    from export.validate import ToleranceExceeded

    monkeypatch.setattr(long_graphs, "BAND_GROUP_BYTES", 1)
    monkeypatch.setattr(long_graphs, "first_block",
                        lambda index, group: op.Sub(op.Mul(index, group), op.Min(index, long_graphs._i64(1))))
    with pytest.raises(ToleranceExceeded):
        export_model(tiny_config.replace(name="broken-groups"), tmp_path, graphs=("long",))
