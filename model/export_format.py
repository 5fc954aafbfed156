"""The export directory format (docs/export-format.md): its version, its layout, metadata.json's schema,
and the one reader. The exporter writes through this module; the server, the bench and the Triton
writer read through it. No torch: the server imports it.

    <export>/metadata.json      `Metadata`, written last (the exporter renames the directory into place)
    <export>/model*.onnx        one file per `GraphEntry` (the names: export/graphs.py)
    <export>/tokenizer.json     `TokenizerEntry`, only for checkpoints with a tokenizer
    <export>/dense_<i>.<weight|bias>.npy   `DenseEntry` (metadata.json "pooling" "dense"), only for models whose
                                 sentence-transformers Dense modules project the pooled embedding (model/projection.py)

`read_metadata` parses and checks metadata.json; `Metadata.graph_file` checks a graph's sha256,
`Metadata.dense_layers` the projection's; `write_dense` writes the projection's files.
Every refusal is an `ExportError` whose message says what to do.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from model.attention_paths import DENSE
from model.config import ConfigError, EncoderConfig, from_dict, to_dict
from model.mask_kinds import MaskKind
from model.projection import Dense, ProjectionError, check_activation, check_chain
from model.tasks import EMBED, TaskError, check_task

FORMAT = "onnx-encoder-export/1"
METADATA_FILE = "metadata.json"
TOKENIZER_FILE = "tokenizer.json"
DENSE_FILE = "dense_{index}.{part}.npy"  # a projection layer's array (part: weight | bias), plain .npy, no pickle


class ExportError(Exception):
    """An export that cannot be written or read as this format says (missing, malformed, changed
    after export, or a bad request to the exporter)."""


def repository_folders(root: Path) -> dict[str, Path]:
    """The model folders of a model repository by name: each subfolder with a metadata.json, sorted (Triton's
    layout rule: the folder is the model). Hidden folders are skipped: the exporter stages a new export in
    `.NAME.staging-*` and keeps the one it replaces in `.NAME.old-*` until the swap (export/exporter.py), and
    neither is a model."""
    return {p.name: p for p in sorted(root.iterdir())
            if not p.name.startswith(".") and p.is_dir() and (p / METADATA_FILE).is_file()}


def sha256_file(path: str | Path) -> str:
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def checked_sha256(path: Path, expected: str, what: str) -> str:
    """`path`'s sha256, which must equal `expected` (metadata.json's); `what` names the file's role."""
    actual = sha256_file(path)
    if actual != expected:
        raise ExportError(
            f"{path}: sha256 {actual} does not match {METADATA_FILE} ({expected or 'missing'}); "
            f"the {what} changed after export — re-run `python -m export`"
        )
    return actual


def combined_sha256(digest: str, parts: Sequence[str]) -> str:
    """The sha256 of `digest` and `parts` (sha256s), space-separated: one identity for a file and the files
    its model needs beside it (external weights, the projection); `digest` itself without any."""
    return hashlib.sha256(" ".join([digest, *parts]).encode()).hexdigest() if parts else digest


def mask_kinds() -> dict[str, int]:
    """metadata.json's "mask_kinds": label -> the code the graph's `mask_kind` input takes."""
    return {kind.label: int(kind) for kind in MaskKind}


