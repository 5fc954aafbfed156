"""A cache of torch.onnx's traced graphs, for runs that export the same model many times (the test suite).

`torch.onnx.export` (dynamo) is most of an export's time: 11-12 s for a 2-layer, 32-wide encoder on a 2-core
AMD EPYC, nearly all of it torch.export's symbolic tracing, whatever the model's size. The test suite exports
the same small configs in many files, so tests/conftest.py points ENV at one directory for the run, and
export_onnx (export/exporter.py) reuses a graph traced earlier from the same inputs. Everything after the
trace (the graph variants, validation against PyTorch, metadata) runs every time.

The key is everything the trace reads: the model's weights and buffers, its config but for its name (the
graph does not hold it), the contract (attention path, opset, inputs), the source of model/ and export/, the
functions and constants of their modules as loaded at the time (so a test that patches one, as
tests/test_long_attention.py does, gets a key of its own), and the torch, onnx and onnxscript versions.
Unset (the default, and every user's export) or `off`, nothing is cached.

Entries are written under a temporary name and renamed into place, so two processes (pytest-xdist workers,
an export CLI started by a test) may share one directory; graphs with external weights (over 2 GB, or
asked for) and models over MAX_BYTES of weights are not cached.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import sys
import tempfile
import types
from importlib import metadata as package_metadata
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from model import onnx_files
from model.config import to_dict

if TYPE_CHECKING:
    import torch

ENV = "ENCODER_TRACE_CACHE"  # a directory; unset: no cache
OFF = "off"  # ENCODER_TRACE_CACHE=off make test: every export traces anew
MAX_BYTES = 256 << 20  # bigger models are not cached: hashing their weights costs seconds, and they are few
_ROOT = Path(__file__).resolve().parent.parent


@functools.cache
def _code_and_versions() -> bytes:
    digest = hashlib.sha256()
    for package in ("model", "export"):
        for source in sorted((_ROOT / package).rglob("*.py")):
            digest.update(str(source.relative_to(_ROOT)).encode())
            digest.update(source.read_bytes())
    for name in ("torch", "onnx", "onnxscript"):
        digest.update(f"{name}={package_metadata.version(name)}".encode())
    return digest.digest()


_PLAIN = (bool, int, float, str, bytes, type(None))


def _code(code: types.CodeType, digest) -> None:
    digest.update(code.co_code)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            _code(const, digest)
        elif isinstance(const, _PLAIN + (tuple, frozenset)):
            digest.update(repr(const).encode())
    digest.update(repr(code.co_names).encode())


def _ours(name: object) -> bool:
    return isinstance(name, str) and name.split(".")[0] in ("model", "export")


def _reachable(start: str) -> set[str]:
    """The modules of model/ and export/ that `start` refers to, directly or through them (the same set in
    every process, whatever else it has imported)."""
    seen, todo = set(), [start]
    while todo:
        name = todo.pop()
        if name in seen or name not in sys.modules:
            continue
        seen.add(name)
        for value in vars(sys.modules[name]).values():
            other = value.__name__ if isinstance(value, types.ModuleType) else getattr(value, "__module__", None)
            if _ours(other) and other not in seen:
                todo.append(other)
    return seen


def _live(digest) -> None:
    """The functions and plain constants of model/ and export/ as loaded now: a test that patches one
    (monkeypatch.setattr(long_graphs, "first_block", ...)) gets another key."""
    for name in sorted(_reachable("export.exporter")):
        for attribute, value in sorted(vars(sys.modules[name]).items()):
            members = vars(value).items() if isinstance(value, type) and value.__module__ == name else [("", value)]
            for member, item in members:
                item = getattr(item, "__func__", item)  # staticmethod / classmethod
                if isinstance(item, types.FunctionType):
                    digest.update(f"{name}.{attribute}.{member}".encode())
                    _code(item.__code__, digest)
                elif isinstance(item, _PLAIN):
                    digest.update(f"{name}.{attribute}.{member}={item!r}".encode())


def key(model: "torch.nn.Module", contract, external_data: bool) -> str:
    """The cache key of one trace: a hex digest of everything export_onnx's trace reads."""
    import torch

    digest = hashlib.sha256(_code_and_versions())
    _live(digest)
    config = {k: v for k, v in to_dict(contract.config).items() if k != "name"}  # the graph does not hold the name
    digest.update(json.dumps(config, sort_keys=True, default=str).encode())
    digest.update(repr((contract.path, contract.opset, [s.as_dict() for s in contract.inputs],
                        [s.name for s in contract.outputs], external_data)).encode())
    for name, tensor in model.state_dict().items():
        tensor = tensor.detach().cpu().contiguous()
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        digest.update(tensor.view(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()


def directory() -> Path | None:
    value = os.environ.get(ENV)
    return Path(value) if value and value != OFF else None


def traced(model: "torch.nn.Module", contract, path: Path, external_data: bool,
           trace: Callable[[Path], None]) -> bool:
    """Writes the graph `trace` would write to `path`, from the cache when it holds it; returns True on a hit.
    Without a cache directory, or for external weights, simply calls trace(path)."""
    where = directory()
    if where is None or external_data or sum(t.numel() * t.element_size()
                                             for t in model.state_dict().values()) > MAX_BYTES:
        trace(path)
        return False
    entry = where / f"{key(model, contract, external_data)}.onnx"
    if entry.exists():
        shutil.copyfile(entry, path)
        return True
    trace(path)
    if not onnx_files.is_external(path):  # one self-contained file
        where.mkdir(parents=True, exist_ok=True)
        handle, staging = tempfile.mkstemp(dir=where, prefix=".entry-")
        os.close(handle)
        shutil.copyfile(path, staging)
        os.replace(staging, entry)
    return False
