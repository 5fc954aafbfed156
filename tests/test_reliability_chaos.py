"""Chaos: the races of shutdown, overflow and load, with a CPU hog beside the server, so they show in
CI (which may run on a busy machine) rather than in production.

`cpu_hog` starts one busy-looping Python subprocess per CPU (at most 4) for the length of one test;
each also ends itself after HOG_LIMIT_S, and the fixture kills them by their own pids. All traffic
goes to 127.0.0.1. The section takes tens of seconds (docs/reliability.md, "Chaos").
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from client import build_request, parse_response
from serve.protocols.pb import pb_grpc
from tests.reliability_common import assert_sigterm_under_load_answers_every_accepted_request, count

pytestmark = pytest.mark.chaos

HOG_LIMIT_S = 240  # a hog outlives no test by more than this, even if the fixture's teardown never runs
LOAD_SECONDS = 4.0
ATOL = 1e-4


@pytest.fixture
def cpu_hog():
    """Busy subprocesses, one per CPU (at most 4), for the length of the test."""
    code = f"import time\nend = time.monotonic() + {HOG_LIMIT_S}\nwhile time.monotonic() < end:\n    pass\n"
    hogs = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(min(os.cpu_count() or 1, 4))]
    yield hogs
    for hog in hogs:
        hog.kill()
        hog.wait(10)


def _still_hogging(hogs) -> None:
    assert all(h.poll() is None for h in hogs), "the CPU hog ended before the test did"


def test_with_a_cpu_hog_sigterm_under_load_answers_every_accepted_request_and_exits_zero(
        cpu_hog, serve_start, serve_export_dir):
    codes = assert_sigterm_under_load_answers_every_accepted_request(serve_start, serve_export_dir)
    _still_hogging(cpu_hog)
    count(chaos_sigterm_calls=len(codes), chaos_sigterm_refused=sum(c != "OK" for c, _ in codes))


def test_with_a_cpu_hog_queue_overflow_is_refused_resource_exhausted_then_sigterm_answers_the_queued(
        cpu_hog, serve_start, serve_export_dir, serve_reference):
    # The first request waits up to 60 s for company and the queue holds 2: the other 10 overflow at
    # once. SIGTERM then ends the wait: the 2 queued are answered, correctly, and the exit is 0.
    server = serve_start(serve_export_dir, "--max-queue-size", "2", "--max-queue-delay-ms", "60000",
                         "--grace-s", "30")
    seqs = [np.random.default_rng(i).integers(0, 99, 5 + i).astype(np.int64) for i in range(12)]
    answered = threading.Semaphore(0)
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.EncoderServiceStub(channel)
        futures = [stub.Encode.future(build_request([s]), timeout=90) for s in seqs]
        for future in futures:
            future.add_done_callback(lambda _: answered.release())
        for _ in range(len(seqs) - 2):  # the refusals come back while the 2 queued still wait
            assert answered.acquire(timeout=60)
        refused = [f for f in futures if f.done()]
        assert len(refused) == len(seqs) - 2
        for future in refused:
            assert future.exception().code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "queue full" in future.exception().details() and "max_queue_size=2" in future.exception().details()
        with grpc.insecure_channel(server.target) as probe:  # refusing did not make it unhealthy
            status = health_pb2_grpc.HealthStub(probe).Check(health_pb2.HealthCheckRequest(), timeout=10).status
            assert status == health_pb2.HealthCheckResponse.SERVING
        server.proc.send_signal(signal.SIGTERM)
        queued = [(i, f) for i, f in enumerate(futures) if f not in refused]
        for i, future in queued:
            out = parse_response(future.result())
            np.testing.assert_allclose(out.embeddings[0], serve_reference(seqs[i])[1], atol=ATOL, rtol=ATOL)
    assert server.proc.wait(60) == 0, server.log()
    assert "drained=True" in server.log() and "event=unexpected_error" not in server.log()
    _still_hogging(cpu_hog)
    count(chaos_overflow_refused=len(refused))


def test_with_a_cpu_hog_mixed_load_gets_one_allowed_answer_per_request_and_sigterm_exits_zero(
        cpu_hog, serve_start, serve_export_dir):
    from tests import test_reliability_load as load

    server = serve_start(serve_export_dir, "--max-queue-delay-ms", "3", "--max-queue-size", "512",
                         "--fault-inject", f"poison_token={load.POISON}", "--workers", "32")
    results: list = []
    lock = threading.Lock()
    end = time.monotonic() + LOAD_SECONDS
    threads = [threading.Thread(target=load._worker, args=(server.target, seed, end, [None], results, lock))
               for seed in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(LOAD_SECONDS + 2 * load.CALL_TIMEOUT_S)
    assert not any(t.is_alive() for t in threads), "a load thread hung"
    unexpected = [(r.kind, r.code, r.details) for r in results if r.code not in load.ALLOWED[r.kind]]
    assert results and not unexpected, unexpected[:10]
    assert server.terminate(60) == 0, server.log()
    assert "event=unexpected_error" not in server.log() and "drained=True" in server.log()
    _still_hogging(cpu_hog)
    count(chaos_load_sent=len(results), chaos_load_ok=sum(r.code == "OK" for r in results))