@dataclass(frozen=True)
class GraphEntry:
    """One metadata.json "graphs" entry: a graph file and how it was checked at export."""

    file: str
    sha256: str = ""
    bytes: int = 0
    ir_version: int = 0
    description: str = ""
    attention_path: str = DENSE  # model/attention_paths.py
    inputs: tuple[dict, ...] = ()  # this graph's inputs: {"name", "dtype", "dims"}
    tolerance: dict = field(default_factory=dict)  # {"metric", "limit"}
    validation: dict = field(default_factory=dict)  # export/validate.py ValidationReport.as_dict()
    # the graph's external data files (model/onnx_files.py): {"file", "sha256", "bytes", "tensor_bytes" (this
    # graph's tensors in it; absent in exports before the shared data file)} each; () inline
    data: tuple[dict, ...] = ()

    @property
    def passed(self) -> bool:
        """False only when the export recorded a failed validation."""
        return self.validation.get("passed") is not False

    @property
    def proof(self) -> dict[str, Any]:
        """The parity proof users see (GetModelInfo, TEI /info, v2 REST metadata, the start-up line): the metric
        against PyTorch, its worst value over the cases, the limit, the number of cases and the worst one."""
        v = self.validation
        return {"metric": str(v.get("metric", "")), "worst": float(v.get("worst", 0.0)),
                "limit": float(v.get("limit", 0.0)), "cases": int(v.get("cases", 0)),
                "worst_case": str(v.get("worst_case", ""))} if v else {}

    def proof_line(self) -> str:
        """The proof in a few words: `max_abs 8.3e-06 <= 0.0001, 38 cases`."""
        p = self.proof
        if not p:
            return "not validated"
        if p["metric"] == "max_abs":
            return f"max_abs {p['worst']:.2g} <= {p['limit']:g}, {p['cases']} cases"
        return f"{p['metric']} {p['worst']:.6f} >= {p['limit']:g}, {p['cases']} cases"  # cosine: 1 - tiny

    def as_dict(self) -> dict[str, Any]:
        return {"file": self.file, "sha256": self.sha256, "bytes": self.bytes, "ir_version": self.ir_version,
                "description": self.description, "attention_path": self.attention_path,
                "inputs": [dict(spec) for spec in self.inputs], "tolerance": dict(self.tolerance),
                "validation": dict(self.validation), **({"data": [dict(d) for d in self.data]} if self.data else {})}

    @classmethod
    def from_dict(cls, data: dict) -> "GraphEntry":
        return cls(file=str(data["file"]), sha256=str(data.get("sha256", "")), bytes=int(data.get("bytes", 0)),
                   ir_version=int(data.get("ir_version", 0)), description=str(data.get("description", "")),
                   attention_path=str(data.get("attention_path", DENSE)),
                   inputs=tuple(data.get("inputs") or ()), tolerance=dict(data.get("tolerance") or {}),
                   validation=dict(data.get("validation") or {}),
                   data=tuple({"file": str(d["file"]), "sha256": str(d["sha256"]), "bytes": int(d.get("bytes", 0)),
                               **({"tensor_bytes": int(d["tensor_bytes"])} if "tensor_bytes" in d else {})}
                              for d in data.get("data") or ()))


@dataclass(frozen=True)
class TokenizerEntry:
    """metadata.json's "tokenizer": the file, its sha256, and the length texts are cut or refused at."""

    file: str
    sha256: str
    max_length: int

    def as_dict(self) -> dict[str, Any]:
        return {"file": self.file, "sha256": self.sha256, "max_length": self.max_length}


def _file_entry(path: Path) -> dict[str, Any]:
    """{"file", "sha256", "bytes"} of a file the export lists (a graph's data, a projection array)."""
    return {"file": path.name, "sha256": sha256_file(path), "bytes": path.stat().st_size}


@dataclass(frozen=True)
class DenseEntry:
    """One metadata.json "pooling" "dense" entry: a layer applied to the pooled embedding before the L2
    normalisation (model/projection.py), its arrays in .npy files listed as {"file", "sha256", "bytes"}."""

    in_features: int
    out_features: int
    activation: str  # model/projection.py ACTIVATIONS
    weight: dict  # float32 [out, in]
    bias: dict | None = None  # float32 [out], or None: a layer without bias

    def as_dict(self) -> dict[str, Any]:
        return {"in": self.in_features, "out": self.out_features, "activation": self.activation,
                "weight": dict(self.weight), "bias": dict(self.bias) if self.bias else None}

    @classmethod
    def from_dict(cls, data: dict, where: str) -> "DenseEntry":
        """Parses one entry; KeyError / TypeError / ValueError on a malformed one (ProjectionError names `where`)."""
        check_activation(str(data["activation"]), where)
        files = [None if data.get(part) is None else
                 {"file": str(data[part]["file"]), "sha256": str(data[part]["sha256"]),
                  "bytes": int(data[part].get("bytes", 0))} for part in ("weight", "bias")]
        if files[0] is None:
            raise ProjectionError(f"{where}: no weight file")
        return cls(int(data["in"]), int(data["out"]), str(data["activation"]), *files)


