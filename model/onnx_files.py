"""ONNX graph files, with their weights inside or as ONNX external data: the one place that saves a
graph and knows which files a graph is made of (torch-free: the exporter and the server use it).

One ONNX protobuf cannot exceed 2 GB, so a model with more than ~500 M float32 parameters (bge-m3,
multilingual-e5-large, Qwen3-Embedding-0.6B) keeps its weights beside the graph: `model.onnx` holds
the graph and `model.onnx.data` the tensors, referenced by name from the graph (ONNX's external data
format; ONNX Runtime reads it from the graph's folder). `save` writes that form when the weights
are over EXTERNAL_BYTES or when asked (`python -m export --external-data`), the inline form
otherwise, so small exports stay one file. Once an export's graphs are built, `share_data` moves
their external tensors into one file, SHARED_DATA, each distinct tensor once: the graph variants of one
model (fp32, optimized, sparse, int8) hold mostly the same weights, which are then on disk once.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import onnx
from onnx.external_data_helper import ExternalDataInfo

# Weights over this many bytes go to external data: a margin under protobuf's 2 GiB for the graph's
# own bytes (node attributes, names), which are never more than a few MB here.
EXTERNAL_BYTES = 1536 << 20
DATA_SUFFIX = ".data"  # model.onnx -> model.onnx.data
SHARED_DATA = "weights.data"  # an export's graphs' external tensors, each once (share_data)
# As ONNX's own writer places tensors: those of 1 MiB or more at multiples of 64 KiB, so that ONNX
# Runtime can map them in place (the allocation granularity of any OS it runs on).
ALIGN_FROM_BYTES, ALIGNMENT = 1 << 20, 1 << 16


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


def _external(tensor) -> tuple[str, int, int]:
    """(file, offset, length) of an external tensor; a length left out runs to the tensor's size."""
    info = ExternalDataInfo(tensor)
    length = info.length
    if length is None:  # optional in the format: the tensor's own size
        count = 1
        for dim in tensor.dims:
            count *= dim
        length = count * onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
    return info.location, int(info.offset or 0), int(length)


def tensor_bytes(path: str | Path) -> dict[str, int]:
    """Per external data file of the graph at `path`, the bytes of the tensors the graph reads there (a
    file shared with other graphs, `share_data`, holds theirs too), each place counted once. The exporter
    records them in metadata.json (each data entry's "tensor_bytes"): the server, which has no onnx,
    sizes a graph by them."""
    proto = onnx.load(str(path), load_external_data=False)
    places = dict.fromkeys(_external(t) for t in _tensors(proto.graph) if t.data_location == onnx.TensorProto.EXTERNAL)
    used: dict[str, int] = {}  # in the order the graph first names each file, as data_files
    for location, _, length in places:
        used[location] = used.get(location, 0) + length
    return used


def share_data(paths: list[Path]) -> None:
    """Moves the external tensors of the graphs at `paths` (one folder) into SHARED_DATA there, each
    distinct tensor once (equal bytes: one place, whichever graphs refer to it), points every graph at
    it and removes their own data files. Every tensor is read back from its new place and compared
    (sha256) before any old file goes. Graphs without external tensors are left as they are."""
    folder = Path(paths[0]).parent
    target, staging = folder / SHARED_DATA, folder / (SHARED_DATA + ".partial")
    places: dict[bytes, tuple[int, int]] = {}  # sha256 of a tensor's bytes -> (offset, length) in target
    protos, old_files, moved = {}, set(), []
    with open(staging, "wb") as out:
        for path in paths:
            proto = onnx.load(str(path), load_external_data=False)
            tensors = [t for t in _tensors(proto.graph) if t.data_location == onnx.TensorProto.EXTERNAL]
            for tensor in tensors:
                location, offset, length = _external(tensor)
                with open(folder / location, "rb") as source:
                    source.seek(offset)
                    data = source.read(length)
                digest = hashlib.sha256(data).digest()
                if digest not in places:
                    if length >= ALIGN_FROM_BYTES:
                        out.write(b"\0" * (-out.tell() % ALIGNMENT))
                    places[digest] = (out.tell(), length)
                    out.write(data)
                old_files.add(location)
                moved.append((tensor, digest))
            if tensors:
                protos[path] = proto
    for tensor, digest in moved:
        offset, length = places[digest]
        del tensor.external_data[:]
        for key, value in (("location", SHARED_DATA), ("offset", str(offset)), ("length", str(length))):
            entry = tensor.external_data.add()
            entry.key, entry.value = key, value
    with open(staging, "rb") as written:
        for digest, (offset, length) in places.items():
            written.seek(offset)
            if hashlib.sha256(written.read(length)).digest() != digest:
                raise OSError(f"{staging}: a tensor read back at offset {offset} differs from what was written")
    os.replace(staging, target)
    for path, proto in protos.items():
        onnx.save_model(proto, str(path))  # the graph alone: its tensors now name SHARED_DATA
    for name in old_files - {SHARED_DATA}:
        (folder / name).unlink()


def copy(source: str | Path, target: str | Path) -> None:
    """Copies a graph file and its data files (the data files keep their names: the graph refers to them).
    A data file is hard-linked where the file system allows (an export's files are never rewritten in
    place), else copied."""
    import shutil

    source, target = Path(source), Path(target)
    shutil.copyfile(source, target)
    for name in data_files(source):
        try:
            os.link(source.parent / name, target.parent / name)
        except OSError:
            shutil.copyfile(source.parent / name, target.parent / name)
