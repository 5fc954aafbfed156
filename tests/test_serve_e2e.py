"""End to end: the real `python -m serve` subprocess, called over a real gRPC channel."""

from __future__ import annotations

import re
import threading

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from export.contract import FP32_TOLERANCE
from model.mask_kinds import MaskKind
from client import EncoderClient, build_request
from serve.protocols.pb import pb
from serve.protocols.tensors import from_numpy
from tests.concurrency import call_concurrently

ATOL = FP32_TOLERANCE["limit"]
MAX_REQUEST_BYTES = 65536
MAX_SEQUENCES = 8
LENGTHS = [5, 17, 1, 40]


@pytest.fixture(scope="module")
def server(serve_start, serve_export_dir):
    # the split's per-run cost pinned high: measured at start, a busy machine's low figure made the batcher
    # run the concurrent test's mixed lengths one row per run (length_split has split_server below)
    process = serve_start(serve_export_dir, "--max-queue-delay-ms", "30", "--max-batch-size", "32",
                          "--split-overhead-tokens", "100000", "--max-sequences-per-request", str(MAX_SEQUENCES),
                          "--max-request-bytes", str(MAX_REQUEST_BYTES))
    yield process
    assert process.terminate() == 0, process.log()


@pytest.fixture(scope="module")
def client(server):
    with EncoderClient(server.target, timeout=30, retries=0) as c:
        yield c


def _ids(length: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 100, length).astype(np.int64)


MASKS = [
    dict(mask=MaskKind.BIDIRECTIONAL),
    dict(mask=MaskKind.CAUSAL),
    dict(mask=MaskKind.SLIDING_WINDOW, window=2),
    dict(mask=MaskKind.SLIDING_WINDOW, window=3, causal=True),
    dict(mask=MaskKind.DILATED, step=3),
    dict(mask=MaskKind.DILATED, step=2, causal=True),
    dict(mask=MaskKind.LOCAL_STRIDED, window=1, step=4),
    dict(mask=MaskKind.LOCAL_STRIDED, window=2, step=5, causal=True),
]


def _label(options: dict) -> str:
    return "-".join(f"{k}={v.label if isinstance(v, MaskKind) else v}" for k, v in options.items())


def _ref_kwargs(options: dict) -> dict:
    return dict(kind=options["mask"], window=options.get("window", 0), step=options.get("step", 1) or 1,
                causal=options.get("causal", False))


@pytest.mark.parametrize("options", MASKS, ids=_label)
def test_every_mask_kind_over_mixed_lengths_matches_pytorch(client, serve_reference, options):
    sequences = [_ids(n, seed) for seed, n in enumerate(LENGTHS)]
    out = client.encode(sequences, hidden_states=True, pooling="mean", **options)
    assert out.embeddings.shape == (len(LENGTHS), 32) and out.embeddings.dtype == np.float32
    for seq, hidden, embedding in zip(sequences, out.hidden_states, out.embeddings):
        ref_hidden, ref_mean = serve_reference(seq, **_ref_kwargs(options))
        assert hidden.shape == ref_hidden.shape and hidden.dtype == np.float32
        np.testing.assert_allclose(hidden, ref_hidden, atol=ATOL, rtol=0)
        np.testing.assert_allclose(embedding, ref_mean, atol=ATOL, rtol=0)


@pytest.mark.parametrize("per_sequence", [False, True], ids=["TxT", "BxTxT"])
def test_custom_mask_matches_pytorch(client, serve_reference, per_sequence):
    length, count = 12, 3
    rng = np.random.default_rng(7)
    customs = rng.random((count, length, length)) < 0.4
    custom = customs if per_sequence else customs[0]
    sequences = [_ids(length, 10 + i) for i in range(count)]
    out = client.encode(sequences, mask="custom", custom=custom, hidden_states=True)
    for i, (seq, hidden) in enumerate(zip(sequences, out.hidden_states)):
        ref_hidden, ref_mean = serve_reference(seq, MaskKind.CUSTOM, custom=customs[i] if per_sequence else custom)
        np.testing.assert_allclose(hidden, ref_hidden, atol=ATOL, rtol=0)
        np.testing.assert_allclose(out.embeddings[i], ref_mean, atol=ATOL, rtol=0)


