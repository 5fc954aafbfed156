"""Docker smoke test: build the CPU serving image, bring `serve-cpu` up with docker-compose, wait for
gRPC health SERVING, Encode (and KServe v2 ModelInfer) from the host against the PyTorch reference,
then tear everything down, always.

Needs a Docker engine and docker-compose. Where none runs and we are root with the repo's sibling
`../shared/tools/local-docker.sh` present (CI), the test starts one with it (first time: ~2 min for
the engine and the debootstrapped base image). Otherwise it skips, saying why.

The export comes from the host (the session's `serve_export_dir`, made by the real exporter) and is
copied into the compose project's `exports` volume: the export image (torch) is built and run by
`test_export_job_writes_the_volume_the_server_reads` only when SMOKE_EXPORT_IMAGE=1, since its
torch wheel comes from the PyTorch CPU index or docker/wheels/ (docs/deployment.md).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from export.contract import FP32_TOLERANCE
from tests.docker_env import DOCKER, REPO, ensure_engine, free_port as _free_port, image_size as _image_size
from tests.docker_env import run as _run

REF_ATOL = FP32_TOLERANCE["limit"]  # the export's fp32 tolerance vs PyTorch

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]


@pytest.fixture(scope="module")
def engine():
    """A running engine + docker-compose + the python:3.11-slim base image, or a skip with the reason."""
    return ensure_engine()


class Project:
    """One docker-compose project with a unique name, ports on 127.0.0.1."""

    def __init__(self, compose: str) -> None:
        self.name = f"encsmoke{uuid.uuid4().hex[:8]}"
        self.compose = compose
        self.grpc_port, self.metrics_port, self.http_port = _free_port(), _free_port(), _free_port()
        # the volume (the model repository) holds one model, serve-test: what a call naming none gets
        self.env = {"COMPOSE_PROJECT_NAME": self.name, "SERVE_BIND": "127.0.0.1",
                    "SERVE_CPU_GRPC_PORT": str(self.grpc_port), "SERVE_CPU_METRICS_PORT": str(self.metrics_port),
                    "SERVE_CPU_HTTP_PORT": str(self.http_port),
                    "ENCODER_DEFAULT_MODEL": "serve-test", "DOCKER_HOST": os.environ.get("DOCKER_HOST", "")}
        self.env = {k: v for k, v in self.env.items() if v}
        self.volume = f"{self.name}_exports"

    def run(self, *args: str, **kwargs) -> subprocess.CompletedProcess:
        return _run([self.compose, "-p", self.name, "-f", "docker-compose.yml", *args], env=self.env, **kwargs)

    def down(self) -> None:
        self.run("--profile", "cpu", "--profile", "export", "down", "-v", "--remove-orphans", "-t", "20",
                 check=False)
        _run([DOCKER, "volume", "rm", "-f", self.volume, f"{self.name}_cache"], check=False)

    def fill_volume(self, volume: str, source: Path, into: str = "") -> None:
        """Compose's volume `volume` (created as compose names and labels it), with the host folder `source` copied
        in (under `into`), owned by the image's user: as the export job would leave it."""
        _run([DOCKER, "volume", "create", "--label", f"com.docker.compose.project={self.name}",
              "--label", f"com.docker.compose.volume={volume}", f"{self.name}_{volume}"])
        _run([DOCKER, "run", "--rm", "--user", "0", "--entrypoint", "sh", "-v", f"{self.name}_{volume}:/volume",
              "-v", f"{source}:/src:ro", "onnx-encoder-serve:cpu", "-c",
              f"mkdir -p /volume/{into} && cp -a /src/. /volume/{into} && chown -R 10001:10001 /volume"])


@pytest.fixture(scope="module")
def project(engine):
    project = Project(engine)
    try:
        yield project
    finally:
        if os.environ.get("SMOKE_KEEP") != "1":
            project.down()


