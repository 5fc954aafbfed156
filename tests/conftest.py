"""Shared fixtures. Serving fixtures are prefixed `serve_`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests import parallel
from tests.subprocess_env import REPO, repo_env

if parallel.in_worker_of_several():
    parallel.limit_threads()  # before any test module imports torch

# --- model / export fixtures (lead) ------------------------------------------------------------
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# A small encoder whose max_positions admits the >= 512 lengths the parity tests use.
TINY = dict(d_model=32, n_heads=4, n_layers=2, d_ff=64, vocab_size=97, max_positions=600)


@pytest.fixture(scope="session")
def tiny_config():
    from model.config import EncoderConfig

    return EncoderConfig(name="tiny", **TINY)


@pytest.fixture(scope="session")
def tiny_variants(tiny_config):
    """Every config variant (one per variant switch) of the tiny encoder."""
    from model.config import variants

    return variants(tiny_config)


# Every value of every variant switch, in 11 exports instead of one per switch (torch.onnx.export is
# the slow part of the suite: 4-6 s each). test_parity checks this table covers every value.
PARITY_CONFIGS = {
    "default": {},
    "none-prenorm-gelu": dict(scaling="temperature", temperature=1.0, norm_placement="pre", activation="gelu"),
    "temperature-learned": dict(scaling="temperature", temperature=4.0, positional="learned",
                                position_ids="after_padding", pad_token_id=1),  # RoBERTa's position ids
    "cosine-nopos-features": dict(scaling="cosine", temperature=0.1, positional="none", input_kind="features"),
    "length-prenorm-learned": dict(scaling="length", norm_placement="pre", positional="learned"),
    "additive-gelu": dict(attention="additive", activation="gelu"),
    "linear-prenorm": dict(attention="linear", norm_placement="pre"),
    "performer-learned": dict(attention="performer", positional="learned"),
    # ModernBERT's parts: rotary positions (a θ per layer kind), GeGLU, no biases, layer 0 without its
    # attention norm, and an attention plan (layer 1 local, window 3).
    "rotary-gated-plan": dict(positional="rotary", rope_theta=160000.0, ffn="gated", activation="gelu",
                              norm_placement="pre", linear_bias=False, norm_bias=False, embedding_layer_norm=True,
                              first_attention_norm=False, local_layers=(1,), local_window=3),
    # Decoder embedders' parts (Qwen2/3): RMSNorm, grouped-query attention with a head width of its own, q/k
    # norms, SwiGLU, a q/k/v-only bias, causal as the natural mask.
    "rms-gqa-swiglu-causal": dict(norm="rms", n_kv_heads=2, attention_head_dim=16, qk_norm=True, activation="silu",
                                  ffn="gated", positional="rotary", norm_placement="pre", linear_bias=False,
                                  qkv_bias=True, natural_mask="causal"),
    # Gemma's parts (sandwich norms, (1 + w) RMSNorm, scaled embeddings, tanh-GELU gates) with MPNet's relative
    # position buckets.
    "gemma-sandwich-relative": dict(norm="rms_gemma", norm_placement="sandwich", activation="gelu_tanh", ffn="gated",
                                    embedding_scale=2.0, relative_attention_buckets=32),
}


@pytest.fixture(scope="session")
def exported_variants(tmp_path_factory, tiny_config):
    """PARITY_CONFIGS exported once (each validated by the exporter) -> {name: ExportResult}."""
    from export.exporter import export_model

    out = tmp_path_factory.mktemp("exports")
    return {name: export_model(tiny_config.replace(name=name, **change), out)
            for name, change in PARITY_CONFIGS.items()}


# --- serving fixtures (prefixed serve_) ---------------------------------------------------------


@pytest.fixture(scope="session")
def serve_export_dir(tmp_path_factory) -> Path:
    """A small token model exported once per session by the real exporter (~15 s). Its positions are
    a learned table of 128, so the server's length limit is 128 (sinusoidal positions have none)."""
    from export.exporter import export_model
    from model.config import EncoderConfig

    config = EncoderConfig(name="serve-test", d_model=32, n_heads=4, n_layers=2, d_ff=64,
                           vocab_size=100, max_positions=128, positional="learned")
    return Path(export_model(config, tmp_path_factory.mktemp("serve-export")).directory)


