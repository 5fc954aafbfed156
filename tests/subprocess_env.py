"""The environment for the `python -m serve` (and other) subprocesses the tests start."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def repo_env() -> dict[str, str]:
    """os.environ with the repository first on PYTHONPATH, keeping any entries already there (packages
    installed with `pip --target`, such as onnxruntime-gpu on a GPU machine, must stay importable).
    Servers started with it take an OS-chosen HTTP port (ENCODER_HTTP_PORT=0; the port file says which),
    so servers of one test run never contend for the default 8000."""
    return {**os.environ, "ENCODER_HTTP_PORT": os.environ.get("ENCODER_HTTP_PORT", "0"),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
