"""The KServe v2 / Open Inference Protocol endpoint, driven by the real tritonclient.grpc client
against `python -m serve` in a subprocess: same numbers as Encode, mask choice as parameters.

Every test that calls the endpoint runs on both transports (serve/transport/): native (gRPC C++) and
grpcio, which must behave the same in every respect the protocol shows (numbers, errors, metrics,
parameters)."""

from __future__ import annotations

import re

import numpy as np
import pytest

grpcclient = pytest.importorskip("tritonclient.grpc")
from tritonclient.utils import InferenceServerException  # noqa: E402

from model.mask_kinds import MaskKind  # noqa: E402
from tests.conftest import TRANSPORTS  # noqa: E402

ATOL, RTOL = 1e-5, 1e-5  # same server, same graph: v2 and Encode agree to float noise
REF_ATOL = 1e-4  # vs PyTorch: the export's fp32 tolerance


@pytest.fixture(scope="module", params=TRANSPORTS)
def server(request, serve_start, serve_export_dir):
    return serve_start(serve_export_dir, "--transport", request.param)


@pytest.fixture(scope="module")
def target(server) -> str:
    return server.target


@pytest.fixture(scope="module")
def v2(target):
    client = grpcclient.InferenceServerClient(url=target)
    yield client
    client.close()


@pytest.fixture(scope="module")
def encoder(server):
    from client import EncoderClient

    return EncoderClient(server.target)


def infer(client, ids: np.ndarray, *, attention=None, custom=None, outputs=("last_hidden_state", "embeddings"),
          dtype="INT64", **parameters):
    """ModelInfer on the test model: ids (and attention) as `dtype` (INT64 or INT32)."""
    numpy_dtype = np.int64 if dtype == "INT64" else np.int32
    inputs = [grpcclient.InferInput("input_ids", list(ids.shape), dtype)]
    inputs[0].set_data_from_numpy(ids.astype(numpy_dtype))
    if attention is not None:
        inputs.append(grpcclient.InferInput("attention_mask", list(attention.shape), dtype))
        inputs[-1].set_data_from_numpy(attention.astype(numpy_dtype))
    if custom is not None:
        inputs.append(grpcclient.InferInput("custom_mask", list(custom.shape), "BOOL"))
        inputs[-1].set_data_from_numpy(custom)
    requested = [grpcclient.InferRequestedOutput(name) for name in outputs]
    return client.infer("serve-test", inputs, outputs=requested, parameters=parameters or None)


def test_server_and_model_are_live_ready_and_described(v2):
    assert v2.is_server_live()
    assert v2.is_server_ready()
    assert v2.is_model_ready("serve-test")
    assert not v2.is_model_ready("some-other-model")
    assert v2.get_server_metadata().name == "onnx-encoder-service"
    meta = v2.get_model_metadata("serve-test")
    assert meta.platform == "onnxruntime_onnx" and list(meta.versions) == ["1"]
    assert [(i.name, i.datatype, list(i.shape)) for i in meta.inputs] == [
        ("input_ids", "INT64", [-1, -1]), ("attention_mask", "INT64", [-1, -1]), ("custom_mask", "BOOL", [-1, -1, -1])]
    assert [(o.name, list(o.shape)) for o in meta.outputs] == [
        ("last_hidden_state", [-1, -1, 32]), ("embeddings", [-1, 32])]


def test_model_infer_equals_encode_and_pytorch(v2, encoder, serve_reference):
    ids = np.array([[5, 17, 3, 99, 42, 7]], np.int64)
    result = infer(v2, ids)
    hidden, pooled = result.as_numpy("last_hidden_state"), result.as_numpy("embeddings")
    assert hidden.shape == (1, 6, 32) and hidden.dtype == np.float32
    assert pooled.shape == (1, 32) and pooled.dtype == np.float32
    out = encoder.encode([ids[0]], hidden_states=True)
    np.testing.assert_allclose(hidden[0], out.hidden_states[0], atol=ATOL, rtol=RTOL)
    np.testing.assert_allclose(pooled, out.embeddings, atol=ATOL, rtol=RTOL)
    ref_hidden, ref_pooled = serve_reference(ids[0])
    np.testing.assert_allclose(hidden[0], ref_hidden, atol=REF_ATOL, rtol=0)
    np.testing.assert_allclose(pooled[0], ref_pooled, atol=REF_ATOL, rtol=0)


