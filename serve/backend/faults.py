"""Failure injection for tests: `--fault-inject` / ENCODER_FAULT_INJECT. Off (empty) by default.

The encoder graph has no input that passes validation and still makes ONNX Runtime fail (ids are
range-checked, shapes and masks are checked, and every mask row keeps at least its own position),
so to prove what happens when one inference call fails we inject the failure at the backend
boundary, where a real ONNX Runtime error surfaces:

    poison_token=N    a batch containing token id N (in a real, unpadded position) fails in
                      `encode` with BackendError, as a failing `session.run` would.

The batcher then re-runs the batch's requests one by one, so only the request holding the poison
token gets INTERNAL; its batch-mates succeed, and the server keeps serving. The server logs
`event=fault_injection_enabled` at start so this can never be switched on silently.
"""

from __future__ import annotations

import logging
from typing import Mapping

import numpy as np

from model.attention_paths import DENSE

from serve import logs
from serve.backend.session import Backend
from serve.errors import BackendError

log = logging.getLogger("serve.backend.faults")


def parse(spec: str) -> dict[str, int]:
    """'poison_token=99' -> {'poison_token': 99}; BackendError (a start-up failure) for anything else."""
    faults: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        key, sep, value = part.partition("=")
        if key != "poison_token" or not sep or not value.strip().lstrip("-").isdigit():
            raise BackendError(f"fault_inject: unknown fault {part!r}; known: poison_token=N")
        faults[key] = int(value)
    return faults


class FaultInjectingBackend:
    """Wraps a backend; `encode` fails for batches holding the poison token."""

    def __init__(self, inner: Backend, spec: str) -> None:
        self.inner = inner
        self.spec = spec
        self.poison_token = parse(spec).get("poison_token")
        self.info = inner.info
        logs.event(log, "fault_injection_enabled", logging.WARNING, spec=spec)

    def health(self) -> None:
        self.inner.health()

    def warm_up(self, *args, **kwargs) -> float:
        return self.inner.warm_up(*args, **kwargs) if hasattr(self.inner, "warm_up") else 0.0

    def encode(self, batch: Mapping[str, np.ndarray], path: str = DENSE, **options) -> tuple[np.ndarray | None, np.ndarray]:
        ids = batch.get("input_ids")
        if self.poison_token is not None and ids is not None:
            real = ids[np.asarray(batch["attention_mask"], bool)]
            if np.any(real == self.poison_token):
                raise BackendError(
                    f"inference failed: injected fault (fault_inject={self.spec}): the batch held "
                    f"token id {self.poison_token}"
                )
        return self.inner.encode(batch, path, **options)
