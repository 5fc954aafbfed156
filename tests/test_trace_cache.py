"""The run's cache of torch.onnx traces (export/trace_cache.py): a hit gives the graph the trace would have
written, and anything the trace reads (weights, contract, patched code) changes the key."""

from __future__ import annotations

import numpy as np
import onnx
import onnx.helper
import onnx.numpy_helper
import pytest

import export.exporter  # noqa: F401  (the modules a key covers are those export.exporter reaches)
import export.long_graphs as long_graphs
from export import trace_cache
from export.contract import ExportContract
from export.exporter import export_model
from model.attention_paths import SPARSE
from model.encoder import build_encoder
from model.onnx_files import data_file_name


def _graph(path, external: bool = False) -> None:
    """A one-node graph standing in for torch.onnx's, its weight inside the file or beside it."""
    weight = onnx.numpy_helper.from_array(np.ones(64, dtype=np.float32), "w")
    graph = onnx.helper.make_graph([onnx.helper.make_node("Identity", ["w"], ["y"])], "g", [],
                                   [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [64])], [weight])
    onnx.save_model(onnx.helper.make_model(graph), str(path), save_as_external_data=external,
                    location=data_file_name(path), size_threshold=0)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    where = tmp_path / "cache"
    monkeypatch.setenv(trace_cache.ENV, str(where))
    return where


def test_a_second_export_of_the_same_model_reads_the_cached_trace_and_is_still_validated(cache, tmp_path,
                                                                                        tiny_config):
    config = tiny_config.replace(name="cached", n_layers=1)
    first = export_model(config, tmp_path / "first")
    entries = sorted(cache.iterdir())
    second = export_model(config.replace(name="cached-again"), tmp_path / "second")  # a name is not in the graph
    assert len(entries) == 1 and sorted(cache.iterdir()) == entries
    assert (second.directory / "model.onnx").read_bytes() == (first.directory / "model.onnx").read_bytes()
    assert second.metadata.graphs["fp32"].validation["cases"] > 0
    onnx.checker.check_model(str(second.directory / "model.onnx"))


def test_without_the_variable_nothing_is_cached(tmp_path, monkeypatch, tiny_config):
    monkeypatch.delenv(trace_cache.ENV, raising=False)
    calls = []
    model, contract = build_encoder(tiny_config), ExportContract(tiny_config)
    for _ in range(2):
        assert not trace_cache.traced(model, contract, tmp_path / "g.onnx", False,
                                      lambda path: calls.append(_graph(path)))
    assert len(calls) == 2


def test_off_turns_the_cache_off(tmp_path, monkeypatch, tiny_config):
    monkeypatch.setenv(trace_cache.ENV, trace_cache.OFF)
    monkeypatch.chdir(tmp_path)
    calls = []
    model, contract = build_encoder(tiny_config), ExportContract(tiny_config)
    for _ in range(2):
        trace_cache.traced(model, contract, tmp_path / "g.onnx", False,
                           lambda path: calls.append(_graph(path)))
    assert len(calls) == 2 and not (tmp_path / trace_cache.OFF).exists()


def test_a_hit_copies_the_entry_without_tracing(cache, tmp_path, tiny_config):
    calls = []
    model, contract = build_encoder(tiny_config), ExportContract(tiny_config)
    trace = lambda path: calls.append(_graph(path))  # noqa: E731  (the graph torch.onnx would write)
    assert not trace_cache.traced(model, contract, tmp_path / "a.onnx", False, trace)
    assert trace_cache.traced(model, contract, tmp_path / "b.onnx", False, trace)
    assert len(calls) == 1 and (tmp_path / "b.onnx").read_bytes() == (tmp_path / "a.onnx").read_bytes()


def test_a_trace_with_external_weights_is_not_cached(cache, tmp_path, tiny_config):
    model, contract = build_encoder(tiny_config), ExportContract(tiny_config)

    trace_cache.traced(model, contract, tmp_path / "g.onnx", False, lambda path: _graph(path, external=True))
    assert (tmp_path / data_file_name("g.onnx")).exists()
    assert not cache.exists() or not list(cache.glob("*.onnx"))


def test_other_weights_another_contract_or_patched_export_code_give_another_key(monkeypatch, tiny_config):
    model, contract = build_encoder(tiny_config), ExportContract(tiny_config)
    same = trace_cache.key(model, contract, False)
    assert trace_cache.key(build_encoder(tiny_config), ExportContract(tiny_config), False) == same
    other_weights = build_encoder(tiny_config)
    with __import__("torch").no_grad():
        next(other_weights.parameters()).add_(1.0)
    assert trace_cache.key(other_weights, contract, False) != same
    assert trace_cache.key(model, ExportContract(tiny_config, path=SPARSE), False) != same
    monkeypatch.setattr(long_graphs, "BAND_GROUP_BYTES", 1)
    assert trace_cache.key(model, contract, False) != same
    monkeypatch.undo()
    monkeypatch.setattr(long_graphs, "first_block", lambda index, group: index)
    assert trace_cache.key(model, contract, False) != same