@pytest.mark.parametrize("kind,params", [
    (MaskKind.CAUSAL, {}),
    (MaskKind.SLIDING_WINDOW, {"window": 2, "causal": True}),
    (MaskKind.DILATED, {"step": 3}),
    (MaskKind.LOCAL_STRIDED, {"window": 1, "step": 4}),
])
def test_mask_choice_travels_as_request_parameters(v2, encoder, kind, params):
    ids = np.array([[1, 2, 3, 4, 5, 6, 7, 8, 9]], np.int64)
    result = infer(v2, ids, mask_kind=kind.label, **params)
    out = encoder.encode([ids[0]], mask=kind.label, hidden_states=True, **params)
    np.testing.assert_allclose(result.as_numpy("last_hidden_state")[0], out.hidden_states[0], atol=ATOL, rtol=RTOL)
    # and the kind changes the numbers (the parameter is not ignored)
    plain = infer(v2, ids).as_numpy("last_hidden_state")
    assert not np.allclose(plain, result.as_numpy("last_hidden_state"), atol=1e-4)


def test_custom_mask_is_an_extra_input_tensor(v2, encoder):
    ids = np.array([[4, 8, 15, 16, 23]], np.int64)
    custom = np.random.default_rng(3).random((5, 5)) < 0.5
    result = infer(v2, ids, custom=custom, mask_kind="custom")
    out = encoder.encode([ids[0]], mask="custom", custom=custom, hidden_states=True)
    np.testing.assert_allclose(result.as_numpy("last_hidden_state")[0], out.hidden_states[0], atol=ATOL, rtol=RTOL)


def test_padded_batch_rows_equal_each_row_alone(v2, encoder):
    ids = np.array([[5, 6, 7, 8, 9, 10], [11, 12, 13, 0, 0, 0]], np.int64)
    attention = np.array([[1] * 6, [1, 1, 1, 0, 0, 0]], np.int64)
    result = infer(v2, ids, attention=attention)
    hidden, pooled = result.as_numpy("last_hidden_state"), result.as_numpy("embeddings")
    assert hidden.shape == (2, 6, 32)
    alone = encoder.encode([ids[1, :3]], hidden_states=True)
    np.testing.assert_allclose(hidden[1, :3], alone.hidden_states[0], atol=ATOL, rtol=RTOL)
    np.testing.assert_allclose(pooled[1], alone.embeddings[0], atol=ATOL, rtol=RTOL)
    assert not hidden[1, 3:].any()  # padded positions are zeros


def test_only_requested_outputs_are_returned(v2):
    result = infer(v2, np.array([[1, 2, 3]], np.int64), outputs=("embeddings",))
    assert result.as_numpy("last_hidden_state") is None
    assert result.as_numpy("embeddings").shape == (1, 32)


