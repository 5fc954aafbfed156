"""The CUDA path, end to end: the real server with `--device cuda` on a real NVIDIA GPU.

These run only where onnxruntime-gpu finds a GPU (`CUDAExecutionProvider` available). CI and the
development machine have none, so here they skip; on a GPU host run `pytest tests/test_cuda.py`
(docs/serving.md, "Checking the CUDA path"). Nothing is mocked: a skip is the honest answer where
no GPU exists.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from export.contract import FP32_TOLERANCE
from model.mask_kinds import MaskKind
from client import EncoderClient
from tests.concurrency import call_concurrently

ort = pytest.importorskip("onnxruntime")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    "CUDAExecutionProvider" not in ort.get_available_providers(),
    reason="needs onnxruntime-gpu and an NVIDIA GPU (CI has none)",
)]

CUDA = "CUDAExecutionProvider"
ATOL = FP32_TOLERANCE["limit"]
FP16_MIN_COSINE = 0.9999  # the fp16 graph's export tolerance (export/graphs.py)
LENGTHS = [5, 17, 1, 40]
MASKS = [
    dict(mask=MaskKind.BIDIRECTIONAL),
    dict(mask=MaskKind.CAUSAL),
    dict(mask=MaskKind.SLIDING_WINDOW, window=3, causal=True),
    dict(mask=MaskKind.DILATED, step=2),
    dict(mask=MaskKind.LOCAL_STRIDED, window=2, step=5, causal=True),
]


@pytest.fixture(scope="module")
def cuda_export_dir(tmp_path_factory):
    """The serve-test model with the fp32, optimized and fp16 graphs, exported and validated once."""
    from pathlib import Path

    from export.exporter import export_model
    from model.config import EncoderConfig

    config = EncoderConfig(name="serve-test", d_model=32, n_heads=4, n_layers=2, d_ff=64,
                           vocab_size=100, max_positions=128)
    out = tmp_path_factory.mktemp("cuda-export")
    return Path(export_model(config, out, graphs=("fp32", "optimized", "fp16")).directory)


@pytest.fixture(scope="module")
def reference(reference_for, cuda_export_dir):
    """reference(ids, **mask options) -> (hidden [T, D], mean [D]) from the PyTorch model, on CPU."""
    run = reference_for(cuda_export_dir)
    return lambda ids, mask=MaskKind.BIDIRECTIONAL, **options: run(ids, mask, **options)


@pytest.fixture(scope="module")
def cuda_server(serve_start, cuda_export_dir):
    """One server per graph variant, started lazily, all with --device cuda."""
    servers = {}

    def get(graph: str):
        if graph not in servers:
            servers[graph] = serve_start(cuda_export_dir, "--device", "cuda", "--graph", graph,
                                         "--max-queue-delay-ms", "20", timeout=180.0)
        return servers[graph]

    yield get
    for server in servers.values():
        assert server.terminate() == 0, server.log()


def _ids(length: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 100, length).astype(np.int64)


def _label(options: dict) -> str:
    return "-".join(f"{k}={v.label if isinstance(v, MaskKind) else v}" for k, v in options.items())


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def test_session_runs_on_the_cuda_execution_provider(cuda_server):
    with EncoderClient(cuda_server("fp32").target, timeout=60, retries=0) as client:
        info = client.model_info()
        out = client.encode([_ids(7, 0)])
    assert list(info.providers)[0] == CUDA
    assert out.metadata.execution_provider == CUDA


def test_graph_auto_serves_fp16_on_cuda(cuda_server, cuda_export_dir):
    meta = json.loads((cuda_export_dir / "metadata.json").read_text())
    with EncoderClient(cuda_server("auto").target, timeout=60, retries=0) as client:
        out = client.encode([_ids(7, 0)])
    assert out.metadata.model_sha256 == meta["graphs"]["fp16"]["sha256"]


@pytest.mark.parametrize("graph", ["fp32", "optimized"])
@pytest.mark.parametrize("options", MASKS, ids=_label)
def test_fp32_graphs_on_cuda_match_pytorch(cuda_server, reference, graph, options):
    sequences = [_ids(n, seed) for seed, n in enumerate(LENGTHS)]
    with EncoderClient(cuda_server(graph).target, timeout=60, retries=0) as client:
        out = client.encode(sequences, hidden_states=True, pooling="mean", **options)
    assert out.metadata.execution_provider == CUDA
    for seq, hidden, embedding in zip(sequences, out.hidden_states, out.embeddings):
        ref_hidden, ref_mean = reference(seq, **options)
        np.testing.assert_allclose(hidden, ref_hidden, atol=ATOL, rtol=0)
        np.testing.assert_allclose(embedding, ref_mean, atol=ATOL, rtol=0)


@pytest.mark.parametrize("options", MASKS, ids=_label)
def test_fp16_graph_on_cuda_is_within_its_cosine_tolerance(cuda_server, reference, options):
    sequences = [_ids(n, 50 + seed) for seed, n in enumerate(LENGTHS)]
    with EncoderClient(cuda_server("fp16").target, timeout=60, retries=0) as client:
        out = client.encode(sequences, hidden_states=True, pooling="mean", **options)
    assert out.embeddings.dtype == np.float32 and np.isfinite(out.embeddings).all()
    for seq, embedding in zip(sequences, out.embeddings):
        assert _cosine(embedding, reference(seq, **options)[1]) >= FP16_MIN_COSINE


def test_concurrent_requests_on_cuda_share_batches_and_match_single_requests(cuda_server):
    server = cuda_server("fp32")
    sequences = [_ids(3 + 5 * i, 100 + i) for i in range(16)]
    with EncoderClient(server.target, timeout=60, retries=0) as client:
        alone = [client.encode([seq]).embeddings[0] for seq in sequences]
        outputs = call_concurrently(lambda i: client.encode([sequences[i]]), len(sequences))
    for a, out in zip(alone, outputs):
        np.testing.assert_allclose(out.embeddings[0], a, atol=1e-5, rtol=0)
    assert max(out.metadata.batch_size for out in outputs) > 1


def test_tf32_opt_in_still_runs_on_cuda_within_the_fp16_cosine_bound(serve_start, cuda_export_dir, reference):
    server = serve_start(cuda_export_dir, "--device", "cuda", "--graph", "fp32", "--cuda-tf32", "true",
                         timeout=180.0)
    try:
        seq = _ids(40, 7)
        with EncoderClient(server.target, timeout=60, retries=0) as client:
            out = client.encode([seq])
        assert out.metadata.execution_provider == CUDA
        assert _cosine(out.embeddings[0], reference(seq)[1]) >= FP16_MIN_COSINE
    finally:
        assert server.terminate() == 0, server.log()


# --- long inputs on CUDA (model/attention_paths.py): the sparse and linear graphs equal PyTorch there too


LONG_SPECS = [
    dict(mask=MaskKind.SLIDING_WINDOW, window=0), dict(mask=MaskKind.SLIDING_WINDOW, window=64, causal=True),
    dict(mask=MaskKind.DILATED, step=7), dict(mask=MaskKind.LOCAL_STRIDED, window=5, step=2, causal=True),
]


@pytest.mark.parametrize("options", LONG_SPECS, ids=_label)
def test_sparse_graph_on_cuda_equals_pytorch(serve_long_export_dir, options):
    from export.cases import MaskSpec, make_feeds
    from export.contract import ExportContract
    from export.validate import reference_outputs
    from model.attention_paths import SPARSE
    from model.encoder import build_encoder
    from model.export_format import read_metadata

    config = read_metadata(serve_long_export_dir).config
    session = ort.InferenceSession(str(serve_long_export_dir / "model.sparse.onnx"),
                                   providers=[(CUDA, {"use_tf32": "0"})])
    assert session.get_providers()[0] == CUDA
    spec = MaskSpec(options["mask"], window=options.get("window", 0), step=options.get("step", 1),
                    causal=options.get("causal", False))
    feeds = make_feeds(config, [2049, 1000, 129, 0], spec, seed=4)
    contract = ExportContract(config, path=SPARSE)
    hidden, pooled = session.run(None, {s.name: feeds[s.name] for s in contract.inputs})
    want_hidden, want_pooled = reference_outputs(build_encoder(config), ExportContract(config), feeds)
    valid = feeds["attention_mask"].astype(bool)
    np.testing.assert_allclose(hidden[valid], want_hidden[valid], atol=ATOL, rtol=0)
    np.testing.assert_allclose(pooled, want_pooled, atol=ATOL, rtol=0)


def test_a_long_window_request_served_on_cuda_runs_sparse_and_equals_pytorch(serve_start, serve_long_export_dir,
                                                                             reference_for):
    server = serve_start(serve_long_export_dir, "--device", "cuda", timeout=180.0)
    ids = _ids(5000, seed=9) % 97
    with EncoderClient(server.target, timeout=120) as client:
        from client import build_request

        response = client.stub.Encode(build_request([ids], mask="sliding_window", window=32), timeout=120)
    assert list(response.metadata.attention_paths) == ["sparse"]
    assert response.metadata.execution_provider == CUDA
    _, pooled = reference_for(serve_long_export_dir)(ids, MaskKind.SLIDING_WINDOW, window=32)
    np.testing.assert_allclose(np.frombuffer(response.results[0].embedding.data, np.float32), pooled, atol=ATOL)
    assert server.terminate() == 0, server.log()


# --- global attention in tiles on CUDA (export/long_graphs.py): the sparse graph of a ModernBERT plan.
# A bidirectional run takes com.microsoft MultiHeadAttention (CUDA's own kernels, with the key padding as
# an extra head column); any other run the Loop over query tiles. Both must equal transformers there too.


@pytest.fixture(scope="module")
def modernbert_on_cuda(tmp_path_factory):
    """(transformers ModernBertModel (eager, CPU), the sparse graph's CUDA session, our loaded encoder, graph,
    the checkpoint's directory)."""
    from model.hf_pretrained import load_pretrained
    from tests.test_tiled_attention import export_plan

    reference, checkpoint, graph = export_plan(tmp_path_factory, max_position_embeddings=32768)  # rotary: any length
    session = ort.InferenceSession(graph, providers=[(CUDA, {"use_tf32": "0"})])
    assert session.get_providers()[0] == CUDA
    return reference, session, load_pretrained(checkpoint), graph, checkpoint


@pytest.mark.parametrize("lengths", [[1], [64], [65], [129], [300, 200, 0], [2049, 1000, 1]], ids=str)
def test_tiled_global_layers_on_cuda_equal_transformers_for_bidirectional_runs(modernbert_on_cuda, lengths):
    import torch

    from tests.test_tiled_attention import assert_close_at_real_positions, bidirectional_feeds, run_sparse

    reference, session, loaded, *_ = modernbert_on_cuda
    feeds = bidirectional_feeds(loaded.config, lengths, seed=len(lengths))
    with torch.no_grad():
        expected = reference(input_ids=torch.from_numpy(feeds["input_ids"]),
                             attention_mask=torch.from_numpy(feeds["attention_mask"])).last_hidden_state.numpy()
    hidden = run_sparse(session, feeds)
    assert np.isfinite(hidden).all()
    assert_close_at_real_positions(hidden, expected, feeds["attention_mask"])


@pytest.mark.parametrize("spec", ["causal", "dilated", "mixed"])
def test_tiled_loop_rows_on_cuda_equal_dense_pytorch(modernbert_on_cuda, spec):
    from export.cases import MaskSpec, make_feeds
    from export.contract import ExportContract
    from export.validate import reference_outputs
    from model.attention_paths import QUERY_TILE
    from tests.test_tiled_attention import assert_close_at_real_positions, run_sparse

    _, session, loaded, *_ = modernbert_on_cuda
    rows = {"causal": MaskSpec(MaskKind.CAUSAL), "dilated": MaskSpec(MaskKind.DILATED, step=3, causal=True),
            "mixed": [MaskSpec(MaskKind.BIDIRECTIONAL), MaskSpec(MaskKind.CAUSAL)]}[spec]
    feeds = make_feeds(loaded.config, [3 * QUERY_TILE + 1, QUERY_TILE], rows, seed=3)
    expected = reference_outputs(loaded.encoder, ExportContract(loaded.config), feeds)[0]
    assert_close_at_real_positions(run_sparse(session, feeds), expected, feeds["attention_mask"])


def test_the_fused_attention_of_a_bidirectional_run_executes_on_the_cuda_provider(modernbert_on_cuda, tmp_path):
    """ONNX Runtime places a node its CUDA provider cannot run on the CPU, silently: the profile says where
    each MultiHeadAttention node ran."""
    from tests.test_tiled_attention import bidirectional_feeds, run_sparse

    _, _, loaded, graph, _ = modernbert_on_cuda
    options = ort.SessionOptions()
    options.enable_profiling = True
    options.profile_file_prefix = str(tmp_path / "profile")
    session = ort.InferenceSession(graph, options, providers=[(CUDA, {"use_tf32": "0"})])
    run_sparse(session, bidirectional_feeds(loaded.config, [300, 200]))
    events = json.loads(Path(session.end_profiling()).read_text())
    providers = {e["args"].get("provider") for e in events
                 if e.get("cat") == "Node" and e.get("args", {}).get("op_name") == "MultiHeadAttention"}
    assert providers == {CUDA}


def test_on_cuda_a_row_past_the_kernels_32_bit_index_is_refused_and_the_server_stays_healthy(
        modernbert_on_cuda, serve_start):
    """ONNX Runtime's CUDA MultiHeadAttention runs its unfused kernel for the fused global layer (q/k head
    width 65) and indexes its B·H·T² scores with 32-bit integers: past 2^31 an illegal memory access
    leaves the process's CUDA context unusable (ModernBERT-base at 16k on an H200). The server refuses such
    a row RESOURCE_EXHAUSTED naming the limit (serve/core/attention_budget.py) and goes on serving."""
    import grpc

    from client import build_request

    _, _, _, graph, _ = modernbert_on_cuda
    server = serve_start(Path(graph).parent, "--device", "cuda", timeout=180.0)
    try:
        with EncoderClient(server.target, timeout=120, retries=0) as client:
            with pytest.raises(grpc.RpcError) as refused:  # 2 heads x 32768² = 2^31 scores
                client.stub.Encode(build_request([np.full(32768, 7, np.int64)]), timeout=120)
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "2147483647" in refused.value.details()
            response = client.stub.Encode(build_request([np.full(8192, 7, np.int64)]), timeout=120)
        assert list(response.metadata.attention_paths) == ["sparse"]
        assert response.metadata.execution_provider == CUDA
    finally:
        assert server.terminate() == 0, server.log()


# --- task heads on CUDA (model/heads.py): a cross-encoder's logits equal transformers' there too


def test_a_cross_encoder_head_on_cuda_matches_transformers(tmp_path):
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    from export.cli import main as export_main
    from tests.hf_references import redraw

    config = BertConfig(vocab_size=101, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=48, num_labels=1)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    reference = redraw(BertForSequenceClassification(config))
    reference.save_pretrained(str(tmp_path / "ce"))
    assert export_main(["--from-pretrained", str(tmp_path / "ce"), "--out-dir", str(tmp_path / "out"),
                        "--name", "ce", "--graphs", "fp32,optimized", "--quiet"]) == 0
    rng = np.random.default_rng(0)
    lengths = [13, 1, 40]
    ids = np.zeros((3, 40), np.int64)
    mask = np.zeros((3, 40), np.int64)
    types = np.zeros((3, 40), np.int64)
    for row, n in enumerate(lengths):
        ids[row, :n], mask[row, :n], types[row, n // 2:n] = rng.integers(3, 101, n), 1, 1
    with torch.no_grad():
        want = reference(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                         token_type_ids=torch.from_numpy(types)).logits.numpy()
    from model.masks import default_mask_inputs

    feeds = {k: v.numpy() for k, v in default_mask_inputs(torch.from_numpy(mask), MaskKind.BIDIRECTIONAL).items()}
    feeds.update(input_ids=ids, attention_mask=mask, token_type_ids=types)
    for name in ("model.onnx", "model.optimized.onnx"):
        session = ort.InferenceSession(str(tmp_path / "out" / "ce" / name), providers=[(CUDA, {"use_tf32": "0"})])
        assert session.get_providers()[0] == CUDA
        wanted = {i.name for i in session.get_inputs()}
        logits = session.run(["logits"], {k: v for k, v in feeds.items() if k in wanted})[0]
        np.testing.assert_allclose(logits, want, atol=ATOL, rtol=0, err_msg=name)