def test_custom_masks_for_sequences_of_unequal_length_padded_to_the_longest_match_pytorch(client, serve_reference):
    lengths = (12, 5, 9)
    customs = np.random.default_rng(8).random((len(lengths), 12, 12)) < 0.4  # [B, Tmax, Tmax]
    customs[1, :, 5:] = True  # entries past a row's length are ignored, whatever they hold
    sequences = [_ids(n, 20 + i) for i, n in enumerate(lengths)]
    out = client.encode(sequences, mask="custom", custom=customs, hidden_states=True)
    for i, (seq, hidden) in enumerate(zip(sequences, out.hidden_states)):
        n = len(seq)
        ref_hidden, ref_mean = serve_reference(seq, MaskKind.CUSTOM, custom=customs[i, :n, :n])
        assert hidden.shape == (n, 32)
        np.testing.assert_allclose(hidden, ref_hidden, atol=ATOL, rtol=0)
        np.testing.assert_allclose(out.embeddings[i], ref_mean, atol=ATOL, rtol=0)


def test_first_token_pooling_with_l2_normalisation(client, serve_reference):
    seq = _ids(9, 3)
    out = client.encode([seq], mask="causal", pooling="first", normalize=True)
    ref_hidden, _ = serve_reference(seq, MaskKind.CAUSAL)
    expected = ref_hidden[0] / np.linalg.norm(ref_hidden[0])
    np.testing.assert_allclose(out.embeddings[0], expected, atol=ATOL, rtol=0)
    assert out.hidden_states is None


def test_response_carries_request_id_model_identity_provider_and_timings(client, serve_export_dir):
    import json

    meta = json.loads((serve_export_dir / "metadata.json").read_text())
    out = client.encode([[1, 2, 3]], request_id="req-42")
    m = out.metadata
    assert out.request_id == "req-42"
    assert (m.model_name, m.model_sha256) == ("serve-test", meta["graphs"]["fp32"]["sha256"])
    assert m.execution_provider == "CPUExecutionProvider"
    assert m.batch_size >= 1 and m.timings.total_ms >= m.timings.inference_ms > 0


def _batch_size_histogram(server) -> tuple[float, float]:
    text = server.metrics()
    count = float(re.search(r"^encoder_batch_size_count (\S+)", text, re.M).group(1))
    ones = float(re.search(r'^encoder_batch_size_bucket\{le="1.0"\} (\S+)', text, re.M).group(1))
    return count, ones


def test_concurrent_mixed_mask_requests_are_batched_and_match_single_requests(client, server):
    """Requests sent at once share session.runs. Whether they arrive while a batch runs depends on the
    machine's scheduling, so a busy machine gets up to ROUNDS tries to show one shared run; every round's
    answers must equal the single requests'."""
    options = MASKS * 2
    sequences = [_ids(3 + 5 * i, 100 + i) for i in range(len(options))]
    alone = [client.encode([seq], hidden_states=True, **opt) for seq, opt in zip(sequences, options)]
    shared = False
    for _ in range(ROUNDS):
        count_before, ones_before = _batch_size_histogram(server)
        barrier = threading.Barrier(len(options))

        def call(i: int):
            barrier.wait()
            return client.encode([sequences[i]], hidden_states=True, **options[i])

        together = call_concurrently(call, len(options))
        count_after, ones_after = _batch_size_histogram(server)
        for single, batched in zip(alone, together):
            np.testing.assert_allclose(batched.hidden_states[0], single.hidden_states[0], atol=1e-5, rtol=0)
            np.testing.assert_allclose(batched.embeddings, single.embeddings, atol=1e-5, rtol=0)
        # Every request was one sequence, so fewer batches than requests means they shared session.runs.
        if (count_after - count_before < len(options)
                and (count_after - count_before) - (ones_after - ones_before) >= 1  # some batch had >1 row
                and max(out.metadata.batch_size for out in together) > 1):
            shared = True
            break
    assert shared, f"no round of {len(options)} concurrent requests shared a session.run in {ROUNDS} tries"


