"""Builds the `Metadata` (model/export_format.py) the exporter writes: the contract, the graphs and the
versions of the tools that wrote them."""

from __future__ import annotations

import platform
from datetime import datetime, timezone

import onnx
import onnxruntime
import torch

from export.contract import ExportContract
from model.export_format import GraphEntry, Metadata, TokenizerEntry


def build_metadata(contract: ExportContract, *, graphs: dict[str, GraphEntry],
                   tokenizer: TokenizerEntry | None = None, pooling: dict | None = None,
                   task: dict | None = None, prompts: dict | None = None,
                   default_prompt_name: str | None = None) -> Metadata:
    config = contract.config
    return Metadata(
        name=config.name,
        config=config,
        opset=contract.opset,
        inputs=tuple(s.as_dict() for s in contract.inputs),
        outputs=tuple(s.as_dict() for s in contract.outputs),
        graphs=graphs,
        versions={
            "torch": torch.__version__.split("+")[0],
            "onnx": onnx.__version__,
            "onnxruntime": onnxruntime.__version__,
            "python": platform.python_version(),
        },
        created=datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        tokenizer=tokenizer,
        pooling=pooling or {"mode": "mean", "normalize": False},
        **({"task": dict(task)} if task is not None else {}),
        prompts=dict(prompts or {}),
        default_prompt_name=default_prompt_name or None,
    )