def _wait_healthy(project: Project, container: str, timeout: float = 180) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    end = time.monotonic() + timeout
    last = "no answer"
    with grpc.insecure_channel(f"127.0.0.1:{project.grpc_port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < end:
            try:
                status = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2).status
                last = health_pb2.HealthCheckResponse.ServingStatus.Name(status)
                if status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError as error:
                last = error.code().name
            time.sleep(0.5)
    logs = _run([DOCKER, "logs", container], check=False).stderr[-4000:]
    raise AssertionError(f"serve-cpu not SERVING after {timeout}s (last: {last}); logs:\n{logs}")


def test_cpu_service_serves_encode_from_the_compose_volume(project, serve_export_dir, serve_reference):
    started = time.monotonic()
    project.run("--profile", "cpu", "build", "serve-cpu", timeout=1200)
    build_s = time.monotonic() - started
    print(f"serve-cpu image built in {build_s:.0f} s; size {_image_size('onnx-encoder-serve:cpu')}")

    # The volume as compose names and labels it, filled from the host export (as the export job would).
    project.fill_volume("exports", serve_export_dir, "serve-test")

    project.run("--profile", "cpu", "up", "-d", "--no-build", "serve-cpu", timeout=300)
    container = project.run("--profile", "cpu", "ps", "-q", "serve-cpu").stdout.strip()
    assert container, "serve-cpu container not created"
    _wait_healthy(project, container)
    print(f"SERVING {time.monotonic() - started:.0f} s after the build started")

    # Runs as the unprivileged user, restarts by policy.
    user, restart = _run([DOCKER, "inspect", "-f", "{{.Config.User}} {{.HostConfig.RestartPolicy.Name}}",
                          container]).stdout.split()
    assert user == "10001:10001" and restart == "unless-stopped"
    # In its own network namespace, a front end that dies hands its waiting connections on (docker-compose.yml)
    from serve.assembly.front_ends import MIGRATE_SYSCTL_PATH

    migrate = _run([DOCKER, "exec", container, "cat", MIGRATE_SYSCTL_PATH]).stdout.strip()
    assert migrate == "1", migrate

    from model.mask_kinds import MaskKind
    from client import EncoderClient

    ids = np.array([3, 14, 15, 92, 65, 35, 89, 79], np.int64)
    with EncoderClient(f"127.0.0.1:{project.grpc_port}") as client:
        out = client.encode([ids], hidden_states=True)
        assert out.metadata.execution_provider == "CPUExecutionProvider"
        hidden, pooled = serve_reference(ids)
        assert out.hidden_states[0].shape == hidden.shape and out.hidden_states[0].dtype == np.float32
        np.testing.assert_allclose(out.hidden_states[0], hidden, atol=REF_ATOL, rtol=0)
        np.testing.assert_allclose(out.embeddings[0], pooled, atol=REF_ATOL, rtol=0)
        windowed = client.encode([ids], mask="sliding_window", window=2, hidden_states=True)
        np.testing.assert_allclose(windowed.hidden_states[0],
                                   serve_reference(ids, MaskKind.SLIDING_WINDOW, window=2)[0], atol=REF_ATOL, rtol=0)

    # The in-image health probe (what the compose healthcheck runs) agrees, and Docker says healthy.
    probe = _run([DOCKER, "exec", container, "python", "/app/docker/health_probe.py"], check=False)
    assert probe.returncode == 0 and "SERVING" in probe.stdout, probe.stderr
    end, health = time.monotonic() + 60, ""
    while time.monotonic() < end and health != "healthy":
        health = _run([DOCKER, "inspect", "-f", "{{.State.Health.Status}}", container]).stdout.strip()
        time.sleep(1)
    assert health == "healthy", f"docker health status {health!r}"

    # The metrics port is published too.
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{project.metrics_port}/metrics", timeout=5) as response:
        assert "encoder_requests" in response.read().decode()

    # KServe v2 on the same port, when the test client is installed.
    try:
        import tritonclient.grpc as grpcclient
    except ImportError:
        return
    client = grpcclient.InferenceServerClient(url=f"127.0.0.1:{project.grpc_port}")
    inputs = [grpcclient.InferInput("input_ids", [1, len(ids)], "INT64")]
    inputs[0].set_data_from_numpy(ids[None])
    result = client.infer("serve-test", inputs)
    np.testing.assert_allclose(result.as_numpy("embeddings")[0], pooled, atol=REF_ATOL, rtol=0)
    client.close()
    # ... and OpenAI's embeddings over HTTP, published on the HTTP port
    import json

    body = json.dumps({"model": "serve-test", "input": [ids.tolist()]}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{project.http_port}/v1/embeddings", data=body,
                                     headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        embedding = json.loads(response.read())["data"][0]["embedding"]
    np.testing.assert_allclose(np.array(embedding, np.float32), pooled, atol=REF_ATOL, rtol=0)
    # both answered on the native transport (built into the image), not the grpcio fallback
    logs = project.run("--profile", "cpu", "logs", "--no-color", "serve-cpu").stdout
    assert "transport=native" in logs, logs[-2000:]


MINILM_ID = "sentence-transformers/all-MiniLM-L6-v2"


@pytest.fixture(scope="module")
def id_project(engine):
    project = Project(engine)
    project.env.update({"ENCODER_DEFAULT_MODEL": "all-minilm-l6-v2", "MODEL_IDS": MINILM_ID, "HF_HUB_OFFLINE": "1",
                        "ENCODER_EXPORT_GRAPHS": "fp32"})
    try:
        yield project
    finally:
        if os.environ.get("SMOKE_KEEP") != "1":
            project.down()


def test_cpu_service_serves_a_model_by_id_from_a_prefilled_cache_volume(id_project, tmp_path):
    """MODEL_IDS with the cache volume as the export job leaves it: the Hugging Face cache (made here in the hub's own
    layout, tests/hub_cache.py, offline) and the export cache (filled here by the same `--prepare-only` step the
    export image runs). The serving image has no torch: it serves the cached export, exporting nothing."""
    import json
    import sys
    import urllib.request

    from model.hf_pretrained import minilm_path
    from tests.hub_cache import add_revision
    from tests.subprocess_env import repo_env

    project = id_project
    project.run("--profile", "cpu", "build", "serve-cpu", timeout=1200)
    cache = tmp_path / "cache"
    commit = add_revision(cache / "huggingface" / "hub", MINILM_ID, minilm_path())
    warmed = subprocess.run([sys.executable, "-m", "serve", "--prepare-only", "true", "--model", MINILM_ID,
                             "--export-cache", str(cache / "exports"), "--export-graphs", "fp32"], cwd=REPO,
                            env={**repo_env(), "HF_HUB_CACHE": str(cache / "huggingface" / "hub"),
                                 "HF_HUB_OFFLINE": "1", "HF_TOKEN": ""},
                            capture_output=True, text=True, timeout=900)
    assert warmed.returncode == 0, warmed.stderr[-3000:]
    project.fill_volume("cache", cache)

    project.run("--profile", "cpu", "up", "-d", "--no-build", "serve-cpu", timeout=300)
    container = project.run("--profile", "cpu", "ps", "-q", "serve-cpu").stdout.strip()
    assert container, "serve-cpu container not created"
    _wait_healthy(project, container)
    logs = project.run("--profile", "cpu", "logs", "--no-color", "serve-cpu").stdout
    (source,) = [line for line in logs.splitlines() if "event=model_source" in line]
    assert "cache=hit" in source and f"commit={commit}" in source, source
    assert "event=export_started" not in logs

    texts = ["A model served from its id.", "Compose brings it up from the cache volume."]
    body = json.dumps({"model": "all-minilm-l6-v2", "input": texts}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{project.http_port}/v1/embeddings", data=body,
                                     headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        served = np.array([row["embedding"] for row in json.loads(response.read())["data"]], np.float32)
    from sentence_transformers import SentenceTransformer

    snapshot = cache / "huggingface" / "hub" / f"models--{MINILM_ID.replace('/', '--')}" / "snapshots" / commit
    expected = SentenceTransformer(str(snapshot), device="cpu").encode(texts, normalize_embeddings=True)
    cosine = (served * expected).sum(1) / np.linalg.norm(served, axis=1) / np.linalg.norm(expected, axis=1)
    assert cosine.min() >= 0.99999, cosine


@pytest.mark.skipif(os.environ.get("SMOKE_EXPORT_IMAGE") != "1",
                    reason="set SMOKE_EXPORT_IMAGE=1 to build the export image (torch CPU wheel from the "
                           "PyTorch CPU index, or TORCH_INDEX= to use docker/wheels/ or /opt/wheels)")
def test_export_job_writes_the_volume_the_server_reads(project):
    _build_export_image(project)
    project.run("--profile", "export", "run", "--rm", "export", "--out-dir", "/exports",
                "--set", "n_layers=1", "--set", "d_model=32", "--set", "n_heads=2", "--set", "d_ff=64",
                "--name", "smoke-export", timeout=600)
    listing = _run([DOCKER, "run", "--rm", "--entrypoint", "ls", "-v", f"{project.volume}:/exports:ro",
                    "onnx-encoder-serve:cpu", "/exports/smoke-export"]).stdout.split()
    assert {"model.onnx", "metadata.json"} <= set(listing)


@pytest.mark.skipif(os.environ.get("SMOKE_EXPORT_IMAGE") != "1",
                    reason="set SMOKE_EXPORT_IMAGE=1 to build the export image (torch CPU wheel from the "
                           "PyTorch CPU index, or TORCH_INDEX= to use docker/wheels/ or /opt/wheels)")
def test_export_job_with_model_ids_fills_the_cache_the_server_serves_from(id_project, tmp_path):
    """MODEL_IDS: the export job (the export image: torch) fetches (here: offline, from a Hugging Face cache in the
    hub's layout put in the volume) and exports the id into the cache volume; the CPU server then serves it from
    there without exporting."""
    from model.hf_pretrained import minilm_path
    from tests.hub_cache import add_revision

    project = id_project
    _build_export_image(project)
    project.run("--profile", "cpu", "build", "serve-cpu", timeout=1200)
    hub = tmp_path / "hub"
    add_revision(hub, MINILM_ID, minilm_path())
    project.fill_volume("cache", hub, "huggingface/hub")
    job = project.run("--profile", "export", "run", "--rm", "export", timeout=900)
    assert "cache=exported" in job.stdout + job.stderr, (job.stdout + job.stderr)[-3000:]
    project.run("--profile", "cpu", "up", "-d", "--no-build", "serve-cpu", timeout=300)
    container = project.run("--profile", "cpu", "ps", "-q", "serve-cpu").stdout.strip()
    _wait_healthy(project, container)
    logs = project.run("--profile", "cpu", "logs", "--no-color", "serve-cpu").stdout
    assert "cache=hit" in logs and "event=export_started" not in logs, logs[-3000:]


def _build_export_image(project: Project) -> None:
    env = {} if os.environ.get("TORCH_INDEX") is None else {"TORCH_INDEX": os.environ["TORCH_INDEX"]}
    project.env.update(env)
    # A machine without the PyTorch CPU index but with the wheel on disk (this one: /opt/wheels) lends
    # it to the build through docker/wheels/ for the duration of the build only.
    lent = []
    for wheel in Path("/opt/wheels").glob("torch-2.13.0+cpu-cp311-*.whl") if env.get("TORCH_INDEX") == "" else ():
        target = REPO / "docker" / "wheels" / wheel.name
        if not target.exists():
            shutil.copyfile(wheel, target)
            lent.append(target)
    try:
        project.run("--profile", "export", "build", "export", timeout=1500)
    finally:
        for target in lent:
            target.unlink()
    print(f"export image size {_image_size('onnx-encoder-export:latest')}")