ROUNDS = 5


def _raw(**fields) -> pb.EncodeRequest:
    return pb.EncodeRequest(**fields)


def _ids_tensor(ids, dtype=np.int64) -> pb.Tensor:
    return from_numpy(np.asarray(ids, dtype))


BAD_REQUESTS = {
    "empty": (lambda: _raw(), "sequences"),
    "wrong_dtype": (lambda: _raw(sequences=[_ids_tensor([1, 2], np.float32)]), "sequences[0]"),
    "bytes_vs_shape": (lambda: _raw(sequences=[pb.Tensor(dtype=pb.DATA_TYPE_INT64, shape=[4], data=b"\0" * 24)]),
                       "sequences[0].data"),
    "empty_sequence": (lambda: _raw(sequences=[_ids_tensor(np.zeros(0))]), "sequences[0]"),
    "token_out_of_range": (lambda: _raw(sequences=[_ids_tensor([1, 100])]), "out of range [0, 100)"),
    "negative_token": (lambda: _raw(sequences=[_ids_tensor([1, 2]), _ids_tensor([-1])]), "sequences[1]"),
    "too_long": (lambda: _raw(sequences=[_ids_tensor(np.ones(129))]), "max_sequence_length=128"),
    "too_many_sequences": (lambda: _raw(sequences=[_ids_tensor([1])] * (MAX_SEQUENCES + 1)),
                           f"max_sequences_per_request={MAX_SEQUENCES}"),
    "window_out_of_range": (lambda: build_request([[1, 2]], mask="sliding_window", window=1000), "mask.window"),
    "step_zero": (lambda: build_request([[1, 2]], mask="dilated", step=0), "mask.step"),
    "step_out_of_range": (lambda: build_request([[1, 2]], mask="local_strided", step=500), "mask.step"),
    "unknown_mask_kind": (lambda: _raw(sequences=[_ids_tensor([1])], mask=pb.Mask(kind=42)), "mask.kind"),
    "causal_flag_with_bidirectional": (lambda: build_request([[1, 2]], causal=True), "mask.causal"),
    "custom_wrong_shape": (lambda: build_request([[1, 2, 3]], mask="custom", custom=np.ones((2, 2), bool)),
                           "mask.custom"),
    "custom_wrong_count": (lambda: build_request([[1, 2], [3, 4]], mask="custom", custom=np.ones((3, 2, 2), bool)),
                           "mask.custom"),
    "custom_missing": (lambda: build_request([[1, 2]], mask="custom"), "mask.custom"),
    "custom_without_custom_kind": (lambda: build_request([[1, 2]], mask="causal", custom=np.ones((2, 2), bool)),
                                   "mask.custom"),
    "oversized_message": (lambda: build_request([[1] * 128], mask="custom", custom=np.ones((300, 300), bool)),
                          f"max_request_bytes={MAX_REQUEST_BYTES}"),
    "texts_without_tokenizer": (lambda: _raw(texts=["hello world"]), "model has no tokenizer"),
}


@pytest.mark.parametrize("name", sorted(BAD_REQUESTS))
def test_bad_input_is_invalid_argument_naming_the_field(server, client, serve_reference, name):
    make, expected = BAD_REQUESTS[name]
    with pytest.raises(grpc.RpcError) as caught:
        client.stub.Encode(make(), timeout=10)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value.details()
    assert expected in caught.value.details()
    # ... and the server stays healthy and correct afterwards.
    seq = _ids(6, 1)
    out = client.encode([seq])
    np.testing.assert_allclose(out.embeddings[0], serve_reference(seq)[1], atol=ATOL, rtol=0)
    assert client.health() == "SERVING"


