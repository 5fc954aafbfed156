"""Global attention in tiles (export/long_graphs.py): on the sparse graph a global layer never holds
T x T scores. A run of bidirectional rows goes to ONNX Runtime's fused attention (MLAS flash
attention: query x key tiles sized from the L2 cache, key padding carried as an extra head column);
any other run (causal, dilated, local_strided rows) to a Loop over QUERY_TILE queries per
sub-sequence. Both equal transformers' ModernBertModel / the dense PyTorch encoder at lengths around
their tiles, in padded batches; a wrong tile boundary fails the export's validation. Real exported
graphs, real ONNX Runtime."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch

import export.long_graphs as long_graphs
from export.cases import MaskSpec, make_feeds
from export.cli import main as export_main
from export.contract import ExportContract
from export.exporter import export_model
from export.validate import ToleranceExceeded, reference_outputs
from model.attention_paths import QUERY_TILE
from model.config import EncoderConfig
from model.hf_pretrained import load_pretrained
from model.mask_kinds import MaskKind
from tests.conftest import TINY
from tests.hf_references import MODERNBERT, redraw

ATOL = 1e-4  # the project's tolerance: hidden states at real positions, max abs
# ModernBERT's layout (global, local, local, global; window 128) at head_dim 64, ModernBERT-base's.
WIDE = dict(MODERNBERT, hidden_size=128, num_attention_heads=2, intermediate_size=96)
HEAD_DIM = 64


def flash_tiles(head_dim: int = HEAD_DIM) -> tuple[int, int]:
    """(query rows, key rows) of MLAS flash attention's tiles as MultiHeadAttention's CPU kernel sizes
    them: keys = L2 / (4 · 4 · (qk_head + v_head)), queries = min(keys, qk_head + v_head); our key
    padding adds one column to qk_head. L2 is the per-core cache (cpuinfo's, as sysfs gives it)."""
    size = Path("/sys/devices/system/cpu/cpu0/cache/index2/size")
    text = size.read_text().strip() if size.is_file() else "512K"
    l2 = int(text[:-1]) * {"K": 1 << 10, "M": 1 << 20}[text[-1]] if text[-1] in "KM" else int(text)
    heads_width = (head_dim + 1) + head_dim
    keys = max(l2 // (4 * 4 * heads_width), 1)
    return min(keys, heads_width), keys


def around(tile: int) -> list[int]:
    return [tile - 1, tile, tile + 1, 2 * tile + 1]


def export_plan(tmp_path_factory, **changes) -> tuple:
    """(transformers ModernBertModel (eager) of WIDE + `changes`, its checkpoint directory, the sparse graph
    file of its `python -m export --graphs fp32,long`)."""
    from transformers import ModernBertConfig, ModernBertModel

    config = ModernBertConfig(**{**WIDE, **changes})
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    reference = redraw(ModernBertModel(config))
    checkpoint = tmp_path_factory.mktemp("mb-tiled")
    reference.save_pretrained(str(checkpoint))
    out = tmp_path_factory.mktemp("mb-tiled-export")
    assert export_main(["--from-pretrained", str(checkpoint), "--out-dir", str(out), "--name", "mb",
                        "--graphs", "fp32,long", "--quiet"]) == 0
    return reference, checkpoint, str(out / "mb" / "model.sparse.onnx")


@pytest.fixture(scope="module")
def modernbert(tmp_path_factory):
    """(sparse graph file, transformers ModernBertModel (eager), its session, our dense encoder)."""
    reference, checkpoint, graph = export_plan(tmp_path_factory)
    session = ort.InferenceSession(graph, providers=["CPUExecutionProvider"])
    return graph, reference, session, load_pretrained(checkpoint)


def run_sparse(session, feeds) -> np.ndarray:
    names = {i.name for i in session.get_inputs()}
    return session.run(["last_hidden_state"], {k: v for k, v in feeds.items() if k in names})[0]


def assert_close_at_real_positions(actual, expected, attention_mask) -> None:
    assert actual.shape == expected.shape and actual.dtype == np.float32
    valid = attention_mask.astype(bool)
    np.testing.assert_allclose(actual[valid], expected[valid], atol=ATOL, rtol=0)


def bidirectional_feeds(config: EncoderConfig, lengths: list[int], seed: int = 0) -> dict:
    feeds = make_feeds(config, lengths, MaskSpec(MaskKind.BIDIRECTIONAL), seed=seed)
    feeds["input_ids"] = np.where(feeds["attention_mask"] == 1, np.maximum(feeds["input_ids"], 3), 0)
    return feeds


# --- the fused path (bidirectional runs) against transformers -------------------------------------------

def _fused_lengths() -> list[list[int]]:
    queries, keys = flash_tiles()
    rows = [[n] for n in sorted(set(around(queries) + around(keys)))]
    return rows + [[2 * keys + 1, keys, queries + 1, 1], [queries, 0, 5]]  # padded batches, a fully padded row


@pytest.mark.parametrize("lengths", _fused_lengths(), ids=str)
def test_global_layers_equal_transformers_around_the_flash_tiles(modernbert, lengths):
    _, reference, session, loaded = modernbert
    feeds = bidirectional_feeds(loaded.config, lengths, seed=len(lengths))
    with torch.no_grad():
        expected = reference(input_ids=torch.from_numpy(feeds["input_ids"]),
                             attention_mask=torch.from_numpy(feeds["attention_mask"])).last_hidden_state.numpy()
    assert_close_at_real_positions(run_sparse(session, feeds), expected, feeds["attention_mask"])


def test_a_fully_padded_row_gets_finite_zeros_safe_hidden_states(modernbert):
    _, _, session, loaded = modernbert
    feeds = bidirectional_feeds(loaded.config, [40, 0])
    hidden = run_sparse(session, feeds)
    assert np.isfinite(hidden).all()


# --- the Loop path (causal, dilated, local_strided runs) against the dense PyTorch encoder --------------

@pytest.mark.parametrize("length", around(QUERY_TILE))
@pytest.mark.parametrize("spec", [MaskSpec(MaskKind.CAUSAL), MaskSpec(MaskKind.DILATED, step=3, causal=True),
                                  MaskSpec(MaskKind.LOCAL_STRIDED, window=5, step=2)], ids=lambda s: s.label())
def test_tiled_rows_equal_dense_pytorch_around_the_query_tile(modernbert, spec, length):
    """The dilated and local_strided steps make sub-sequences of length/step queries: their tiles
    split too. A padded second row in the same run."""
    _, _, session, loaded = modernbert
    length = length * (spec.step if spec.kind != MaskKind.CAUSAL else 1)
    feeds = make_feeds(loaded.config, [length, length // 2 + 1], spec, seed=length)
    expected = reference_outputs(loaded.encoder, ExportContract(loaded.config), feeds)[0]
    assert_close_at_real_positions(run_sparse(session, feeds), expected, feeds["attention_mask"])


def test_a_run_mixing_bidirectional_and_causal_rows_is_tiled_and_exact(modernbert):
    _, _, session, loaded = modernbert
    rows = [MaskSpec(MaskKind.BIDIRECTIONAL), MaskSpec(MaskKind.CAUSAL), MaskSpec(MaskKind.BIDIRECTIONAL)]
    feeds = make_feeds(loaded.config, [2 * QUERY_TILE + 1, QUERY_TILE, 0], rows, seed=4)
    expected = reference_outputs(loaded.encoder, ExportContract(loaded.config), feeds)[0]
    assert_close_at_real_positions(run_sparse(session, feeds), expected, feeds["attention_mask"])


# --- which kernel a run takes (ONNX Runtime's profile of one run) ---------------------------------------

def _kernels_run(graph: str, feeds: dict, tmp_path) -> dict[str, int]:
    """op type -> how many distinct nodes of it ran in one run (ONNX Runtime's profile)."""
    options = ort.SessionOptions()
    options.enable_profiling = True
    options.profile_file_prefix = str(tmp_path / "profile")
    session = ort.InferenceSession(graph, options, providers=["CPUExecutionProvider"])
    run_sparse(session, feeds)
    events = json.loads(Path(session.end_profiling()).read_text())
    nodes: dict[str, set] = {}
    for e in events:
        if e.get("cat") == "Node" and "op_name" in e.get("args", {}):
            nodes.setdefault(e["args"]["op_name"], set()).add(e["name"])
    return {op: len(names) for op, names in nodes.items()}


def test_a_bidirectional_run_takes_fused_attention_and_a_causal_run_the_tile_loop(modernbert, tmp_path):
    """Both run the local layers' band Loop (groups of blocks); only the causal run adds the global
    layers' Loop over query tiles, and only the bidirectional one the fused op."""
    graph, _, _, loaded = modernbert
    bidirectional = _kernels_run(graph, bidirectional_feeds(loaded.config, [300, 200]), tmp_path)
    causal = _kernels_run(graph, make_feeds(loaded.config, [300], MaskSpec(MaskKind.CAUSAL)), tmp_path)
    assert "MultiHeadAttention" in bidirectional and "MultiHeadAttention" not in causal
    assert causal.get("Loop", 0) > bidirectional.get("Loop", 0)


# --- the control: a wrong tile boundary is caught at export --------------------------------------------

def test_a_wrong_tile_boundary_fails_the_exports_validation(monkeypatch, tmp_path):
    """Tiles that start one query early (each tile re-computes its predecessor's last query and loses
    its own last one): the export validates the sparse graph against dense PyTorch (lengths past one
    tile, causal rows) and refuses it."""
    from onnxscript import opset18 as op

    monkeypatch.setattr(long_graphs, "first_query",
                        lambda index, tile: op.Mul(index, op.Sub(tile, long_graphs._i64(1))))
    config = EncoderConfig(name="broken-tiles", **{**TINY, "n_layers": 3}).replace(local_layers=(1,), local_window=8)
    with pytest.raises(ToleranceExceeded):
        export_model(config, tmp_path, graphs=("long",))