def dense_entries(pooling: dict) -> tuple[DenseEntry, ...]:
    """metadata.json "pooling" "dense", parsed; () for a model without a projection."""
    return tuple(DenseEntry.from_dict(entry, f"pooling.dense[{i}]")
                 for i, entry in enumerate(pooling.get("dense") or ()))


def write_dense(layers: Sequence[Dense], directory: str | Path) -> list[dict[str, Any]]:
    """Writes each layer's arrays as float32 .npy files (DENSE_FILE) into `directory`; their metadata.json
    "pooling" "dense" entries, in order."""
    entries = []
    for index, layer in enumerate(layers):
        files = {}
        for part, array in (("weight", layer.weight), ("bias", layer.bias)):
            if array is not None:
                path = Path(directory) / DENSE_FILE.format(index=index, part=part)
                np.save(path, np.ascontiguousarray(array, np.float32), allow_pickle=False)
                files[part] = _file_entry(path)
        entries.append(DenseEntry(layer.in_features, layer.out_features, layer.activation, files["weight"],
                                  files.get("bias")).as_dict())
    return entries


def _dense_array(root: Path, file: dict, shape: tuple[int, ...], what: str, verify: bool) -> np.ndarray:
    """One projection array: present, its sha256 checked when `verify`, float32 of `shape`."""
    path = root / file["file"]
    if not path.is_file():
        raise ExportError(f"{path} not found (listed in {METADATA_FILE} as {what})")
    if verify:
        checked_sha256(path, file["sha256"], what)
    try:
        array = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as error:
        raise ExportError(f"{path}: not a .npy array ({error}); re-run `python -m export`") from None
    if array.dtype != np.float32 or tuple(array.shape) != shape:
        raise ExportError(f"{path}: {array.dtype} {list(array.shape)}, {METADATA_FILE} says float32 {list(shape)} "
                          f"for {what}; re-run `python -m export`")
    return array


