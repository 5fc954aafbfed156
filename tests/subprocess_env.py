"""The environment for the `python -m serve` (and other) subprocesses the tests start."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def repo_env() -> dict[str, str]:
    """os.environ with the repository first on PYTHONPATH, keeping any entries already there (packages
    installed with `pip --target`, such as onnxruntime-gpu on a GPU machine, must stay importable)."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
