"""The export directory as the server sees it: which graphs it serves, read through model/export_format.py
(metadata.json, graph hashes, the config, the projection after pooling: its .npy files, hashes checked).
Refuses what it cannot serve with a message that says what to do, as an `ExportError` that is also a
`BackendError` (serve/errors.py maps it at the edge).
"""

from __future__ import annotations

import functools
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from model import export_format
from model.attention_paths import DENSE, PATHS
from model.config import EncoderConfig
from model.export_format import FORMAT, METADATA_FILE, Metadata
from model.projection import Dense
from model.tasks import PER_TOKEN_KINDS
from serve.errors import BackendError


class ExportError(export_format.ExportError, BackendError):
    """The format's ExportError (model/export_format.py), raised where the server reads an export."""


@dataclass(frozen=True)
class ExportDir:
    path: Path
    metadata: Metadata
    graph: str  # the "graphs" key served
    graph_path: Path
    sha256: str
    # the long-input graphs served beside it: attention path -> file (model/attention_paths.py)
    long_graphs: tuple[tuple[str, Path], ...] = ()
    # sentence-transformers Dense layers every pooled embedding passes through (metadata.json "pooling" "dense")
    dense: tuple[Dense, ...] = ()

    @property
    def config(self) -> EncoderConfig:
        return self.metadata.config

    @functools.cached_property
    def paths(self) -> tuple[str, ...]:
        """The attention paths this export serves: dense, then its long-input path if it has one."""
        return (DENSE, *(path for path, _ in self.long_graphs))

    @property
    def name(self) -> str:
        return self.metadata.name

    @property
    def version(self) -> str:
        return f"{self.metadata.format or FORMAT}@{self.metadata.created}"

    @property
    def opset(self) -> int:
        return self.metadata.opset

    @functools.cached_property
    def has_tokenizer(self) -> bool:
        return self.metadata.tokenizer is not None

    @functools.cached_property  # read per request: the metadata never changes
    def default_pooling(self) -> str:
        """none | mean | first | last; metadata.json says "cls" for [CLS] pooling (model.hf_pretrained.pooling_settings)."""
        mode = str(self.metadata.pooling.get("mode", "mean"))
        return "first" if mode == "cls" else mode

    @functools.cached_property
    def task(self) -> str:
        """What the model does (metadata.json "task" kind, serve/core/tasks/): embed, rerank, classify, sparse, multivector, m3."""
        return str(self.metadata.task.get("kind", "embed"))

    @functools.cached_property
    def row_output(self) -> str:
        """The graph output the server reads per row beside the hidden states: the head's (metadata.json
        "task" output), else the mean-pooled embedding (a multivector model's head output is per token: it is
        read as the hidden states, `hidden_output`)."""
        if self.task in PER_TOKEN_KINDS:
            return "mean_pooled"
        return str(self.metadata.task.get("output") or "mean_pooled")

    @functools.cached_property
    def hidden_output(self) -> str:
        """The graph output the server reads per token: the last hidden states, or the per-token head output of
        a multivector model (token vectors [B, T, vector_dim]) or of bge-m3 (m3_tokens [B, T, D + 1]): what its
        hidden states are to every verb."""
        return str(self.metadata.task["output"]) if self.task in PER_TOKEN_KINDS else "last_hidden_state"

    @functools.cached_property
    def hidden_width(self) -> int:
        """The width of `hidden_output`: d_model, a multivector model's vector_dim, bge-m3's d_model + 1."""
        return {"multivector": self.config.vector_dim, "m3": self.config.d_model + 1}.get(self.task, self.config.d_model)

    @functools.cached_property
    def embedding_width(self) -> int:
        """The width of a pooled embedding as clients get it: the projection's output, else d_model."""
        return self.metadata.embedding_width

    @functools.cached_property
    def default_normalize(self) -> bool:
        return bool(self.metadata.pooling.get("normalize", False))

    def file_bytes(self, graph_path: Path) -> int:
        """A served graph's bytes on disk, with its external weights: the bytes of its own tensors in each
        data file (metadata.json's "tensor_bytes": an export's graphs share one data file,
        model/onnx_files.py), or the whole file's for an export that does not record them."""
        entry = next((e for e in self.metadata.graphs.values() if e.file == graph_path.name), None)
        data = entry.data if entry is not None else ()
        return graph_path.stat().st_size + sum(int(d.get("tensor_bytes") or (graph_path.parent / d["file"]).stat().st_size)
                                               for d in data)

    def tokenizer_file(self) -> Path | None:
        """tokenizer.json after checking its sha256, or None when the export has none."""
        with _served():
            return self.metadata.tokenizer_file(self.path)


@contextmanager
def _served():
    """The format's ExportError, re-raised as the server's (a BackendError)."""
    try:
        yield
    except ExportError:
        raise
    except export_format.ExportError as error:
        raise ExportError(str(error)) from None


def load_export(path: str | Path, graph: str = "fp32", *, verify: bool = True,
                auto: tuple[str, ...] = ("optimized",), long_paths: bool = True) -> ExportDir:
    with _served():
        return _load(Path(path), graph, verify, auto, long_paths)


def _load(root: Path, graph: str, verify: bool, auto: tuple[str, ...], long_paths: bool) -> ExportDir:
    metadata = export_format.read_metadata(root)
    graphs = metadata.graphs
    if graph == "auto":  # the first of `auto` the export has, else fp32
        graph = next((name for name in auto if name in graphs), "fp32")
    if graph in graphs and graphs[graph].attention_path != DENSE:
        raise ExportError(f"{root / METADATA_FILE}: graph {graph!r} serves only some mask kinds; choose a dense "
                          f"graph ({', '.join(n for n, e in graphs.items() if e.attention_path == DENSE)}); "
                          "long-input graphs are served beside it (--long-paths)")
    verified: set[Path] = set()  # data files hashed once, however many graphs share them
    graph_path, actual = metadata.graph_file(root, graph, verify=verify, verified=verified)
    long_graphs = tuple(
        (entry.attention_path, metadata.graph_file(root, name, verify=verify, verified=verified)[0])
        for name, entry in graphs.items()
        if long_paths and entry.attention_path in PATHS and entry.attention_path != DENSE
    )
    return ExportDir(root, metadata, graph, graph_path, actual, long_graphs, metadata.dense_layers(root, verify=verify))
