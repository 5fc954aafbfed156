"""sentence-transformers Dense modules after the Pooling (EmbeddingGemma's 768 -> 3072 -> 768, LaBSE's tanh
Dense): each module's config.json and weights read strictly into model/projection.py layers, which the exporter
writes beside the graph (model/export_format.py write_dense) and the server applies after pooling. What we do
not compute is refused naming the module's directory.

  read_dense_modules(directory, modules, hidden_size)   the layers of modules.json's Dense modules, in order
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from model.checkpoint import CheckpointError, read_tensor_file
from model.projection import Dense, ProjectionError, check_chain

ST_DENSE = "sentence_transformers.models.Dense"
# config.json's activation_function -> ours (model/projection.py ACTIVATIONS); sentence-transformers' default,
# when config.json names none, is Tanh.
ST_ACTIVATIONS: Mapping[str, str] = {"torch.nn.modules.linear.Identity": "identity",
                                     "torch.nn.modules.activation.Tanh": "tanh"}
ST_DEFAULT_ACTIVATION = "torch.nn.modules.activation.Tanh"
# config.json settings we reproduce only at these values (sentence-transformers' defaults): the pooled embedding in
# and out, no residual connection
ST_DENSE_FIXED: Mapping[str, Any] = {"module_input_name": "sentence_embedding",
                                     "module_output_name": "sentence_embedding", "use_residual": False}
DENSE_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


def read_dense_modules(directory: Path, modules: Sequence[tuple[str | None, dict]],
                       hidden_size: int) -> tuple[Dense, ...]:
    """The layers of the Dense modules among `modules` (modules.json's (kind, entry) pairs, in order); refuses an
    in_features that is not the width before it (the hidden size, then the previous out_features)."""
    paths = [directory / entry.get("path", "") for kind, entry in modules if kind == ST_DENSE]
    layers = tuple(read_dense(path) for path in paths)
    try:
        check_chain(hidden_size, [(str(path), layer.in_features, layer.out_features)
                                  for path, layer in zip(paths, layers)])
    except ProjectionError as error:
        raise CheckpointError(str(error)) from None
    return layers


def read_dense(path: Path) -> Dense:
    """One Dense module's layer from its directory: config.json's settings, then linear.weight [out, in] and, with
    bias, linear.bias [out] (every tensor used, every shape checked)."""
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path}: no config.json (a Dense module's in_features, out_features, bias, activation)")
    settings = json.loads((path / "config.json").read_text())
    fixed = [f"{key}={settings[key]!r}" for key, value in ST_DENSE_FIXED.items() if settings.get(key, value) != value]
    if fixed:
        raise CheckpointError(f"{path}: Dense settings {', '.join(fixed)} are not computed; only "
                              + ", ".join(f"{key}={value!r}" for key, value in ST_DENSE_FIXED.items()))
    activation = settings.get("activation_function", ST_DEFAULT_ACTIVATION)
    if activation not in ST_ACTIVATIONS:
        raise CheckpointError(f"{path}: activation_function {activation!r} is not supported; "
                              f"supported: {', '.join(ST_ACTIVATIONS)}")
    in_features, out_features = int(settings["in_features"]), int(settings["out_features"])
    bias = settings.get("bias", True)
    tensors = _dense_tensors(path)
    expected = {"linear.weight": (out_features, in_features), **({"linear.bias": (out_features,)} if bias else {})}
    wrong = [f"{name} {list(tensors[name].shape) if name in tensors else 'missing'} (expected {list(shape)})"
             for name, shape in expected.items() if name not in tensors or tuple(tensors[name].shape) != shape]
    wrong += [f"{name} (not used)" for name in tensors if name not in expected]
    if wrong:
        raise CheckpointError(f"{path}: Dense weights do not fit config.json: {'; '.join(wrong)}")
    arrays = {name: tensors[name].detach().float().numpy() for name in expected}  # float32, as the server computes
    return Dense(np.ascontiguousarray(arrays["linear.weight"]), arrays.get("linear.bias"), ST_ACTIVATIONS[activation])


def _dense_tensors(path: Path) -> dict:
    """The module's tensors from model.safetensors, else pytorch_model.bin."""
    for name in DENSE_WEIGHT_FILES:
        if (path / name).is_file():
            return read_tensor_file(path / name)[0]
    raise CheckpointError(f"{path} has none of {', '.join(DENSE_WEIGHT_FILES)}")
