"""Reads an export directory (docs/export-format.md): metadata.json, graph hashes, the config.

Refuses what it cannot serve with a message that says what to do.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from model.attention_paths import DENSE, PATHS
from model.config import ConfigError, EncoderConfig, from_dict
from model.mask_kinds import MaskKind
from serve.errors import BackendError

FORMAT = "onnx-encoder-export/1"


class ExportError(BackendError):
    """The export directory is missing, malformed, or does not match its metadata."""


@dataclass(frozen=True)
class ExportDir:
    path: Path
    metadata: dict[str, Any]
    config: EncoderConfig
    graph: str  # the "graphs" key served
    graph_path: Path
    sha256: str
    # the long-input graphs served beside it: attention path -> file (model/attention_paths.py)
    long_graphs: tuple[tuple[str, Path], ...] = ()

    @property
    def paths(self) -> tuple[str, ...]:
        """The attention paths this export serves: dense, then its long-input path if it has one."""
        return (DENSE, *(path for path, _ in self.long_graphs))

    @property
    def name(self) -> str:
        return str(self.metadata.get("name") or self.config.name)

    @property
    def version(self) -> str:
        return f"{self.metadata.get('format', FORMAT)}@{self.metadata.get('created', 'unknown')}"

    @property
    def opset(self) -> int:
        return int(self.metadata.get("opset", 0))

    @property
    def has_tokenizer(self) -> bool:
        return bool(self.metadata.get("tokenizer"))

    @property
    def default_pooling(self) -> str:
        """none | mean | first; metadata.json says "cls" for [CLS] pooling (model.checkpoint.pooling_settings)."""
        mode = str((self.metadata.get("pooling") or {}).get("mode", "mean"))
        return "first" if mode == "cls" else mode

    @property
    def default_normalize(self) -> bool:
        return bool((self.metadata.get("pooling") or {}).get("normalize", False))


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def load_export(path: str | Path, graph: str = "fp32", *, verify: bool = True,
                auto: tuple[str, ...] = ("optimized",), long_paths: bool = True) -> ExportDir:
    root = Path(path)
    meta_path = root / "metadata.json"
    if not meta_path.is_file():
        raise ExportError(f"{meta_path} not found: run `python -m export` first, or pass --export-dir")
    try:
        metadata = json.loads(meta_path.read_text())
    except json.JSONDecodeError as error:
        raise ExportError(f"{meta_path}: not valid JSON ({error})") from None
    if metadata.get("format") != FORMAT:
        raise ExportError(f"{meta_path}: format {metadata.get('format')!r}, this server reads {FORMAT!r}")
    try:
        config = from_dict(metadata["config"])
    except (KeyError, ConfigError, TypeError, ValueError) as error:
        raise ExportError(f"{meta_path}: bad 'config': {error}") from None
    declared = metadata.get("mask_kinds")
    ours = {kind.label: int(kind) for kind in MaskKind}
    if declared is not None and declared != ours:
        raise ExportError(f"{meta_path}: mask_kinds {declared} differ from this server's {ours}")
    graphs = metadata.get("graphs") or {}
    if graph == "auto":  # the first of `auto` the export has, else fp32
        graph = next((name for name in auto if name in graphs), "fp32")
    if graph not in graphs:
        raise ExportError(f"{meta_path}: no graph {graph!r}; the export has {sorted(graphs) or 'none'}")
    if graphs[graph].get("attention_path", DENSE) != DENSE:
        raise ExportError(f"{meta_path}: graph {graph!r} serves only some mask kinds; choose a dense graph "
                          f"({', '.join(n for n, e in graphs.items() if e.get('attention_path', DENSE) == DENSE)}); "
                          "long-input graphs are served beside it (--long-paths)")
    graph_path, actual = _checked_graph(root, meta_path, graph, graphs[graph], verify)
    long_graphs = tuple(
        (entry["attention_path"], _checked_graph(root, meta_path, name, entry, verify)[0])
        for name, entry in graphs.items()
        if long_paths and entry.get("attention_path", DENSE) in PATHS and entry["attention_path"] != DENSE
    )
    return ExportDir(root, metadata, config, graph, graph_path, actual, long_graphs)


def _checked_graph(root: Path, meta_path: Path, graph: str, entry: dict, verify: bool) -> tuple[Path, str]:
    """The graph file of a metadata.json "graphs" entry and its sha256, checked against the entry."""
    graph_path = root / entry["file"]
    if not graph_path.is_file():
        raise ExportError(f"{graph_path} not found (listed in {meta_path} as graph {graph!r})")
    validation = entry.get("validation") or {}
    if validation.get("passed") is False:
        raise ExportError(f"{meta_path}: graph {graph!r} failed validation at export; refusing to serve it")
    expected = str(entry.get("sha256", ""))
    actual = file_sha256(graph_path) if verify or not expected else expected
    if verify and actual != expected:
        raise ExportError(
            f"{graph_path}: sha256 {actual} does not match metadata.json ({expected or 'missing'}); "
            "the graph changed after export — re-run `python -m export`"
        )
    return graph_path, actual
