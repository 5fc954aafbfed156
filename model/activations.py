"""The activation functions by the names config.activation and config.head_activation use (model/config.py
ACTIVATIONS, HEAD_ACTIVATIONS): one table for the encoder's FFN and the task heads.

"gelu" is the exact (erf) GELU, as BERT's; "gelu_tanh" its tanh approximation (Gemma's gelu_pytorch_tanh);
"silu" x·sigmoid(x) (SwiGLU)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

ACTIVATION_FUNCTIONS = {"relu": F.relu, "gelu": F.gelu, "silu": F.silu, "tanh": torch.tanh,
                        "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}
