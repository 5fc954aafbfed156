"""docs/deployment.md as a new user runs it (opt-in: SMOKE_DOCS=1; ~10 min, most of it the two exports).

Every fenced code block of the page runs, in page order, as written, with bash (`set -euo pipefail`), in
a fresh `git clone` of this repository's HEAD, the clone's folder name making the compose project
unique. A block may carry, on the line above it, an HTML comment for this test:

    <!-- doc-test: skip: <reason> -->        not run here (a GPU host, a cluster); the reason is printed
    <!-- doc-test: sub <from> <to> -->       run with <from> replaced by <to> (a placeholder path)

Fixed ports as the page writes them (50051, 8080, 8081, 8404, 9464 on 127.0.0.1) must be free, else the test
skips. The clone's Python is this checkout's .venv (first on PATH); its protobuf code is generated as
`make proto` does. Whatever a block leaves up, `down -v` removes at the end, always.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import time
import uuid

import pytest

from tests.docker_env import REPO, ensure_engine, run

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(3600),
    pytest.mark.skipif(os.environ.get("SMOKE_DOCS") != "1",
                       reason="set SMOKE_DOCS=1 to run docs/deployment.md's commands (export image, exports, "
                              "CPU server, replicas behind the LB; ~10 min, fixed ports 50051/8080/8081/8404/9464)"),
]

DOC = "docs/deployment.md"
PORTS = (50051, 8080, 8081, 8404, 9464)
FENCE = re.compile(r"^(?P<indent> *)```[a-z]*\n(?P<body>.*?)^(?P=indent)```\s*$", re.M | re.S)
MARK = re.compile(r"<!-- doc-test: (?P<verb>skip|sub)[: ](?P<arg>.*?) -->\s*$")


def doc_blocks(text: str) -> list[tuple[str, str | None, tuple[str, str] | None]]:
    """(commands, skip reason, substitution) for each fenced block, in page order."""
    blocks = []
    for match in FENCE.finditer(text):
        before = text[:match.start()].rstrip("\n").rsplit("\n", 1)[-1].strip()
        mark = MARK.search(before)
        indent = len(match.group("indent"))
        body = "\n".join(line[indent:] for line in match.group("body").splitlines())
        skip = mark.group("arg").strip() if mark and mark.group("verb") == "skip" else None
        sub = tuple(mark.group("arg").split()) if mark and mark.group("verb") == "sub" else None
        blocks.append((body, skip, sub))
    return blocks


def test_the_page_has_blocks_and_every_skip_says_why():
    blocks = doc_blocks((REPO / DOC).read_text())
    assert len([b for b in blocks if b[1] is None]) >= 5
    assert all(reason for _, reason, _ in blocks if reason is not None)


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def test_every_command_in_the_deployment_doc_runs_as_written(tmp_path):
    compose = ensure_engine()
    busy = [port for port in PORTS if not _port_free(port)]
    if busy:
        pytest.skip(f"ports the page uses are taken here: {busy}")
    clone = tmp_path / f"encdocs{uuid.uuid4().hex[:8]}"
    run(["git", "clone", "-q", str(REPO), str(clone)])
    env = {**os.environ, "PATH": f"{REPO / '.venv' / 'bin'}:{os.environ['PATH']}"}
    env.pop("LB_UPSTREAM", None)
    env.pop("TORCH_INDEX", None)
    subprocess.run(["python", "-m", "tools.protogen"], cwd=clone, env=env, check=True, timeout=300)
    started = time.monotonic()
    try:
        for number, (body, skip, sub) in enumerate(doc_blocks((clone / DOC).read_text()), 1):
            first = body.strip().splitlines()[0] if body.strip() else ""
            if skip is not None:
                print(f"[{number}] skipped ({skip}): {first}")
                continue
            if sub:
                body = body.replace(*sub)
            block_started = time.monotonic()
            result = subprocess.run(["bash", "-euo", "pipefail", "-c", body], cwd=clone, env=env,
                                    capture_output=True, text=True, timeout=1500)
            print(f"[{number}] exit {result.returncode} in {time.monotonic() - block_started:.0f} s: {first}")
            assert result.returncode == 0, f"block {number} of {DOC} failed:\n{body}\n--- stdout\n" \
                                           f"{result.stdout[-3000:]}\n--- stderr\n{result.stderr[-3000:]}"
    finally:
        subprocess.run([compose, "--profile", "cpu", "--profile", "lb", "--profile", "export", "down", "-v",
                        "--remove-orphans", "-t", "20"], cwd=clone, env=env, capture_output=True, timeout=300)
        print(f"{DOC}: all blocks in {time.monotonic() - started:.0f} s")
        shutil.rmtree(clone, ignore_errors=True)
