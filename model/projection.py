"""The Dense layers sentence-transformers puts after the pooling (Pooling -> Dense -> ... -> Normalize):
EmbeddingGemma's 768 -> 3072 -> 768 without bias, LaBSE's 768 -> 768 with tanh. The graph ends at the
pooled mean; these layers are numpy arrays beside it (metadata.json "pooling" "dense", written and read by
model/export_format.py) that the server applies to every pooled embedding before the L2 normalisation
(serve/core/pooling.py `project`). No torch: the server imports it.

  ACTIVATIONS   our activation name -> its numpy function: the activations a layer may have
  Dense         one layer: weight float32 [out, in], bias float32 [out] or None, activation
  check_chain   each layer takes the width before it: the hidden size, then the previous layer's out_features
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import numpy as np


def _identity(x: np.ndarray) -> np.ndarray:
    return x


ACTIVATIONS: Mapping[str, Callable[[np.ndarray], np.ndarray]] = {"identity": _identity, "tanh": np.tanh}


class ProjectionError(ValueError):
    """Dense layers that do not fit together or that this code cannot compute (the caller names the source)."""


@dataclass(frozen=True, eq=False)
class Dense:
    """One layer: activation(x @ weight.T + bias), float32."""

    weight: np.ndarray  # (out, in)
    bias: np.ndarray | None  # (out,) or None
    activation: str  # a key of ACTIVATIONS

    @property
    def in_features(self) -> int:
        return int(self.weight.shape[1])

    @property
    def out_features(self) -> int:
        return int(self.weight.shape[0])


def check_activation(name: str, where: str) -> None:
    """Refuses an activation outside ACTIVATIONS, naming `where` it was found."""
    if name not in ACTIVATIONS:
        raise ProjectionError(f"{where}: activation {name!r} is not one of {', '.join(ACTIVATIONS)}")


def check_chain(hidden_size: int, layers: Sequence[tuple[str, int, int]]) -> int:
    """The width after `layers` ((name, in_features, out_features) each, in order); refuses a layer whose
    in_features is not the width before it (the hidden size, then the previous layer's out_features)."""
    width, source = hidden_size, "the hidden size"
    for name, in_features, out_features in layers:
        if in_features != width:
            raise ProjectionError(f"{name}: in_features {in_features} does not match {width}, {source}")
        width, source = out_features, f"the out_features of {name}"
    return width
