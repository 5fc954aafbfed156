"""A graph over 2 GB, made cheap: one layer behind an embedding table of 8.5 M rows x 64 (2.18 GB of
float32), exported by `python -m export` and served by `python -m serve`. One ONNX protobuf cannot
hold it, so this is the path every model over 2 GB takes (bge-m3, multilingual-e5-large,
Qwen3-Embedding-0.6B): external data written by the exporter on its own (no --external-data), the
checker by path, metadata's data hashes, the server's load and checks (model/onnx_files.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grpc
import numpy as np
import pytest

from model import onnx_files

REPO = Path(__file__).resolve().parent.parent
VOCAB, D_MODEL = 8_500_000, 64
BIG = ["--set", f"vocab_size={VOCAB}", "--set", f"d_model={D_MODEL}", "--set", "n_heads=2", "--set", "n_layers=1",
       "--set", "d_ff=64", "--set", "max_positions=64", "--name", "big", "--graphs", "fp32", "--quiet"]
NEED = 12 << 30  # the export's peak (about 5x its weights, export/exporter.py PEAK_PER_WEIGHT_BYTE) and a margin


@pytest.fixture(scope="module")
def big_export(tmp_path_factory) -> Path:
    from export.exporter import available_memory

    if available_memory() < NEED:
        pytest.skip(f"needs {NEED >> 30} GiB of free memory for a 2.2 GB model, the host has "
                    f"{available_memory() / (1 << 30):.1f}")
    out = tmp_path_factory.mktemp("big")
    proc = subprocess.run([sys.executable, "-m", "export", "--out-dir", str(out), *BIG], cwd=REPO,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr
    return out / "big"


def test_a_graph_over_2_gb_exports_with_its_weights_beside_it(big_export):
    from model.export_format import read_metadata

    entry = read_metadata(big_export).graphs["fp32"]
    graph = big_export / entry.file
    assert graph.stat().st_size < 64 << 20 and entry.validation["passed"]
    assert [d["file"] for d in entry.data] == list(onnx_files.data_files(graph))
    assert sum(d["bytes"] for d in entry.data) > VOCAB * D_MODEL * 4 > 1 << 31


def test_a_graph_over_2_gb_serves_what_pytorch_computes(big_export, serve_start, reference_for):
    from serve.protocols.pb import pb, pb_grpc
    from serve.protocols.tensors import from_numpy, to_numpy

    server = serve_start(big_export, timeout=300)
    ids = np.array([0, 7, VOCAB // 2, VOCAB - 1, 123_456], np.int64)  # rows from both ends of the table
    with grpc.insecure_channel(server.target) as channel:
        response = pb_grpc.EncoderServiceStub(channel).Encode(
            pb.EncodeRequest(sequences=[from_numpy(ids)], output=pb.OutputOptions(hidden_states=True)), timeout=120)
    hidden, _ = reference_for(big_export)(ids)
    np.testing.assert_allclose(to_numpy(response.results[0].hidden_states, "hidden"), hidden, atol=1e-4, rtol=0)
