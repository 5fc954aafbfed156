"""One Docker engine for the opt-in and smoke container tests (tests/test_docker_smoke.py,
tests/test_deploy_*.py): the `/usr/bin/docker` client, docker-compose, and a fixture that starts an
engine with `../shared/tools/local-docker.sh` where none runs (as root; CI), or skips with the reason.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCKER = "/usr/bin/docker"  # another `docker` on PATH may be a bare client
LOCAL_DOCKER = REPO.parent / "shared" / "tools" / "local-docker.sh"


def run(cmd: list[str], *, env: dict | None = None, timeout: float = 900, check: bool = True,
        capture: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(cmd, cwd=REPO, env={**os.environ, **(env or {})}, timeout=timeout,
                            capture_output=capture, text=True)
    if check and result.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {result.returncode}:\n{result.stdout[-4000:]}\n"
                             f"{result.stderr[-4000:]}")
    return result


def engine_up() -> bool:
    return Path(DOCKER).exists() and subprocess.run([DOCKER, "info"], capture_output=True).returncode == 0


def compose_bin() -> str | None:
    return shutil.which("docker-compose")


def ensure_engine() -> str:
    """A running engine + docker-compose + the python:3.11-slim base image; returns docker-compose's path."""
    if not engine_up() or compose_bin() is None or \
            subprocess.run([DOCKER, "image", "inspect", "python:3.11-slim"], capture_output=True).returncode:
        if not LOCAL_DOCKER.exists():
            pytest.skip(f"no Docker engine running and no {LOCAL_DOCKER} to start one")
        if os.geteuid() != 0:
            pytest.skip("no Docker engine running, and starting one (local-docker.sh) needs root")
        started = time.monotonic()
        result = subprocess.run(["bash", str(LOCAL_DOCKER)], capture_output=True, text=True, timeout=1200)
        if result.returncode != 0 or not engine_up():
            pytest.skip(f"could not start a Docker engine with {LOCAL_DOCKER}: {result.stderr[-2000:]}")
        print(f"local-docker.sh: engine + base image ready in {time.monotonic() - started:.0f} s")
    return compose_bin()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def image_size(tag: str) -> str:
    size = int(run([DOCKER, "image", "inspect", "-f", "{{.Size}}", tag]).stdout.strip())
    return f"{size / 1e6:.0f} MB"