def test_dimensions_keep_the_first_values_of_the_embeddings_as_encode_does(v2, encoder):
    ids = np.array([[1, 2, 3, 4]], np.int64)
    cut = infer(v2, ids, outputs=("embeddings",), dimensions=8, normalize=True).as_numpy("embeddings")
    full = encoder.encode([ids[0]], normalize=True).embeddings
    assert cut.shape == (1, 8)
    np.testing.assert_allclose(cut, full[:, :8] / np.linalg.norm(full[:, :8], axis=1, keepdims=True),
                               atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("params,match", [
    ({"mask_kind": "zigzag"}, "mask_kind"),
    ({"mask_kind": "sliding_window", "window": 10_000}, "window"),
    ({"pooling": "max"}, "pooling"),
    ({"dimensions": 33}, r"dimensions: 33 out of range \[1, 32\]"),
])
def test_bad_parameters_are_invalid_argument(v2, params, match):
    with pytest.raises(InferenceServerException, match=match) as info:
        infer(v2, np.array([[1, 2, 3]], np.int64), **params)
    assert info.value.status() == "StatusCode.INVALID_ARGUMENT"


def test_a_64_kib_model_name_is_not_found_with_the_name_clipped(server, target):
    from serve.errors import MAX_MESSAGE_BYTES

    code, details, _ = _v2_call(target, _v2_request(IDS, model=BIG))
    assert code == "NOT_FOUND", (code, details[:300])
    assert "…(65536 bytes) is not served here; this server serves 'serve-test'" in details
    assert len(details.encode()) <= MAX_MESSAGE_BYTES + 64


def test_unknown_model_is_not_found_and_out_of_range_ids_are_rejected(v2):
    with pytest.raises(InferenceServerException, match="not served here") as info:
        v2.get_model_metadata("nope")
    assert info.value.status() == "StatusCode.NOT_FOUND"
    with pytest.raises(InferenceServerException, match="out of range"):
        infer(v2, np.array([[1, 2, 100_000]], np.int64))


def _sample(metrics: str, name: str) -> float:
    match = re.search(rf"^{name} (\S+)$", metrics, re.M)
    assert match, f"{name} not in the metrics"
    return float(match.group(1))


def test_v2_requests_are_counted_in_metrics_with_their_queue_time_and_sequences(server, v2):
    before = server.metrics()
    infer(v2, np.array([[1, 2, 3], [4, 5, 6]], np.int64))
    after = server.metrics()
    assert re.search(r'^encoder_requests_total\{code="OK",method="v2.ModelInfer"\} [1-9]', after, re.M)
    assert _sample(after, "encoder_queue_seconds_count") == _sample(before, "encoder_queue_seconds_count") + 1
    assert _sample(after, "encoder_sequences_total") == _sample(before, "encoder_sequences_total") + 2


def test_v2_responses_carry_the_batch_they_ran_in_as_parameters(v2):
    """As Encode's ResponseMetadata: rows and padded length of the run, and the provider that ran it."""
    parameters = infer(v2, np.array([[1, 2, 3], [4, 5, 6]], np.int64)).get_response().parameters
    assert parameters["batch_size"].int64_param == 2
    assert parameters["batch_sequence_length"].int64_param == 3
    assert parameters["execution_provider"].string_param == "CPUExecutionProvider"


# --- the BYTES `texts` input, decoded (serve/kserve.texts_from_v2; served texts: test_text_serving.py) ---
def _texts_tensor(shape, contents=()):
    from serve.protocols.kserve_v2 import M

    tensor = M["ModelInferRequest"].InferInputTensor(name="texts", datatype="BYTES", shape=shape)
    tensor.contents.bytes_contents.extend(contents)
    return tensor


def _length_prefixed(*items: bytes) -> bytes:
    return b"".join(len(item).to_bytes(4, "little") + item for item in items)


def test_texts_come_from_typed_contents_or_length_prefixed_raw_bytes():
    from serve.protocols.kserve_v2 import texts_from_v2

    assert texts_from_v2(_texts_tensor([2], ["héllo".encode(), b"x"]), None) == ("héllo", "x")
    assert texts_from_v2(_texts_tensor([2]), _length_prefixed("héllo".encode(), b"")) == ("héllo", "")


@pytest.mark.parametrize("shape, raw, match", [
    ([2], _length_prefixed(b"ok", b"\xff\xfe"), r"inputs\[texts\]\[1\]: not valid UTF-8"),
    ([1], b"\x05\x00\x00\x00ab", r"element 0 declares 5 bytes, 2 remain"),
    ([1], _length_prefixed(b"ok") + b"\x01", r"truncated length prefix at byte 6"),
    ([3], _length_prefixed(b"a", b"b"), r"2 elements for shape \[3\]"),
    ([1, 2], _length_prefixed(b"a", b"b"), r"shape: 2 dimensions; inputs\[texts\] must be of shape \[B\]"),
])
def test_malformed_texts_name_the_input_and_what_is_wrong(shape, raw, match):
    from serve.errors import ValidationError
    from serve.protocols.kserve_v2 import texts_from_v2

    with pytest.raises(ValidationError, match=match):
        texts_from_v2(_texts_tensor(shape), raw)


def test_texts_to_a_model_without_tokenizer_is_an_unknown_input(v2):
    texts = grpcclient.InferInput("texts", [1], "BYTES")
    texts.set_data_from_numpy(np.array([b"hello"], dtype=np.object_))
    with pytest.raises(InferenceServerException, match="unknown input.*texts"):
        v2.infer("serve-test", [texts])


# --- ambiguous, over-ranked and oversized v2 requests, sent as raw protobuf (tritonclient cannot) ---
def _v2_call(target, request):
    import grpc

    from serve.protocols.kserve_v2 import M

    with grpc.insecure_channel(target) as channel:
        call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer",
                                   request_serializer=M["ModelInferRequest"].SerializeToString,
                                   response_deserializer=M["ModelInferResponse"].FromString)
        try:
            return "OK", "", call(request, timeout=10)
        except grpc.RpcError as error:
            return error.code().name, error.details() or "", None


def _v2_request(*inputs, raw=(), model="serve-test", outputs=(), **parameters):
    """inputs: (name, datatype, shape, typed values or None)."""
    from serve.protocols.kserve_v2 import CONTENTS_FIELD, M

    request = M["ModelInferRequest"](model_name=model)
    for name, datatype, shape, values in inputs:
        tensor = request.inputs.add(name=name, datatype=datatype, shape=shape)
        if values is not None:
            getattr(tensor.contents, CONTENTS_FIELD.get(datatype, "bytes_contents")).extend(values)
    request.raw_input_contents.extend(raw)
    for name in outputs:
        request.outputs.add(name=name)
    for key, value in parameters.items():
        request.parameters[key].string_param = value
    return request


