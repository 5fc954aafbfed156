"""Long inputs in bounded memory over the wire: a ModernBERT-shaped export (768 wide, 12 heads, three
layers: global, local, local) served by the real server (subprocess, 127.0.0.1) answers an 8,192-token
bidirectional request on the sparse graph, whose global layer runs in tiles, while the server's peak
RSS stays under RSS_BOUND; untiled, that layer's 12 x 8192² float32 scores alone are 3 GiB. Two such
requests at once are both served. The budget (serve/core/attention_budget.py) follows the tiled costs:
it admits a 32k-token row of ModernBERT-base's plan and still refuses what does not fit, naming the
limit."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from client import EncoderClient, build_request
from export.cli import main as export_main
from model.attention_paths import DENSE, SPARSE, RowMask
from model.config import EncoderConfig
from model.mask_kinds import MaskKind
from serve.backend.session import CUDA
from serve.core.attention_budget import AttentionBudget
from serve.errors import TooLarge
from tests.concurrency import call_concurrently
from tests.hf_references import MODERNBERT, redraw

LENGTH = 8192
RSS_BOUND = 2 << 30  # bytes: the weights of both graphs, the runtime and the activations, not T x T scores
GIB = 1 << 30
# ModernBERT-base's width and plan, three layers (global, local, local), a small vocabulary.
SHAPE = dict(MODERNBERT, hidden_size=768, num_attention_heads=12, intermediate_size=1152, num_hidden_layers=3,
             vocab_size=512)


@pytest.fixture(scope="module")
def server(serve_start, tmp_path_factory):
    from transformers import ModernBertConfig, ModernBertModel

    torch.manual_seed(0)
    checkpoint = tmp_path_factory.mktemp("mb-wire")
    redraw(ModernBertModel(ModernBertConfig(**SHAPE))).save_pretrained(str(checkpoint))
    out = tmp_path_factory.mktemp("mb-wire-export")
    assert export_main(["--from-pretrained", str(checkpoint), "--out-dir", str(out), "--name", "mb",
                        "--graphs", "fp32,long", "--quiet"]) == 0
    return serve_start(out / "mb", timeout=120)


def peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def _encode(target: str, seed: int):
    ids = np.random.default_rng(seed).integers(5, SHAPE["vocab_size"], LENGTH)
    with EncoderClient(target, timeout=600) as client:
        return client.stub.Encode(build_request([ids]), timeout=600)


def test_an_8k_request_runs_sparse_within_the_rss_bound(server):
    response = _encode(server.target, 0)
    assert list(response.metadata.attention_paths) == ["sparse"]
    embedding = np.frombuffer(response.results[0].embedding.data, np.float32)
    assert embedding.shape == (768,) and np.isfinite(embedding).all()
    assert peak_rss(server.proc.pid) < RSS_BOUND


def test_two_8k_requests_at_once_are_both_served_within_the_rss_bound(server):
    responses = call_concurrently(lambda i: _encode(server.target, 10 + i), 2, timeout=600)
    assert all(r is not None and list(r.metadata.attention_paths) == ["sparse"] for r in responses)
    assert peak_rss(server.proc.pid) < RSS_BOUND


# --- the budget follows the tiled costs -----------------------------------------------------------------

def modernbert_base_plan() -> EncoderConfig:
    local = tuple(i for i in range(22) if i % 3)  # every third layer global
    return EncoderConfig(name="mb-base", d_model=768, n_heads=12, n_layers=22, d_ff=1152, ffn="gated",
                         vocab_size=50368, max_positions=8192, local_layers=local, local_window=64)


def test_the_budget_admits_a_32k_bidirectional_row_of_modernbert_base_on_the_sparse_path():
    """Untiled, its global layers' scores alone were estimated at 12 x 32768² x 18 bytes (216 GiB)."""
    budget = AttentionBudget(modernbert_base_plan(), (DENSE, SPARSE), 4 * GIB)
    total, paths = budget.check(np.array([32768]), RowMask(MaskKind.BIDIRECTIONAL))
    assert [path for path, _ in paths] == [SPARSE]
    assert total <= 4 * GIB


def test_the_budget_still_refuses_what_does_not_fit_naming_the_limit():
    budget = AttentionBudget(modernbert_base_plan(), (DENSE, SPARSE), GIB // 4)
    with pytest.raises(TooLarge) as refused:
        budget.check(np.array([32768, 32768]), RowMask(MaskKind.BIDIRECTIONAL))
    assert f"max_attention_bytes={GIB // 4}" in str(refused.value) and "T=32768" in str(refused.value)


# --- on CUDA (attention_budget.py): the fused global layer holds its T² scores, and no attention tensor
# passes what ONNX Runtime's CUDA kernels index (2^31 - 1 elements). Measured on an H200: ModernBERT-base's
# bidirectional 8k row held 11 GiB of device memory; 16k (12 x 16384² scores) was an illegal memory access.
# The budget's arithmetic needs no GPU: it is given the provider the sessions run on.

def _cuda_budget(max_bytes: int = 1 << 40) -> AttentionBudget:
    return AttentionBudget.for_device(modernbert_base_plan(), (DENSE, SPARSE), max_bytes, CUDA)


def test_on_cuda_a_bidirectional_rows_global_layer_is_counted_with_all_its_scores():
    cpu = AttentionBudget.for_device(modernbert_base_plan(), (DENSE, SPARSE), 1 << 40, "CPUExecutionProvider")
    scores_8k = 12 * 8192 ** 2 * 4  # one float32 tensor of the global layer's scores
    assert cpu.check(np.array([8192]), RowMask(MaskKind.BIDIRECTIONAL))[0] < scores_8k
    assert _cuda_budget().check(np.array([8192]), RowMask(MaskKind.BIDIRECTIONAL))[0] > scores_8k


def test_on_cuda_a_row_past_2_31_scores_in_one_tensor_is_refused_naming_the_limit():
    budget = _cuda_budget()
    budget.check(np.array([8192]), RowMask(MaskKind.BIDIRECTIONAL))  # 12 x 8192² = 805 M: admitted
    with pytest.raises(TooLarge) as refused:
        budget.check(np.array([16384]), RowMask(MaskKind.BIDIRECTIONAL))
    message = str(refused.value)
    assert "2147483647" in message and "CUDA" in message and "T=16384" in message


def test_on_cuda_rows_of_one_request_count_together_against_the_element_bound():
    with pytest.raises(TooLarge, match="3 sequences"):
        _cuda_budget().check(np.array([8192, 8192, 100]), RowMask(MaskKind.BIDIRECTIONAL))


def test_on_cuda_a_32k_sliding_window_row_is_still_admitted():
    total, paths = _cuda_budget().check(np.array([32768]), RowMask(MaskKind.SLIDING_WINDOW, 128))
    assert [path for path, _ in paths] == [SPARSE]


def test_on_the_cpu_no_element_bound_applies():
    budget = AttentionBudget.for_device(modernbert_base_plan(), (DENSE, SPARSE), 1 << 40, "CPUExecutionProvider")
    assert budget.max_elements == 0 and budget.row_elements(32768, RowMask(MaskKind.BIDIRECTIONAL)) == 0
    budget.check(np.array([32768, 32768]), RowMask(MaskKind.BIDIRECTIONAL))
