"""export/triton.py: the model repository Triton would load, checked with Triton's own config proto."""

from __future__ import annotations

from pathlib import Path

import pytest

from export.triton import TritonRepoError, triton_config, write_triton_repo
from model.export_format import Metadata, read_metadata

onnx = pytest.importorskip("onnx")
# tritonclient is a dev dependency (tritonclient[grpc]==2.73.0); its model_config.proto is Triton's own.
model_config_pb2 = pytest.importorskip("tritonclient.grpc.model_config_pb2")
from google.protobuf import text_format  # noqa: E402

TINY = dict(name="tiny", d_model=32, n_heads=2, n_layers=1, d_ff=64, vocab_size=100, max_positions=64)


@pytest.fixture(scope="module")
def tiny_export(tmp_path_factory) -> Path:
    from export.exporter import export_model
    from model.config import EncoderConfig

    out = tmp_path_factory.mktemp("exports")
    return export_model(EncoderConfig(**TINY), out, long_length=20).directory


def parse(path: Path):
    return text_format.Parse(path.read_text(), model_config_pb2.ModelConfig())


def test_repository_layout_is_version_folder_with_the_exported_graph(tiny_export, tmp_path):
    model_dir = write_triton_repo(tiny_export, tmp_path / "repo")
    assert model_dir == tmp_path / "repo" / "tiny"
    assert sorted(p.relative_to(model_dir).as_posix() for p in model_dir.rglob("*") if p.is_file()) == [
        "1/model.onnx", "config.pbtxt", "metadata.json"]
    assert (model_dir / "1" / "model.onnx").read_bytes() == (tiny_export / "model.onnx").read_bytes()


def test_config_parses_with_tritons_model_config_and_matches_the_graph(tiny_export, tmp_path):
    config = parse(write_triton_repo(tiny_export, tmp_path / "repo", max_batch_size=16) / "config.pbtxt")
    assert config.name == "tiny"
    assert config.platform == "onnxruntime_onnx"
    assert config.max_batch_size == 16
    graph = onnx.load(str(tiny_export / "model.onnx"), load_external_data=False)
    graph_inputs = [i.name for i in graph.graph.input]
    assert [i.name for i in config.input] == graph_inputs
    assert [o.name for o in config.output] == [o.name for o in graph.graph.output]
    # Each Triton dims + the batch axis has the ONNX input's rank; symbolic axes are -1.
    for entry, value in zip(config.input, graph.graph.input):
        rank = len(value.type.tensor_type.shape.dim)
        if entry.HasField("reshape"):
            assert list(entry.dims) == [1] and list(entry.reshape.shape) == [] and rank == 1
        else:
            assert len(entry.dims) + 1 == rank
    by_name = {i.name: i for i in (*config.input, *config.output)}
    assert list(by_name["input_ids"].dims) == [-1]
    assert by_name["input_ids"].data_type == model_config_pb2.TYPE_INT64
    assert list(by_name["custom_mask"].dims) == [-1, -1]
    assert by_name["custom_mask"].data_type == model_config_pb2.TYPE_BOOL
    assert by_name["mask_causal"].data_type == model_config_pb2.TYPE_BOOL
    assert list(by_name["last_hidden_state"].dims) == [-1, TINY["d_model"]]
    assert list(by_name["mean_pooled"].dims) == [TINY["d_model"]]
    assert by_name["mean_pooled"].data_type == model_config_pb2.TYPE_FP32


def test_gpu_config_has_dynamic_batching_instances_and_tensorrt_fp16(tiny_export, tmp_path):
    config = parse(write_triton_repo(tiny_export, tmp_path / "repo", instance_count=2) / "config.pbtxt")
    assert config.dynamic_batching.max_queue_delay_microseconds == 2000
    assert [(g.count, g.kind) for g in config.instance_group] == [(2, model_config_pb2.ModelInstanceGroup.KIND_GPU)]
    (accelerator,) = config.optimization.execution_accelerators.gpu_execution_accelerator
    assert accelerator.name == "tensorrt"
    assert accelerator.parameters["precision_mode"] == "FP16"


@pytest.mark.parametrize("accelerator,expected", [("cuda", ["cuda"]), ("none", [])])
def test_accelerator_choice_cuda_or_none(tiny_export, tmp_path, accelerator, expected):
    config = parse(write_triton_repo(tiny_export, tmp_path / "repo", accelerator=accelerator) / "config.pbtxt")
    assert [a.name for a in config.optimization.execution_accelerators.gpu_execution_accelerator] == expected


def test_cpu_instances_get_no_gpu_accelerator(tiny_export):
    config = text_format.Parse(triton_config_cpu(read_metadata(tiny_export)), model_config_pb2.ModelConfig())
    assert config.instance_group[0].kind == model_config_pb2.ModelInstanceGroup.KIND_CPU
    assert not config.HasField("optimization")


def triton_config_cpu(metadata: Metadata) -> str:
    from export.triton import TritonOptions

    return triton_config(metadata, "tiny_cpu", TritonOptions(instance_kind="KIND_CPU"))


def test_rewriting_replaces_the_model_directory_whole(tiny_export, tmp_path):
    repo = tmp_path / "repo"
    write_triton_repo(tiny_export, repo, version=3)
    model_dir = write_triton_repo(tiny_export, repo)
    assert sorted(p.name for p in model_dir.iterdir()) == ["1", "config.pbtxt", "metadata.json"]
    assert [p.name for p in repo.iterdir()] == ["tiny"]  # no staging or backup left behind


def test_bad_requests_raise_typed_errors(tiny_export, tmp_path):
    with pytest.raises(TritonRepoError, match="not an export directory"):
        write_triton_repo(tmp_path / "nowhere", tmp_path / "repo")
    with pytest.raises(TritonRepoError, match="graph 'int8' not in"):
        write_triton_repo(tiny_export, tmp_path / "repo", graph="int8")
    with pytest.raises(TritonRepoError, match="accelerator"):
        write_triton_repo(tiny_export, tmp_path / "repo", accelerator="openvino")