@pytest.fixture(scope="session")
def serve_long_export_dir(tmp_path_factory) -> Path:
    """A small token model with sinusoidal positions (no length cap) and its sparse long-input graph
    beside the dense one (`--graphs long`), exported and validated once per session."""
    from export.exporter import export_model
    from model.config import EncoderConfig

    config = EncoderConfig(name="serve-long", **TINY)
    return Path(export_model(config, tmp_path_factory.mktemp("serve-long"), graphs=("long",)).directory)


def _needs_native():
    from serve.transport.native import missing_reason

    reason = missing_reason()  # None where it is built (make native)
    return pytest.mark.skipif(reason is not None, reason=str(reason))


NEEDS_NATIVE = _needs_native()  # a test of the native transport itself: skipped where it is not built
TRANSPORTS = [pytest.param("native", marks=NEEDS_NATIVE), "grpcio"]  # tests that run on each transport


@dataclass
class ServeProcess:
    proc: subprocess.Popen
    port: int
    metrics_port: int | None
    log_path: Path
    transport: str = ""  # what carries the gRPC bytes (serve/transport/): native or grpcio
    http_port: int | None = None  # the HTTP transport (serve/transport/http.py)
    front_ends: tuple[int, ...] = ()  # --front-ends N: the front-end processes' pids (the engine is `proc`)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""

    def metrics(self) -> str:
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as response:
            return response.read().decode()

    def terminate(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)


def _wait_serving(target: str, timeout: float) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    end = time.monotonic() + timeout
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < end:
            try:
                status = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.05)
    raise TimeoutError(f"server at {target} not SERVING after {timeout}s")