@dataclass(frozen=True)
class Metadata:
    """metadata.json, field by field, in the order it is written."""

    name: str
    config: EncoderConfig
    opset: int
    inputs: tuple[dict, ...]  # {"name", "dtype", "dims"}; a str dim is symbolic
    outputs: tuple[dict, ...]
    graphs: dict[str, GraphEntry]
    versions: dict[str, str] = field(default_factory=dict)
    created: str = "unknown"
    tokenizer: TokenizerEntry | None = None
    pooling: dict = field(default_factory=lambda: {"mode": "mean", "normalize": False})
    mask_kinds: dict[str, int] = field(default_factory=mask_kinds)
    format: str = FORMAT
    # What the model is for (model/tasks.py): {"kind": "embed"} without a head, as exports before heads read.
    task: dict = field(default_factory=lambda: dict(EMBED))
    # sentence-transformers prompts (config_sentence_transformers.json): name -> the text put before a text
    # (a request's prompt_name), and the one applied when a request names none ("" / None: no default)
    prompts: dict = field(default_factory=dict)
    default_prompt_name: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "format": self.format,
            "name": self.name,
            "config": to_dict(self.config),
            "opset": self.opset,
            "inputs": [dict(spec) for spec in self.inputs],
            "outputs": [dict(spec) for spec in self.outputs],
            "mask_kinds": dict(self.mask_kinds),
            "graphs": {name: entry.as_dict() for name, entry in self.graphs.items()},
            "versions": dict(self.versions),
            "created": self.created,
            "tokenizer": self.tokenizer.as_dict() if self.tokenizer else None,
            "pooling": dict(self.pooling),
            "task": dict(self.task),
            "prompts": dict(self.prompts),
            "default_prompt_name": self.default_prompt_name,
        }

    def graph_file(self, root: str | Path, graph: str, *, verify: bool = True,
                   verified: set[Path] | None = None) -> tuple[Path, str]:
        """The file of graph `graph` under `root` and its sha256: recomputed and checked against the
        entry when `verify`, else the recorded one; for a graph with external data, the sha256 of its
        file's and its data files' sha256s (space-separated), so the identity changes with the weights.
        Refuses a missing file or a failed validation. `verified`: data files already checked by the caller
        (the graphs of one export share theirs: onnx_files.share_data), which it adds to."""
        meta_path = Path(root) / METADATA_FILE
        if graph not in self.graphs:
            raise ExportError(f"{meta_path}: no graph {graph!r}; the export has {sorted(self.graphs) or 'none'}")
        entry = self.graphs[graph]
        path = Path(root) / entry.file
        if not path.is_file():
            raise ExportError(f"{path} not found (listed in {meta_path} as graph {graph!r})")
        if not entry.passed:
            raise ExportError(f"{meta_path}: graph {graph!r} failed validation at export; refusing to serve it")
        for data in entry.data:  # external weights (model/onnx_files.py): present, and checked when `verify`
            data_path = Path(root) / data["file"]
            if not data_path.is_file():
                raise ExportError(f"{data_path} not found (the external data of graph {graph!r}, listed in {meta_path})")
            if verify and data_path not in (verified if verified is not None else ()):
                checked_sha256(data_path, data["sha256"], f"graph {graph!r} external data")
                if verified is not None:
                    verified.add(data_path)
        digest = (entry.sha256 or sha256_file(path)) if not verify else checked_sha256(path, entry.sha256, "graph")
        # the model's identity covers its weights (the graph file alone names only their places) and the
        # projection its embeddings pass through
        parts = [d["sha256"] for d in entry.data] + [f["sha256"] for e in self.dense for f in (e.weight, e.bias) if f]
        return path, combined_sha256(digest, parts)

    @cached_property
    def dense(self) -> tuple[DenseEntry, ...]:
        """The projection after pooling ("pooling" "dense"); () without one."""
        return dense_entries(self.pooling)

    @property
    def embedding_width(self) -> int:
        """The width of a pooled embedding as a client gets it: the projection's last out_features, else d_model."""
        return self.dense[-1].out_features if self.dense else self.config.d_model

    def dense_layers(self, root: str | Path, *, verify: bool = True) -> tuple[Dense, ...]:
        """The projection's layers read from their .npy files under `root` (sha256s checked when `verify`,
        shapes always); () without one."""
        layers = []
        for i, entry in enumerate(self.dense):
            what = f"pooling.dense[{i}]"
            weight = _dense_array(Path(root), entry.weight, (entry.out_features, entry.in_features),
                                  f"{what}.weight", verify)
            bias = None if entry.bias is None else \
                _dense_array(Path(root), entry.bias, (entry.out_features,), f"{what}.bias", verify)
            layers.append(Dense(weight, bias, entry.activation))
        return tuple(layers)

    def tokenizer_file(self, root: str | Path) -> Path | None:
        """tokenizer.json under `root` after checking its sha256; None when the export has none."""
        if self.tokenizer is None:
            return None
        path = Path(root) / self.tokenizer.file
        if not path.is_file():
            raise ExportError(f"{path} not found (listed in {METADATA_FILE} as the tokenizer)")
        checked_sha256(path, self.tokenizer.sha256, "tokenizer")
        return path


