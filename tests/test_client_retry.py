"""The client's retries (client/__init__.py): gRPC's own retry policy and client-side health checking,
with one deadline per call, against a real in-process server on 127.0.0.1.

The server's replies are scripted at the backend boundary (the next N inference calls raise
Unavailable, as a replica that is going away answers) and its start-up is held at a gate the test
opens, so what is asserted never depends on timing; the server's own metrics count the attempts.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest

from export.contract import FP32_TOLERANCE
from serve.assembly.app import create_server
from client import MAX_ATTEMPTS, EncoderClient
from serve.config import ServerConfig
from serve.errors import Unavailable
from serve.assembly.loading import default_backend

ATOL = FP32_TOLERANCE["limit"]
SEQ = [5, 17, 42, 7]


class ScriptedServer:
    """An in-process server whose next `fail` inference calls raise Unavailable, each after `slow_s`
    seconds (a slow replica); its warm-up waits for `release` when `gated`."""

    def __init__(self, export_dir, gated: bool = False) -> None:
        self.fail, self.slow_s = 0, 0.0
        self.warming, self.release = threading.Event(), threading.Event()
        if not gated:
            self.release.set()
        self._lock = threading.Lock()

        def scripted(export, config):
            backend = default_backend(export, config)
            real_encode, real_warm_up = backend.encode, backend.warm_up

            def warm_up():
                self.warming.set()
                self.release.wait(30)
                return real_warm_up()

            def encode(*args, **kwargs):
                with self._lock:
                    failing = self.fail > 0
                    self.fail -= failing
                if failing:
                    threading.Event().wait(self.slow_s)  # the time a slow replica takes to answer
                    raise Unavailable("scripted: this replica is going away; retry")
                return real_encode(*args, **kwargs)

            backend.encode, backend.warm_up = encode, warm_up
            return backend

        config = ServerConfig(port=0, metrics_port=-1, http_port=0, export_dir=str(export_dir))
        self.server, port = create_server(config, backend_factory=scripted)
        self.target = f"127.0.0.1:{port}"
        self.server.start()

    def script(self, fail: int, slow_s: float = 0.0) -> None:
        with self._lock:
            self.fail, self.slow_s = fail, slow_s

    def count(self, code: str) -> int:
        """Encode calls the server ended with `code` so far (its own metrics)."""
        value = self.server.metrics.registry.get_sample_value("encoder_requests_total",
                                                              {"method": "Encode", "code": code})
        return int(value or 0)


@pytest.fixture
def scripted(serve_export_dir):
    """A loaded server of its own per test: gRPC keeps retry-throttling tokens per target, so tests
    that spend them must not share one."""
    server = ScriptedServer(serve_export_dir)
    server.server.load()
    yield server
    server.server.shutdown(5)


@pytest.fixture
def expected(serve_reference):
    return serve_reference(SEQ)[1]


def test_unavailable_answers_are_retried_until_one_succeeds(scripted, expected):
    scripted.script(fail=2)
    before = scripted.count("UNAVAILABLE"), scripted.count("OK")
    with EncoderClient(scripted.target, retries=3, backoff_s=0.01) as client:
        np.testing.assert_allclose(client.encode([SEQ]).embeddings[0], expected, atol=ATOL, rtol=ATOL)
    assert (scripted.count("UNAVAILABLE") - before[0], scripted.count("OK") - before[1]) == (2, 1)


def test_retries_zero_makes_one_attempt_and_returns_unavailable(scripted):
    scripted.script(fail=1)
    before = scripted.count("UNAVAILABLE")
    with EncoderClient(scripted.target, retries=0) as client:
        with pytest.raises(grpc.RpcError) as caught:
            client.encode([SEQ])
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE and "going away" in caught.value.details()
    assert scripted.count("UNAVAILABLE") - before == 1


def test_attempts_are_capped_at_grpcs_maximum_then_the_last_status_is_returned(scripted):
    scripted.script(fail=100)
    before = scripted.count("UNAVAILABLE")
    try:
        with EncoderClient(scripted.target, retries=10, backoff_s=0.01, max_backoff_s=0.05) as client:
            with pytest.raises(grpc.RpcError) as caught:
                client.encode([SEQ])
    finally:
        scripted.script(fail=0)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    assert scripted.count("UNAVAILABLE") - before == MAX_ATTEMPTS


def test_one_deadline_covers_every_attempt_and_backoff(scripted, expected):
    # every attempt takes 0.4 s and answers UNAVAILABLE: a per-attempt timeout would allow 5 x 0.4 s
    scripted.script(fail=100, slow_s=0.4)
    before = scripted.count("UNAVAILABLE")
    try:
        with EncoderClient(scripted.target, timeout=1.0, retries=4, backoff_s=0.01) as client:
            started = time.monotonic()
            with pytest.raises(grpc.RpcError) as caught:
                client.encode([SEQ])
            elapsed = time.monotonic() - started
    finally:
        scripted.script(fail=0)
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert elapsed < 1.0 + 0.5
    assert scripted.count("UNAVAILABLE") - before >= 1  # so the call that hit the deadline was a retry
    with EncoderClient(scripted.target) as client:  # and the server serves on
        np.testing.assert_allclose(client.encode([SEQ]).embeddings[0], expected, atol=ATOL, rtol=ATOL)


def test_a_retrying_client_waits_for_a_loading_server_and_gets_its_answer_once_it_serves(serve_export_dir):
    loading = ScriptedServer(serve_export_dir, gated=True)
    loader = threading.Thread(target=loading.server.load)
    loader.start()
    try:
        assert loading.warming.wait(30)  # bound, health NOT_SERVING, held in warm-up
        with EncoderClient(loading.target, timeout=0.5) as client:
            assert client.health() == "NOT_SERVING"
            with pytest.raises(grpc.RpcError) as caught:
                client.encode([SEQ])
            assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED  # it waited, never sent
        assert loading.count("UNAVAILABLE") == 0
        with EncoderClient(loading.target, retries=0) as client:  # without retries: fails fast
            with pytest.raises(grpc.RpcError) as caught:
                client.encode([SEQ])
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE and "loading" in caught.value.details()
        with EncoderClient(loading.target, timeout=30) as client, ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(client.encode, [SEQ])
            loading.release.set()
            assert waiting.result(30).embeddings.shape == (1, 32)
        assert loading.count("UNAVAILABLE") == 1 and loading.count("OK") == 1
    finally:
        loading.release.set()
        loader.join(30)
        loading.server.shutdown(5)
