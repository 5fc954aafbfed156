"""Load / soak against the real `python -m serve` subprocess on 127.0.0.1: every request gets exactly
one answer, every OK answer is numerically right, nothing is lost, nothing hangs.

Quick by default (~6 s of load). Longer soak, documented in docs/reliability.md:

    SOAK_SECONDS=300 SOAK_THREADS=16 pytest tests/test_reliability_load.py -s

The mix: 1-4 sequences of length 1-127, INT64 and INT32 ids, every mask kind (custom included),
hidden states or not, every pooling, normalised or not; plus a share of requests that must fail
cleanly: invalid (INVALID_ARGUMENT), poisoned (the server runs with --fault-inject poison_token=99:
that request alone gets INTERNAL, serve/backend/faults.py), near-zero deadlines (DEADLINE_EXCEEDED or OK),
client cancellations (CANCELLED or OK), and bidirectional streams (one answer per request, in order).
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from export.contract import FP32_TOLERANCE
from model.mask_kinds import MaskKind
from client import build_request, parse_response
from serve.protocols.pb import pb, pb_grpc
from tests.reliability_common import LATENCY, count

ATOL = FP32_TOLERANCE["limit"]
SOAK_SECONDS = float(os.environ.get("SOAK_SECONDS", "6"))
THREADS = int(os.environ.get("SOAK_THREADS", "12"))
MAX_REQUESTS = int(os.environ.get("SOAK_MAX_REQUESTS", "0")) or None  # optional cap on top of time
CODE_NAMES = {c.value[0]: c.name for c in grpc.StatusCode}
CALL_TIMEOUT_S = 30.0  # the hang bound: every call must return before this deadline
POISON = 99
VOCAB = 100
MAX_LEN = 127  # serve_export_dir has max_positions=128
SPOT_CHECKS = int(os.environ.get("SOAK_SPOT_CHECKS", "60"))  # sequences compared with PyTorch

# what each kind of request may end with
ALLOWED = {
    "valid": {"OK"},
    "invalid": {"INVALID_ARGUMENT"},
    "poison": {"INTERNAL"},
    "deadline": {"OK", "DEADLINE_EXCEEDED"},
    "cancel": {"OK", "CANCELLED"},
    "stream": {"OK"},
}


@dataclass
class Outcome:
    kind: str
    code: str
    details: str
    latency_s: float
    options: dict | None = None
    sequences: list | None = None
    response: object | None = None


def _random_options(rng: np.random.Generator, lengths: list[int], custom: bool) -> dict:
    kind = MaskKind.CUSTOM if custom else MaskKind(int(rng.integers(0, len(MaskKind) - 1)))
    options: dict = dict(mask=kind, hidden_states=bool(rng.integers(0, 2)),
                         pooling=str(rng.choice(["mean", "first", "none"])), normalize=bool(rng.integers(0, 2)))
    if options["pooling"] == "none":
        options["hidden_states"] = True
    if kind.uses_window:
        options["window"] = int(rng.integers(0, 6))
    if kind.uses_step:
        options["step"] = int(rng.integers(1, 6))
    if kind.takes_causal_flag:
        options["causal"] = bool(rng.integers(0, 2))
    if kind == MaskKind.CUSTOM:
        masks = []
        for length in lengths:
            m = rng.random((length, length)) < 0.5
            np.fill_diagonal(m, True)  # every query keeps at least itself
            masks.append(m)
        options["custom"] = np.stack(masks)
    return options


def _random_valid(rng: np.random.Generator) -> tuple[list, dict]:
    n = int(rng.integers(1, 5))
    custom = rng.random() < 1 / len(MaskKind)
    if custom or rng.random() < 0.2:  # a custom [B, T, T] tensor needs equal lengths
        lengths = [int(rng.integers(1, MAX_LEN + 1))] * n
    else:
        lengths = [int(rng.integers(1, MAX_LEN + 1)) for _ in range(n)]
    dtype = np.int64 if rng.random() < 0.5 else np.int32
    sequences = [rng.integers(0, POISON, length).astype(dtype) for length in lengths]  # never the poison id
    return sequences, _random_options(rng, lengths, custom)


def _request(sequences, options) -> "pb.EncodeRequest":
    msg = build_request([np.asarray(s, np.int64) for s in sequences], **options)
    for tensor, seq in zip(msg.sequences, sequences):  # keep INT32 ids INT32 on the wire
        if seq.dtype == np.int32:
            tensor.dtype = pb.DATA_TYPE_INT32
            tensor.data = np.ascontiguousarray(seq, "<i4").tobytes()
    return msg


def _worker(target: str, seed: int, end: float, budget: list, results: list, lock: threading.Lock) -> None:
    rng = np.random.default_rng(seed)
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.EncoderServiceStub(channel)
        while time.monotonic() < end:
            with lock:
                if budget[0] is not None:
                    if budget[0] <= 0:
                        return
                    budget[0] -= 1
            roll = rng.random()
            kind = ("invalid" if roll < 0.08 else "poison" if roll < 0.11 else "deadline" if roll < 0.15
                    else "cancel" if roll < 0.19 else "stream" if roll < 0.23 else "valid")
            try:
                outcomes = _stream(stub, rng) if kind == "stream" else [_unary(stub, rng, kind)]
            except BaseException as error:  # a broken answer fails the test, never a silent thread death
                outcomes = [Outcome(kind, "CLIENT_FAILURE", f"{type(error).__name__}: {error}", 0.0)]
            with lock:
                results.extend(outcomes)


def _unary(stub, rng, kind: str) -> Outcome:
    sequences, options = _random_valid(rng)
    if kind == "invalid":
        sequences[0] = np.array([VOCAB + int(rng.integers(0, 1000))], np.int64)  # id out of range
        options = dict(mask=MaskKind.BIDIRECTIONAL)
    elif kind == "poison":
        sequences[0] = sequences[0].copy()
        sequences[0][int(rng.integers(0, len(sequences[0])))] = POISON
    timeout = 0.002 if kind == "deadline" else CALL_TIMEOUT_S
    started = time.monotonic()
    future = stub.Encode.future(_request(sequences, options), timeout=timeout)
    if kind == "cancel":
        time.sleep(float(rng.random()) * 0.01)
        future.cancel()
    try:
        response = future.result()
        code, details = "OK", ""
    except grpc.FutureCancelledError:
        response, code, details = None, "CANCELLED", "cancelled by the client"
    except grpc.RpcError as error:
        response, code, details = None, error.code().name, error.details() or ""
    return Outcome(kind, code, details, time.monotonic() - started, options, sequences, response)


def _stream(stub, rng) -> list[Outcome]:
    items = [_random_valid(rng) for _ in range(int(rng.integers(2, 6)))]
    requests = []
    for i, (sequences, options) in enumerate(items):
        msg = _request(sequences, options)
        msg.request_id = f"s{i}"
        requests.append(msg)
    started = time.monotonic()
    try:
        responses = list(stub.EncodeStream(iter(requests), timeout=CALL_TIMEOUT_S))
    except grpc.RpcError as error:
        latency = time.monotonic() - started
        return [Outcome("stream", error.code().name, error.details() or "", latency) for _ in items]
    latency = time.monotonic() - started
    # exactly one answer per request, in request order
    assert [r.response.request_id for r in responses] == [m.request_id for m in requests]
    outcomes = []
    for (sequences, options), r in zip(items, responses):
        code = CODE_NAMES[r.error.code]
        outcomes.append(Outcome("stream", code, r.error.message, latency, options, sequences,
                                r.response if code == "OK" else None))
    return outcomes


def _check_numerics(outcome: Outcome, reference) -> int:
    out = parse_response(outcome.response)
    o = outcome.options
    kind = o["mask"]
    checked = 0
    for i, seq in enumerate(outcome.sequences):
        custom = o["custom"][i] if "custom" in o else None
        hidden, mean = reference(np.asarray(seq, np.int64), kind, window=o.get("window", 0),
                                 step=o.get("step", 1) or 1, causal=o.get("causal", False), custom=custom)
        if o["hidden_states"]:
            got = out.hidden_states[i]
            assert got.shape == hidden.shape and got.dtype == np.float32
            np.testing.assert_allclose(got, hidden, atol=ATOL, rtol=ATOL)
        if o["pooling"] != "none":
            expected = mean if o["pooling"] == "mean" else hidden[0]
            if o["normalize"]:
                expected = expected / max(float(np.linalg.norm(expected)), 1e-12)
            np.testing.assert_allclose(out.embeddings[i], expected, atol=ATOL, rtol=ATOL)
        else:
            assert out.embeddings is None
        checked += 1
    return checked


@pytest.fixture(scope="module")
def load_server(serve_start, serve_export_dir):
    process = serve_start(serve_export_dir, "--max-queue-delay-ms", "3", "--max-batch-size", "32",
                          "--max-queue-size", "512", "--fault-inject", f"poison_token={POISON}",
                          "--workers", str(max(32, THREADS * 2)))
    yield process
    assert process.terminate() == 0, process.log()


def test_under_mixed_load_every_request_gets_one_correct_answer_and_none_is_lost(load_server, serve_reference,
                                                                                 serve_export_dir):
    import json

    sha = json.loads((serve_export_dir / "metadata.json").read_text())["graphs"]["fp32"]["sha256"]
    results: list[Outcome] = []
    lock = threading.Lock()
    budget = [MAX_REQUESTS]
    end = time.monotonic() + SOAK_SECONDS
    threads = [threading.Thread(target=_worker, args=(load_server.target, seed, end, budget, results, lock))
               for seed in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(SOAK_SECONDS + 2 * CALL_TIMEOUT_S)
    assert not any(t.is_alive() for t in threads), "a load thread hung"

    # every request has exactly one outcome: sent = OK + explicit errors, lost = 0
    sent = len(results)
    ok = sum(r.code == "OK" for r in results)
    errors = sum(r.code != "OK" for r in results)
    assert sent == ok + errors and sent > 0
    unexpected = [(r.kind, r.code, r.details) for r in results if r.code not in ALLOWED[r.kind]]
    assert not unexpected, unexpected[:10]
    for r in results:
        if r.code == "INVALID_ARGUMENT":
            assert "out of range" in r.details and "sequences[0]" in r.details, r.details
        if r.kind == "poison":
            assert "injected fault" in r.details, r.details
        if r.code == "UNKNOWN":  # never
            raise AssertionError(r.details)
    # no call ran into its deadline unless it asked for a near-zero one: nothing hangs
    latencies = np.array([r.latency_s for r in results if r.kind != "deadline"])
    assert latencies.max() < CALL_TIMEOUT_S

    # every OK answer carries this model's hash; a sample is checked against PyTorch
    oks = [r for r in results if r.code == "OK" and r.response is not None]
    assert all(r.response.metadata.model_sha256 == sha for r in oks)
    assert all(len(r.response.results) == len(r.sequences) for r in oks)
    rng = np.random.default_rng(0)
    checked = 0
    for index in rng.permutation(len(oks)):
        if checked >= SPOT_CHECKS:
            break
        checked += _check_numerics(oks[index], serve_reference)

    # the server is still healthy and answers correctly after the load
    with grpc.insecure_channel(load_server.target) as channel:
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status
        assert status == health_pb2.HealthCheckResponse.SERVING
    assert load_server.proc.poll() is None
    assert "event=unexpected_error" not in load_server.log()

    by_code: dict[str, int] = {}
    for r in results:
        by_code[r.code] = by_code.get(r.code, 0) + 1
    p50, p99 = np.percentile(latencies, [50, 99])
    count(load_sent=sent, load_ok=ok, load_errors=errors, load_lost=0, load_checked_vs_pytorch=checked,
          faults_survived=sum(r.kind in ("poison", "cancel", "deadline") for r in results))
    LATENCY.update(load_p50_ms=f"{p50 * 1e3:.1f}", load_p99_ms=f"{p99 * 1e3:.1f}",
                   load_max_ms=f"{latencies.max() * 1e3:.1f}",
                   load_rps=f"{sent / SOAK_SECONDS:.0f}")
    print(f"\nload: {SOAK_SECONDS:.0f}s x {THREADS} threads: sent={sent} ok={ok} errors={errors} lost=0 "
          f"by_code={by_code} checked_vs_pytorch={checked} p50={p50 * 1e3:.1f}ms p99={p99 * 1e3:.1f}ms "
          f"max={latencies.max() * 1e3:.1f}ms")