IDS = ("input_ids", "INT64", [1, 3], [1, 2, 3])
RAW_IDS = np.array([[4, 5, 6]], "<i8").tobytes()
BIG = "x" * 65536
V2_BAD = {
    "typed and raw contents on one input": (
        _v2_request(IDS, raw=[RAW_IDS]), "inputs[input_ids]: typed contents and raw_input_contents"),
    "an input given twice": (
        _v2_request(IDS, ("input_ids", "INT64", [1, 3], [7, 8, 9])), "inputs[input_ids]: given 2 times"),
    "an input given twice, raw": (
        _v2_request(IDS[:3] + (None,), IDS[:3] + (None,), raw=[RAW_IDS, RAW_IDS]), "inputs[input_ids]: given 2 times"),
    "fewer raw contents than inputs": (
        _v2_request(IDS[:3] + (None,), ("attention_mask", "INT64", [1, 3], None), raw=[RAW_IDS]),
        "raw_input_contents: 1 entries for 2 inputs"),
    "an output asked for twice": (
        _v2_request(IDS, outputs=("embeddings", "embeddings")), "outputs[embeddings]: requested 2 times"),
    "65-d typed ids": (
        _v2_request(("input_ids", "INT64", [1] * 65, [1])), "inputs[input_ids].shape: 65 dimensions"),
    "65-d raw ids": (
        _v2_request(("input_ids", "INT64", [1] * 65, None), raw=[np.int64(1).tobytes()]),
        "inputs[input_ids].shape: 65 dimensions; inputs[input_ids] must be of shape [B, T]"),
    "65-d custom mask": (
        _v2_request(IDS, ("custom_mask", "BOOL", [1] * 65, [True]), mask_kind="custom"),
        "inputs[custom_mask].shape: 65 dimensions"),
    "64 KiB input name": (_v2_request(IDS, (BIG, "INT64", [1, 3], [1, 2, 3])), "unknown input(s) 'xxx"),
    "64 KiB mask_kind": (_v2_request(IDS, mask_kind=BIG), "parameters.mask_kind: unknown value 'xxx"),
    "64 KiB pooling": (_v2_request(IDS, pooling=BIG), "…(65536 bytes) is not one of"),
    "64 KiB window": (_v2_request(IDS, window="9" * 65536), "parameters.window: expected an integer"),
    "64 KiB datatype": (_v2_request(("input_ids", BIG, [1, 3], None)), "…(65536 bytes) is not supported"),
    "10000 unknown inputs": (_v2_request(*[(f"in{i}", "INT64", [1], [1]) for i in range(10000)]),
                             "and 9995 more"),
}
V2_BAD["values in another datatype's field"] = (
    _v2_request(("input_ids", "INT64", [1, 2], None)), "values in fp32_contents")
V2_BAD["values in another datatype's field"][0].inputs[0].contents.fp32_contents.extend([1.0, 2.0])


@pytest.mark.parametrize("name", sorted(V2_BAD))
def test_ambiguous_over_ranked_or_oversized_v2_requests_are_invalid_argument_naming_the_input(server, target, name):
    from serve.errors import MAX_MESSAGE_BYTES

    request, words = V2_BAD[name]
    code, details, _ = _v2_call(target, request)
    assert code == "INVALID_ARGUMENT", (code, details[:300])
    assert words in details, details[:300]
    assert len(details.encode()) <= MAX_MESSAGE_BYTES + 64
    assert "event=unexpected_error" not in server.log()


def test_v2_custom_mask_for_rows_of_unequal_length_equals_encode(server, v2, encoder):
    ids = np.array([[5, 6, 7, 8, 9, 10], [11, 12, 13, 0, 0, 0]], np.int64)
    attention = np.array([[1] * 6, [1, 1, 1, 0, 0, 0]], np.int64)
    custom = np.random.default_rng(4).random((2, 6, 6)) < 0.5
    np.fill_diagonal(custom[0], True)
    result = infer(v2, ids, attention=attention, custom=custom, mask_kind="custom")
    hidden = result.as_numpy("last_hidden_state")
    for row, n in enumerate((6, 3)):
        alone = encoder.encode([ids[row, :n]], mask="custom", custom=custom[row, :n, :n], hidden_states=True)
        np.testing.assert_allclose(hidden[row, :n], alone.hidden_states[0], atol=ATOL, rtol=RTOL)
    # one [T, T] matrix for every row, in the ids' padded coordinates
    shared = infer(v2, ids, attention=attention, custom=custom[0], mask_kind="custom").as_numpy("last_hidden_state")
    alone = encoder.encode([ids[1, :3]], mask="custom", custom=custom[0, :3, :3], hidden_states=True)
    np.testing.assert_allclose(shared[1, :3], alone.hidden_states[0], atol=ATOL, rtol=RTOL)
