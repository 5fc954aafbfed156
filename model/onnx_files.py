"""ONNX graph files, with their weights inside or as ONNX external data: the one place that saves a
graph and knows which files a graph is made of (torch-free: the exporter and the server use it).

One ONNX protobuf cannot exceed 2 GB, so a model with more than ~500 M float32 parameters (bge-m3,
multilingual-e5-large, Qwen3-Embedding-0.6B) keeps its weights beside the graph: `model.onnx` holds
the graph and `model.onnx.data` the tensors, referenced by name from the graph (ONNX's external data
format; ONNX Runtime reads it from the graph's folder). `save` writes that form when the weights
are over EXTERNAL_BYTES or when asked (`python -m export --external-data`), the inline form
otherwise, so small exports stay one file.
"""

from __future__ import annotations

from pathlib import Path

import onnx

# Weights over this many bytes go to external data: a margin under protobuf's 2 GiB for the graph's
# own bytes (node attributes, names), which are never more than a few MB here.
EXTERNAL_BYTES = 1536 << 20
DATA_SUFFIX = ".data"  # model.onnx -> model.onnx.data


def data_file_name(graph_path: str | Path) -> str:
    return Path(graph_path).name + DATA_SUFFIX


def weight_bytes(proto: onnx.ModelProto) -> int:
    """Bytes of the graph's initializers held in the proto (not counting external ones)."""
    return sum(len(t.raw_data) or t.ByteSize() for t in proto.graph.initializer)


def save(proto: onnx.ModelProto, path: str | Path, *, external: bool | None = None) -> None:
    """Saves `proto` at `path`: weights in `<name>.data` beside it when `external` (None: when they are
    over EXTERNAL_BYTES), else inline. A stale data file of an earlier save is removed first (ONNX
    appends to an existing one). Saving external moves `proto`'s tensors out to the file (ONNX's writer
    does); saving it again reads them back first."""
    path = Path(path)
    data = path.with_name(data_file_name(path))
    if any(t.data_location == onnx.TensorProto.EXTERNAL for t in proto.graph.initializer):
        # a proto saved before points at its data file (ONNX's writer moves the tensors there): read them
        # back before that file is replaced
        onnx.load_external_data_for_model(proto, str(path.parent))
    if data.exists():
        data.unlink()
    if external is None:
        external = weight_bytes(proto) > EXTERNAL_BYTES
    if external:
        onnx.save_model(proto, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=data.name, size_threshold=1024)
    else:
        onnx.save_model(proto, str(path))


def cap_ir_version(path: str | Path, most: int) -> None:
    """Lowers the graph's IR version to `most` where a writer set it higher (onnx 1.23 writes 14;
    onnxruntime 1.31 reads 13). Only the graph file is rewritten: external weights stay where they are,
    since the graph refers to them by file, offset and length."""
    proto = onnx.load(str(path), load_external_data=False)
    if proto.ir_version > most:
        proto.ir_version = most
        onnx.save_model(proto, str(path))


def is_external(path: str | Path) -> bool:
    """Whether the graph at `path` keeps weights in external data files."""
    return bool(data_files(path))


def data_files(path: str | Path) -> tuple[str, ...]:
    """The external data files the graph at `path` refers to (names relative to its folder), in order."""
    proto = onnx.load(str(path), load_external_data=False)
    files: dict[str, None] = {}
    for tensor in _tensors(proto.graph):
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            location = next((e.value for e in tensor.external_data if e.key == "location"), "")
            files.setdefault(location, None)
    return tuple(files)


def _tensors(graph):
    yield from graph.initializer
    for node in graph.node:
        for attribute in node.attribute:
            if attribute.HasField("t"):
                yield attribute.t
            for sub in ([attribute.g] if attribute.HasField("g") else []) + list(attribute.graphs):
                yield from _tensors(sub)


def copy(source: str | Path, target: str | Path) -> None:
    """Copies a graph file and its data files (the data files keep their names: the graph refers to them)."""
    import shutil

    source, target = Path(source), Path(target)
    shutil.copyfile(source, target)
    for name in data_files(source):
        shutil.copyfile(source.parent / name, target.parent / name)
