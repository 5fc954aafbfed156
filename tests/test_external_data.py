"""Graphs whose weights live beside them as ONNX external data (model/onnx_files.py): what every model
over 2 GB needs, since one protobuf cannot hold it. A tiny model exported with `--external-data` takes
the same path a 2 GB one takes, in every step: export, the checker, the optimizer, int8, metadata's
hashes, serving, the Triton repository."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import grpc
import numpy as np
import onnx
import pytest

from model import onnx_files

SMALL = ["--set", "d_model=32", "--set", "n_heads=4", "--set", "n_layers=1", "--set", "d_ff=64",
         "--set", "vocab_size=100", "--set", "max_positions=64"]


@pytest.fixture(scope="module")
def external_export(tmp_path_factory) -> Path:
    from export.cli import main

    out = tmp_path_factory.mktemp("external")
    assert main(["--out-dir", str(out), "--name", "ext", "--graphs", "fp32,optimized,int8", "--external-data",
                 "--quiet", *SMALL]) == 0
    return out / "ext"


def test_every_graph_keeps_its_weights_in_a_data_file_listed_with_its_hash(external_export):
    from model.export_format import read_metadata, sha256_file

    graphs = read_metadata(external_export).graphs
    assert set(graphs) == {"fp32", "optimized", "int8"}
    for name, entry in graphs.items():
        graph = external_export / entry.file
        assert onnx_files.data_files(graph) == tuple(d["file"] for d in entry.data) != (), name
        for data in entry.data:
            path = external_export / data["file"]
            assert sha256_file(path) == data["sha256"] and path.stat().st_size == data["bytes"]
        # the weights are there, not in the graph (tensors under 1 KB stay inline, as ONNX's writer does)
        inline = onnx.load(str(graph), load_external_data=False).graph.initializer
        assert max((len(t.raw_data) for t in inline), default=0) < 1024, name


def test_the_graphs_share_one_data_file_holding_each_tensor_once(external_export):
    """fp32 and optimized hold the same FFN and output weights, all three the embedding tables: on disk once."""
    from model.export_format import read_metadata

    graphs = read_metadata(external_export).graphs
    assert {d["file"] for e in graphs.values() for d in e.data} == {onnx_files.SHARED_DATA}
    own = [e.data[0]["tensor_bytes"] for e in graphs.values()]
    assert own == [sum(onnx_files.tensor_bytes(external_export / e.file).values()) for e in graphs.values()]
    assert max(own) < (external_export / onnx_files.SHARED_DATA).stat().st_size < sum(own)


def test_share_data_places_equal_tensors_once_and_keeps_every_graph_whole(tmp_path):
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    shared, own = rng.standard_normal((512, 512)).astype(np.float32), rng.standard_normal((512, 512)).astype(np.float32)
    x = rng.standard_normal((2, 512)).astype(np.float32)
    paths = []
    for name, weights in (("a.onnx", [shared, own]), ("b.onnx", [shared, shared])):
        inits = [numpy_helper.from_array(w, f"w{i}") for i, w in enumerate(weights)]
        graph = helper.make_graph([helper.make_node("MatMul", ["x", "w0"], ["h"]), helper.make_node("MatMul", ["h", "w1"], ["y"])],
                                  "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 512])],
                                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 512])], inits)
        onnx_files.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10),
                        tmp_path / name, external=True)
        paths.append(tmp_path / name)
    onnx_files.share_data(paths)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.onnx", "b.onnx", onnx_files.SHARED_DATA]
    assert (tmp_path / onnx_files.SHARED_DATA).stat().st_size < 3 * 512 * 512 * 4 + onnx_files.ALIGNMENT * 3
    for path, (first, second) in zip(paths, ((shared, own), (shared, shared))):
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        np.testing.assert_allclose(session.run(None, {"x": x})[0], x @ first @ second, rtol=1e-4, atol=1e-3)


def test_nothing_but_the_listed_files_is_left_in_the_export(external_export):
    from model.export_format import read_metadata

    graphs = read_metadata(external_export).graphs
    listed = {"metadata.json"} | {e.file for e in graphs.values()} | {d["file"] for e in graphs.values() for d in e.data}
    assert {p.name for p in external_export.iterdir()} == listed


def test_a_served_external_data_export_answers_what_pytorch_computes(external_export, serve_start, reference_for):
    from serve.protocols.pb import pb, pb_grpc
    from serve.protocols.tensors import from_numpy, to_numpy

    server = serve_start(external_export)
    ids = np.random.default_rng(3).integers(0, 100, 17)
    with grpc.insecure_channel(server.target) as channel:
        response = pb_grpc.EncoderServiceStub(channel).Encode(
            pb.EncodeRequest(sequences=[from_numpy(ids)], output=pb.OutputOptions(hidden_states=True)), timeout=30)
    hidden, mean = reference_for(external_export)(ids)
    np.testing.assert_allclose(to_numpy(response.results[0].hidden_states, "hidden"), hidden, atol=1e-4, rtol=0)
    np.testing.assert_allclose(to_numpy(response.results[0].embedding, "embedding"), mean, atol=1e-4, rtol=0)


def test_a_changed_data_file_is_refused_at_load_naming_it(external_export, tmp_path):
    from serve.backend.export_dir import ExportError, load_export

    copy = tmp_path / "ext"
    shutil.copytree(external_export, copy)
    data = copy / json.loads((copy / "metadata.json").read_text())["graphs"]["fp32"]["data"][0]["file"]
    data.write_bytes(data.read_bytes()[:-4] + b"\0\0\0\1")
    with pytest.raises(ExportError, match=r"weights\.data: sha256 .* graph 'fp32' external data changed"):
        load_export(copy)


def test_a_missing_data_file_is_refused_at_load_naming_it(external_export, tmp_path):
    from serve.backend.export_dir import ExportError, load_export

    copy = tmp_path / "ext"
    shutil.copytree(external_export, copy)
    (copy / "weights.data").unlink()
    with pytest.raises(ExportError, match=r"weights\.data not found \(the external data of graph 'fp32'"):
        load_export(copy)


def test_the_triton_repository_carries_the_data_file_beside_the_graph(external_export, tmp_path):
    import onnxruntime as ort

    from export.triton import write_triton_repo

    model_dir = write_triton_repo(external_export, tmp_path / "repo", graph="optimized")
    version = model_dir / "1"
    assert {p.name for p in version.iterdir()} == {"model.onnx", *onnx_files.data_files(version / "model.onnx")}
    ort.InferenceSession(str(version / "model.onnx"), providers=["CPUExecutionProvider"])  # loads with its weights


def test_save_writes_inline_under_the_threshold_and_external_when_asked(tmp_path):
    from onnx import TensorProto, helper, numpy_helper

    weight = numpy_helper.from_array(np.ones((64, 64), np.float32), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64])], [weight])
    proto = helper.make_model(graph)
    onnx_files.save(proto, tmp_path / "inline.onnx")
    onnx_files.save(proto, tmp_path / "external.onnx", external=True)
    assert onnx_files.data_files(tmp_path / "inline.onnx") == ()
    assert onnx_files.data_files(tmp_path / "external.onnx") == ("external.onnx.data",)
    onnx_files.save(proto, tmp_path / "external.onnx", external=True)  # again: replaces, never appends
    assert (tmp_path / "external.onnx.data").stat().st_size == 64 * 64 * 4
    np.testing.assert_array_equal(numpy_helper.to_array(onnx.load(str(tmp_path / "external.onnx")).graph.initializer[0]),
                                  np.ones((64, 64), np.float32))


def test_the_served_identity_covers_the_weights_not_only_the_graph_file(external_export):
    import hashlib

    from model.export_format import read_metadata
    from serve.backend.export_dir import load_export

    entry = read_metadata(external_export).graphs["fp32"]
    served = load_export(external_export).sha256
    assert served != entry.sha256  # the graph file names only where the weights lie
    assert served == hashlib.sha256(" ".join([entry.sha256, *(d["sha256"] for d in entry.data)]).encode()).hexdigest()


# --------------------------------------------------------------------------- the long graph's weights


def resident_kib(pid: int, file_name: str) -> int:
    """KiB of `file_name`'s pages resident in process `pid`'s mappings of it (/proc/PID/smaps)."""
    total, current = 0, None
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5:  # a mapping's header line: its file is the 6th field
            current = head[5] if len(head) > 5 else None
        elif head and head[0] == "Rss:" and current and Path(current).name == file_name:
            total += int(head[1])
    return total


@pytest.fixture(scope="module")
def external_long_export(tmp_path_factory) -> Path:
    from export.cli import main

    out = tmp_path_factory.mktemp("external-long")
    # weights of a few MiB, many pages: a vocabulary of 4,000 x 128 and FFNs of 512
    assert main(["--out-dir", str(out), "--name", "extlong", "--graphs", "fp32,sparse", "--external-data", "--quiet",
                 "--set", "d_model=128", "--set", "n_heads=4", "--set", "n_layers=2", "--set", "d_ff=512",
                 "--set", "vocab_size=4000", "--set", "max_positions=256"]) == 0
    return out / "extlong"


def test_a_long_graph_reads_its_weights_in_place_and_only_once_a_long_request_runs(external_long_export,
                                                                                   serve_start):
    """The long graph's session neither warms up nor pre-packs its weights (serve/backend/session.py): the
    export's data file stays mapped, and a long run reads every layer's weights there, in place. (A
    pre-packing session copies them out at load; a run then reads only the embedding rows it gathers
    from the file: measured +2.1 MB here, the embedding table, against +3.7 MB.)"""
    from client import EncoderClient, build_request

    data = onnx_files.SHARED_DATA
    server = serve_start(external_long_export, "--graph", "fp32")
    before = resident_kib(server.proc.pid, data)  # the embedding rows the dense graph's warm-up gathered
    ids = np.random.default_rng(0).integers(1, 4000, 200, dtype=np.int64)
    with EncoderClient(server.target, timeout=60.0) as client:
        # a sliding window of 4 over 200 tokens costs less on the sparse graph: the server runs it there
        client.stub.Encode(build_request([ids], mask="sliding_window", window=4), timeout=60)
    sparse = external_long_export / "model.sparse.onnx"
    embedding_bytes = 4000 * 128 * 4  # 200 ids of 4,000 touch most of its pages either way
    layer_bytes = sum(onnx_files.tensor_bytes(sparse).values()) - embedding_bytes
    assert (resident_kib(server.proc.pid, data) - before) * 1024 > embedding_bytes + layer_bytes // 2