@pytest.fixture(scope="session")
def serve_start(tmp_path_factory):
    """Starts `python -m serve` as a subprocess on 127.0.0.1, port 0; returns a ServeProcess once SERVING."""
    started: list[ServeProcess] = []

    def start(export_dir: Path, *flags: str, wait: bool = True, timeout: float = 60.0,
              env: dict[str, str] | None = None) -> ServeProcess:
        workdir = tmp_path_factory.mktemp("serve-proc")
        port_file, log_path = workdir / "ports.json", workdir / "server.log"
        env = {**repo_env(), **(env or {})}
        proc = subprocess.Popen(
            [sys.executable, "-m", "serve", "--export-dir", str(export_dir), "--host", "127.0.0.1",
             "--port", "0", "--metrics-port", "0", "--port-file", str(port_file), *flags],
            cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=open(log_path, "w"),
        )
        end = time.monotonic() + timeout
        while not port_file.exists():
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}:\n{log_path.read_text()}")
            if time.monotonic() > end:
                proc.kill()
                raise TimeoutError(f"no port file after {timeout}s:\n{log_path.read_text()}")
            time.sleep(0.05)
        ports = json.loads(port_file.read_text())
        server = ServeProcess(proc, ports["port"], ports["metrics_port"], log_path, ports.get("transport", ""),
                              ports.get("http_port"), tuple(ports.get("front_ends", ())))
        started.append(server)
        if wait:
            _wait_serving(server.target, max(1.0, end - time.monotonic()))
        return server

    yield start
    # Still running at the end: stopped as an orchestrator stops a server (SIGTERM: each drains and removes what
    # it made, such as its front ends' folder), all at once; one not gone within the bound is killed.
    running = [server for server in started if server.proc.poll() is None]
    for server in running:
        server.proc.send_signal(signal.SIGTERM)
    end = time.monotonic() + 20.0
    for server in running:
        try:
            server.proc.wait(max(0.1, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            server.proc.kill()
            server.proc.wait(10)


def pytorch_reference(export_dir: Path):
    """reference(ids, kind, window=, step=, causal=, custom=) -> (hidden [T, D], mean [D]) from the
    PyTorch model of the token export in `export_dir` (its config from metadata.json), on CPU."""
    import numpy as np
    import torch

    from model.encoder import build_encoder
    from model.export_format import read_metadata
    from model.mask_kinds import MaskKind
    from model.masks import default_mask_inputs

    config = read_metadata(export_dir).config
    model = build_encoder(config)

    def reference(ids, kind=MaskKind.BIDIRECTIONAL, *, window=0, step=1, causal=False, custom=None):
        x = torch.as_tensor(np.asarray(ids, np.int64))[None]
        attention = torch.ones_like(x)
        custom_t = None if custom is None else torch.as_tensor(np.asarray(custom, bool))
        masks = default_mask_inputs(attention, kind, window=window, step=step, causal=causal, custom=custom_t)
        with torch.no_grad():
            hidden, pooled = model(x, attention, *masks.values())
        return hidden[0].numpy(), pooled[0].numpy()

    return reference


@pytest.fixture(scope="session")
def reference_for():
    """pytorch_reference, for tests that export a model of their own."""
    return pytorch_reference


@pytest.fixture(scope="session")
def serve_reference(serve_export_dir):
    """pytorch_reference for the session's serve export."""
    return pytorch_reference(serve_export_dir)


# --- clients of a test module's own `server` fixture (the task-route modules each start one) ---------------


@pytest.fixture(scope="module")
def http(server):
    """An httpx.Client on the HTTP port of the requesting module's `server`."""
    import httpx

    with httpx.Client(base_url=f"http://127.0.0.1:{server.http_port}", timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def stub(server):
    """An encoder.v1 EncoderService stub on the gRPC port of the requesting module's `server`."""
    import grpc

    from serve.protocols.pb import pb_grpc

    with grpc.insecure_channel(server.target) as channel:
        yield pb_grpc.EncoderServiceStub(channel)


# --- reliability fixtures (tests/test_reliability_*.py, docs/reliability.md) ------------------------


@pytest.fixture(scope="session")
def serve_features_export_dir(tmp_path_factory) -> Path:
    """A small raw-feature model (input_kind="features", FLOAT32 [T, 16] inputs), exported once (~12 s)."""
    from export.exporter import export_model
    from model.config import EncoderConfig

    config = EncoderConfig(name="serve-features", d_model=16, n_heads=2, n_layers=1, d_ff=32,
                           vocab_size=100, max_positions=64, input_kind="features")
    return Path(export_model(config, tmp_path_factory.mktemp("serve-features"), long_length=20).directory)


# --- one torch.onnx trace per model and run (export/trace_cache.py) ---------------------------------


def pytest_configure(config):
    """The controller (or a run without workers) makes the run's trace cache; workers and the export CLIs
    the tests start inherit it through the environment. A cache named in the environment (or `off`) is kept."""
    from export.trace_cache import ENV

    if hasattr(config, "workerinput") or os.environ.get(ENV):
        return
    import tempfile

    config._trace_cache = os.environ[ENV] = tempfile.mkdtemp(prefix="encoder-trace-cache-")


def pytest_unconfigure(config):
    made = getattr(config, "_trace_cache", None)
    if made:
        import shutil

        from export.trace_cache import ENV

        shutil.rmtree(made, ignore_errors=True)
        os.environ.pop(ENV, None)


# --- pytest-xdist (`make test` runs two workers: tests/parallel.py) ------------------------------------


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") == "loadfile":
        return parallel.make_scheduler(config, log)
    return None


def pytest_collection_modifyitems(config, items):
    if parallel.in_worker_of_several():
        parallel.longest_first(items)


def pytest_sessionfinish(session):
    """In a worker: its reliability figures, for the controller's summary line."""
    workeroutput = getattr(session.config, "workeroutput", None)
    module = sys.modules.get("tests.reliability_common")
    if workeroutput is not None and module is not None:
        workeroutput["reliability"] = [dict(module.FIGURES), dict(module.LATENCY)]


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """In the controller: a worker's reliability figures, added to the others'."""
    figures = getattr(node, "workeroutput", {}).get("reliability")
    if figures:
        from tests import reliability_common

        reliability_common.count(**figures[0])
        reliability_common.LATENCY.update(figures[1])


def pytest_terminal_summary(terminalreporter):
    """One `reliability:` line with the load/fault/bad-input figures, when those tests ran."""
    module = sys.modules.get("tests.reliability_common")
    line = module.summary_line() if module is not None else None
    if line:
        terminalreporter.write_sep("-", "reliability figures")
        terminalreporter.write_line(line)