def metadata_from_dict(data: dict, where: str | Path = METADATA_FILE) -> Metadata:
    """Checks and parses metadata.json's content; `where` names it in errors."""
    if not isinstance(data, dict):
        raise ExportError(f"{where}: not a JSON object")
    if data.get("format") != FORMAT:
        raise ExportError(f"{where}: format {data.get('format')!r}, this code reads {FORMAT!r}")
    try:
        config = from_dict(data["config"])
    except (KeyError, ConfigError, TypeError, ValueError) as error:
        raise ExportError(f"{where}: bad 'config': {error}") from None
    declared = data.get("mask_kinds")
    if declared is not None and declared != mask_kinds():
        raise ExportError(f"{where}: mask_kinds {declared} differ from this code's {mask_kinds()}")
    try:
        graphs = {str(name): GraphEntry.from_dict(entry) for name, entry in (data.get("graphs") or {}).items()}
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise ExportError(f"{where}: bad 'graphs' entry (needs file, sha256): {error!r}") from None
    try:
        task = check_task(data.get("task") or EMBED, config)
    except TaskError as error:
        raise ExportError(f"{where}: bad 'task': {error}") from None
    pooling = dict(data.get("pooling") or {"mode": "mean", "normalize": False})
    try:
        dense = dense_entries(pooling)
        check_chain(config.d_model, [(f"pooling.dense[{i}]", e.in_features, e.out_features)
                                     for i, e in enumerate(dense)])
    except (KeyError, TypeError, ValueError, AttributeError) as error:  # ProjectionError is a ValueError
        raise ExportError(f"{where}: bad 'pooling' 'dense' (needs in, out, activation, weight, bias): "
                          f"{error}") from None
    prompts, default_prompt = _prompts(data.get("prompts"), where), data.get("default_prompt_name") or None
    if default_prompt is not None and default_prompt not in prompts:
        raise ExportError(f"{where}: default_prompt_name {default_prompt!r} is not one of its prompts {sorted(prompts)}")
    tokenizer = data.get("tokenizer")
    if tokenizer:
        try:
            tokenizer = TokenizerEntry(str(tokenizer["file"]), str(tokenizer["sha256"]), int(tokenizer["max_length"]))
        except (KeyError, TypeError, ValueError) as error:
            raise ExportError(f"{where}: bad 'tokenizer' entry {tokenizer!r} "
                              f"(needs file, sha256, max_length): {error}") from None
    return Metadata(
        name=str(data.get("name") or config.name), config=config, opset=int(data.get("opset", 0)),
        inputs=tuple(data.get("inputs") or ()), outputs=tuple(data.get("outputs") or ()), graphs=graphs,
        versions=dict(data.get("versions") or {}), created=str(data.get("created", "unknown")),
        tokenizer=tokenizer or None, pooling=pooling,
        mask_kinds=dict(declared) if declared is not None else mask_kinds(), task=task,
        prompts=prompts, default_prompt_name=default_prompt,
    )


def _prompts(value, where) -> dict:
    """metadata.json's "prompts": {name: text}, both strings."""
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise ExportError(f"{where}: bad 'prompts' (expected {{name: text}} of strings): {value!r}")
    return dict(value)


def read_metadata(root: str | Path) -> Metadata:
    """metadata.json of the export directory `root`, parsed and checked (graph hashes: `graph_file`)."""
    meta_path = Path(root) / METADATA_FILE
    if not meta_path.is_file():
        raise ExportError(f"{meta_path} not found: run `python -m export` (with docker-compose: "
                          "`docker-compose --profile export run --rm export`) first, or pass --export-dir")
    try:
        data = json.loads(meta_path.read_text())
    except json.JSONDecodeError as error:
        raise ExportError(f"{meta_path}: not valid JSON ({error})") from None
    return metadata_from_dict(data, meta_path)


def write_metadata(root: str | Path, metadata: Metadata) -> Path:
    """Writes `root`/metadata.json atomically (a temporary file in `root`, then a rename), with the mode
    a plain open() gives (0644 under umask 022), not mkstemp's 0600: a server running as another user
    (the non-root container user, on a bind-mounted host export) must read it."""
    path = Path(root) / METADATA_FILE
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask applies, as for open()
    try:
        with os.fdopen(fd, "w") as handle:
            json.dump(metadata.as_dict(), handle, indent=2, sort_keys=False)
            handle.write("\n")
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path