def test_stream_answers_each_request_in_order_and_reports_errors_per_item(client, serve_reference):
    requests = [build_request([_ids(4 + i, i)], request_id=f"r{i}") for i in range(5)]
    requests[2] = _raw(request_id="r2", sequences=[_ids_tensor([999])])
    responses = list(client.stub.EncodeStream(iter(requests), timeout=30))
    assert [r.response.request_id for r in responses] == [f"r{i}" for i in range(5)]
    assert responses[2].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "sequences[0]" in responses[2].error.message
    for i in (0, 1, 3, 4):
        assert responses[i].error.code == 0
        embedding = np.frombuffer(responses[i].response.results[0].embedding.data, np.float32)
        np.testing.assert_allclose(embedding, serve_reference(_ids(4 + i, i))[1], atol=ATOL, rtol=0)


def test_model_info_describes_config_graph_masks_limits_and_providers(client):
    info = client.model_info()
    assert info.name == "serve-test" and info.opset == 18 and info.input_kind == "tokens"
    assert info.d_model == info.embedding_width == 32 and info.vocab_size == 100 and not info.has_tokenizer
    assert [i.name for i in info.inputs][:2] == ["input_ids", "attention_mask"]
    assert {o.name for o in info.outputs} == {"last_hidden_state", "mean_pooled"}
    assert list(info.mask_kinds) == [k.label for k in MaskKind]
    assert info.limits.max_sequence_length == 128 and info.limits.max_sequences_per_request == MAX_SEQUENCES
    assert list(info.providers) == ["CPUExecutionProvider"]
    assert '"d_model": 32' in info.config_json


