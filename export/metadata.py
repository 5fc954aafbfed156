"""metadata.json: the contract the server reads (format documented in docs/export-format.md)."""

from __future__ import annotations

import json
import os
import platform
import tempfile
from datetime import datetime, timezone
from pathlib import Path

import onnx
import onnxruntime
import torch

from export.contract import ExportContract
from model.config import to_dict
from model.mask_kinds import MaskKind

FORMAT = "onnx-encoder-export/1"


def build_metadata(contract: ExportContract, *, graphs: dict, tokenizer: dict | None = None,
                   pooling: dict | None = None) -> dict:
    config = contract.config
    return {
        "format": FORMAT,
        "name": config.name,
        "config": to_dict(config),
        "opset": contract.opset,
        "inputs": [s.as_dict() for s in contract.inputs],
        "outputs": [s.as_dict() for s in contract.outputs],
        "mask_kinds": {k.label: int(k) for k in MaskKind},
        "graphs": graphs,
        "versions": {
            "torch": torch.__version__.split("+")[0],
            "onnx": onnx.__version__,
            "onnxruntime": onnxruntime.__version__,
            "python": platform.python_version(),
        },
        "created": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "tokenizer": tokenizer,
        "pooling": pooling or {"mode": "mean", "normalize": False},
    }


def write_json_atomic(path: str | Path, data: dict) -> None:
    """Write to a temporary file in the same directory, then rename over `path`."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as handle:
            json.dump(data, handle, indent=2, sort_keys=False)
            handle.write("\n")
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