def test_health_reports_serving_for_the_server_and_the_service(server):
    with grpc.insecure_channel(server.target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", "encoder.v1.EncoderService"):
            response = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert response.status == health_pb2.HealthCheckResponse.SERVING


def _reflection(server, *requests) -> list:
    with grpc.insecure_channel(server.target) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        return list(stub.ServerReflectionInfo(iter(requests), timeout=5))


def test_reflection_lists_the_encoder_and_the_kserve_v2_services(server):
    (response,) = _reflection(server, reflection_pb2.ServerReflectionRequest(list_services=""))
    names = {s.name for s in response.list_services_response.service}
    assert {"encoder.v1.EncoderService", "inference.GRPCInferenceService", "grpc.health.v1.Health"} <= names


@pytest.mark.parametrize("service,method", [("inference.GRPCInferenceService", "ModelInfer"),
                                            ("encoder.v1.EncoderService", "Encode")])
def test_reflection_describes_each_listed_service(server, service, method):
    """What grpcurl asks for `describe` and calls: the file defining the service (the v2 one lives in
    serve/protocols/kserve_v2.py's own descriptor pool, not protobuf's default one)."""
    from google.protobuf import descriptor_pb2

    (response,) = _reflection(server, reflection_pb2.ServerReflectionRequest(file_containing_symbol=service))
    assert response.WhichOneof("message_response") == "file_descriptor_response", response
    files = [descriptor_pb2.FileDescriptorProto.FromString(raw)
             for raw in response.file_descriptor_response.file_descriptor_proto]
    package, _, name = service.rpartition(".")
    (found,) = [s for f in files if f.package == package for s in f.service if s.name == name]
    assert method in [m.name for m in found.method]


def test_metrics_count_requests_by_method_and_status(server, client):
    client.encode([[1, 2]])
    text = server.metrics()
    assert re.search(r'^encoder_requests_total\{code="OK",method="Encode"\} [1-9]', text, re.M)
    assert "encoder_queue_depth" in text and "encoder_inference_seconds_bucket" in text


# --- length-sorted runs (serve/core/batch_plan.py) ---------------------------------------------------
@pytest.fixture(scope="module")
def split_server(serve_start, serve_export_dir):
    """Batches gather for 300 ms; the per-run cost is pinned at 50 tokens, so the runs are known in
    advance: for this model (attention width 2*32+64 = 128), lengths 3 and 4 share a run, as do 100
    and 110 (splitting them saves less than a run costs), while short and long rows run apart."""
    process = serve_start(serve_export_dir, "--max-queue-delay-ms", "300", "--split-overhead-tokens", "50")
    yield process
    assert process.terminate() == 0, process.log()


def _padding_tokens(server) -> float:
    return float(re.search(r"^encoder_padding_tokens_total (\S+)", server.metrics(), re.M).group(1))


def test_a_batch_of_mixed_lengths_runs_split_by_length_and_every_result_matches_pytorch(
        split_server, serve_reference):
    lengths = [3, 110, 4, 100]
    sequences = [_ids(n, 500 + i) for i, n in enumerate(lengths)]
    padding_before = _padding_tokens(split_server)
    barrier = threading.Barrier(len(sequences))

    def call(i: int):
        with EncoderClient(split_server.target, timeout=30, retries=0) as c:
            barrier.wait()
            return c.encode([sequences[i]], hidden_states=True)

    outputs = call_concurrently(call, len(sequences))
    for seq, out in zip(sequences, outputs):
        hidden, mean = serve_reference(seq)
        np.testing.assert_allclose(out.hidden_states[0], hidden, atol=ATOL, rtol=ATOL)
        np.testing.assert_allclose(out.embeddings[0], mean, atol=ATOL, rtol=ATOL)
    # the short pair ran padded to 4 and the long pair to 110, not all four padded to 110
    assert [out.metadata.batch_sequence_length for out in outputs] == [4, 110, 4, 110]
    assert _padding_tokens(split_server) - padding_before == (4 - 3) + (110 - 100)


# --- instances: batches run at once (ServerConfig.instances) ------------------------------------
def test_a_server_with_two_instances_answers_concurrent_requests_as_pytorch_does(serve_start, serve_export_dir,
                                                                                 serve_reference):
    process = serve_start(serve_export_dir, "--instances", "2", "--max-queue-delay-ms", "0")
    try:
        lengths = [3, 17, 40, 8, 25, 1]
        sequences = [_ids(n, 700 + i) for i, n in enumerate(lengths)]
        barrier = threading.Barrier(len(sequences))

        def call(i: int):
            with EncoderClient(process.target, timeout=30, retries=0) as c:
                barrier.wait()
                return c.encode([sequences[i]], hidden_states=True)

        for seq, out in zip(sequences, call_concurrently(call, len(sequences))):
            hidden, mean = serve_reference(seq)
            np.testing.assert_allclose(out.hidden_states[0], hidden, atol=ATOL, rtol=ATOL)
            np.testing.assert_allclose(out.embeddings[0], mean, atol=ATOL, rtol=ATOL)
    finally:
        assert process.terminate() == 0, process.log()


def test_a_lone_request_split_into_runs_on_two_instances_matches_pytorch_row_by_row(
        serve_start, serve_export_dir, serve_reference):
    """Two run slots split the CPUs, so a lone request that splits into two runs runs both at once on the narrow
    session (serve/core/runs.py; on a 1-CPU host, one after another): every row as PyTorch computes it, and each
    run padded only to its own longest row (the per-run cost pinned as in split_server)."""
    process = serve_start(serve_export_dir, "--instances", "2", "--split-overhead-tokens", "50")
    try:
        lengths = [3, 110, 4, 100]
        sequences = [_ids(n, 900 + i) for i, n in enumerate(lengths)]
        padding_before = _padding_tokens(process)
        with EncoderClient(process.target, timeout=30, retries=0) as c:
            out = c.encode(sequences, hidden_states=True)
        for i, seq in enumerate(sequences):
            hidden, mean = serve_reference(seq)
            np.testing.assert_allclose(out.hidden_states[i], hidden, atol=ATOL, rtol=ATOL)
            np.testing.assert_allclose(out.embeddings[i], mean, atol=ATOL, rtol=ATOL)
        assert out.metadata.batch_sequence_length == 110
        assert _padding_tokens(process) - padding_before == (4 - 3) + (110 - 100)
    finally:
        assert process.terminate() == 0, process.log()
