"""A corpus of malformed and hostile requests against the real server: each gets its expected status
and a message naming the problem, and after each the server is healthy and still answers correctly.
Then property-based fuzzing (hypothesis, bounded): every response is OK or a clean INVALID_ARGUMENT.

Requests go out as raw bytes through a generic `channel.unary_unary` (identity serialisers), so
the corpus can also hold bytes that are not protobuf at all.
"""

from __future__ import annotations

import struct

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from export.contract import FP32_TOLERANCE
from serve.errors import MAX_MESSAGE_BYTES
from serve.protocols.pb import pb
from tests.reliability_common import count

ATOL = FP32_TOLERANCE["limit"]

ENCODE = "/encoder.v1.EncoderService/Encode"
MAX_SEQUENCES = 4
MAX_REQUEST_BYTES = 65536
MAX_REQUEST_TOKENS = 300
MAX_LEN = 128  # serve_export_dir: max_positions=128, vocab_size=100, d_model=32
VOCAB = 100
FEATURES_D = 16  # serve_features_export_dir
INVALID = grpc.StatusCode.INVALID_ARGUMENT
CHECK_IDS = np.array([3, 1, 4, 1, 5, 9, 2, 6], np.int64)


def T(dtype: int, shape: list[int], data: bytes) -> "pb.Tensor":
    return pb.Tensor(dtype=dtype, shape=shape, data=data)


def ids(values, dtype="<i8") -> "pb.Tensor":
    array = np.asarray(values, dtype)
    code = pb.DATA_TYPE_INT64 if array.dtype.itemsize == 8 else pb.DATA_TYPE_INT32
    return T(code, list(array.shape), array.tobytes())


def req(*sequences, kind=0, causal=False, window=0, step=0, custom=None, pooling=0, **extra) -> bytes:
    msg = pb.EncodeRequest(sequences=list(sequences),
                           mask=pb.Mask(kind=kind, causal=causal, window=window, step=step),
                           output=pb.OutputOptions(pooling=pooling), **extra)
    if custom is not None:
        msg.mask.custom.CopyFrom(custom)
    return msg.SerializeToString()


def boolean(shape) -> "pb.Tensor":
    return T(pb.DATA_TYPE_BOOL, list(shape), np.ones(shape, bool).tobytes())


def features(array) -> "pb.Tensor":
    array = np.asarray(array, "<f4")
    return T(pb.DATA_TYPE_FLOAT32, list(array.shape), array.tobytes())


OK3 = ids([1, 2, 3])
# (name, model, request bytes, expected status, words the message must contain)
CASES = [
    ("empty request", "tokens", req(), INVALID, "empty request"),
    ("empty sequence", "tokens", req(ids(np.zeros(0, np.int64))), INVALID, "empty sequence"),
    ("float32 ids", "tokens", req(features([1.0, 2.0])), INVALID, "sequences[0]: token ids must be INT64 or INT32"),
    ("bool ids", "tokens", req(boolean([3])), INVALID, "token ids must be INT64 or INT32"),
    ("unspecified dtype", "tokens", req(T(0, [1], b"\0" * 8)), INVALID, "DATA_TYPE_UNSPECIFIED is not supported"),
    ("unknown dtype enum", "tokens", req(T(42, [1], b"\0" * 8)), INVALID, "DataType(42) is not supported"),
    ("bytes shorter than shape", "tokens", req(T(pb.DATA_TYPE_INT64, [3], b"\0" * 16)), INVALID, "needs 24"),
    ("bytes longer than shape", "tokens", req(T(pb.DATA_TYPE_INT64, [1], b"\0" * 9)), INVALID, "needs 8"),
    ("no bytes", "tokens", req(T(pb.DATA_TYPE_INT64, [3], b"")), INVALID, "sequences[0].data: 0 bytes"),
    ("negative dimension", "tokens", req(T(pb.DATA_TYPE_INT64, [-1], b"")), INVALID, "negative dimension"),
    ("huge dimension", "tokens", req(T(pb.DATA_TYPE_INT64, [2 ** 40], b"\0" * 8)), INVALID, "sequences[0].data"),
    ("overflowing shape", "features", req(T(pb.DATA_TYPE_FLOAT32, [2 ** 62, 2 ** 62], b"\0" * 8)), INVALID,
     "needs"),
    ("2-d ids", "tokens", req(ids([[1, 2], [3, 4]])), INVALID, "of shape [T]"),
    ("features [T, d] to a token model", "tokens", req(features(np.ones((3, FEATURES_D)))), INVALID,
     "sequences[0]: token ids must be INT64 or INT32 of shape [T], got float32 [3, "),
    ("negative id", "tokens", req(ids([1, -1])), INVALID, "token id -1 out of range [0, 100)"),
    ("id == vocab_size", "tokens", req(ids([VOCAB])), INVALID, "token id 100 out of range"),
    ("huge id", "tokens", req(ids([2 ** 62])), INVALID, f"token id {2 ** 62} out of range"),
    ("int32 min id", "tokens", req(ids([-(2 ** 31)], "<i4")), INVALID, "out of range"),
    ("id out of range in 2nd sequence", "tokens", req(OK3, ids([7, 500])), INVALID, "sequences[1]: token id 500"),
    ("over-long sequence", "tokens", req(ids(np.ones(MAX_LEN + 1, np.int64))), INVALID, "max_sequence_length=128"),
    ("too many sequences", "tokens", req(*[OK3] * (MAX_SEQUENCES + 1)), INVALID, "max_sequences_per_request=4"),
    ("work over max_request_tokens", "tokens", req(*[ids(np.ones(100, np.int64))] * 4), INVALID,
     "max_request_tokens=300"),
    ("custom mask wrong shape", "tokens", req(OK3, kind=5, custom=boolean([3, 4])), INVALID,
     "mask.custom: shape [3, 4] does not match sequences[0]"),
    ("custom mask wrong dtype", "tokens", req(OK3, kind=5, custom=ids(np.ones((3, 3), np.int64))), INVALID,
     "mask.custom: dtype must be BOOL"),
    ("custom mask missing", "tokens", req(OK3, kind=5), INVALID, "kind=custom needs"),
    ("custom mask on another kind", "tokens", req(OK3, kind=0, custom=boolean([3, 3])), INVALID,
     "only used with kind=custom"),
    ("custom mask batch mismatch", "tokens", req(OK3, OK3, kind=5, custom=boolean([3, 3, 3])), INVALID,
     "must be [2, 3, 3]: one matrix per sequence"),
    ("custom mask 4-d", "tokens", req(OK3, kind=5, custom=boolean([1, 1, 3, 3])), INVALID,
     "mask.custom.shape: 4 dimensions; mask.custom must be of shape [T, T] or [B, T, T]"),
    ("padded custom mask of the wrong size", "tokens", req(OK3, ids([1, 2]), kind=5, custom=boolean([2, 2, 2])),
     INVALID, "mask.custom: shape [2, 2, 2] must be [2, 3, 3]"),
    ("65-d custom mask", "tokens", req(OK3, kind=5, custom=T(pb.DATA_TYPE_BOOL, [1] * 65, b"\1")), INVALID,
     "mask.custom.shape: 65 dimensions"),
    ("65-d ids", "tokens", req(T(pb.DATA_TYPE_INT64, [1] * 65, b"\0" * 8)), INVALID,
     "sequences[0].shape: 65 dimensions; sequences[0] must be of shape [T]"),
    ("20000-d ids", "tokens", req(T(pb.DATA_TYPE_INT64, [1] * 20000, b"\0" * 8)), INVALID,
     "sequences[0].shape: 20000 dimensions"),
    ("65-d features", "features", req(T(pb.DATA_TYPE_FLOAT32, [1] * 65, b"\0" * 4)), INVALID,
     f"sequences[0].shape: 65 dimensions; sequences[0] must be of shape [T, {FEATURES_D}]"),
    ("custom mask bytes mismatch", "tokens", req(OK3, kind=5, custom=T(pb.DATA_TYPE_BOOL, [3, 3], b"\1" * 8)),
     INVALID, "mask.custom.data"),
    ("bool mask bytes not 0 or 1", "tokens", req(OK3, kind=5, custom=T(pb.DATA_TYPE_BOOL, [3, 3], b"\1\2" + b"\1" * 7)),
     INVALID, "BOOL elements must be bytes 0 or 1"),
    ("unknown mask kind", "tokens", req(OK3, kind=17), INVALID, "mask.kind: unknown value 17"),
    ("negative mask kind", "tokens", req(OK3, kind=-3), INVALID, "mask.kind: unknown value -3"),
    ("absurd window", "tokens", req(OK3, kind=2, window=2 ** 32 - 1), INVALID, "mask.window: 4294967295 out of range"),
    ("step zero for dilated", "tokens", req(OK3, kind=3, step=0), INVALID, "mask.step: 0 out of range"),
    ("absurd step", "tokens", req(OK3, kind=4, window=1, step=2 ** 31), INVALID, "mask.step"),
    ("causal flag on bidirectional", "tokens", req(OK3, kind=0, causal=True), INVALID, "mask.causal"),
    ("causal flag on custom", "tokens", req(OK3, kind=5, causal=True, custom=boolean([3, 3])), INVALID,
     "mask.causal"),
    ("unknown pooling", "tokens", req(OK3, pooling=9), INVALID, "output.pooling: unknown value 9"),
    ("texts on a model without tokenizer", "tokens", req(texts=["hello"]), INVALID, "texts"),
    ("over max_request_bytes", "tokens", req(ids(np.ones(MAX_LEN, np.int64)),
                                             T(pb.DATA_TYPE_INT64, [9000], b"\0" * 72000)), INVALID,
     "max_request_bytes=65536"),
    ("grossly oversized message", "tokens", req(T(pb.DATA_TYPE_INT64, [300000], b"\0" * 2_400_000)),
     grpc.StatusCode.RESOURCE_EXHAUSTED, "larger than max"),
    ("not protobuf", "tokens", b"\xff\xff\xff\xff", INVALID, "not a valid protobuf request"),
    ("truncated protobuf", "tokens", req(OK3)[:-3], INVALID, "not a valid protobuf request"),
    ("wrong wire type", "tokens", b"\x12\x05\x08", INVALID, "not a valid protobuf request"),
    ("NaN features", "features", req(features(np.full((2, FEATURES_D), np.nan))), INVALID,
     "sequences[0]: features contain NaN or infinity"),
    ("+Inf features", "features", req(features([[np.inf] * FEATURES_D])), INVALID, "NaN or infinity"),
    ("-Inf features in 2nd sequence", "features",
     req(features(np.zeros((1, FEATURES_D))), features([[-np.inf] + [0.0] * (FEATURES_D - 1)])), INVALID,
     "sequences[1]: features contain NaN or infinity"),
    ("finite features that overflow the model", "features", req(features(np.full((3, FEATURES_D), 3e38))),
     INVALID, "sequences[0]: the model's output is NaN or infinite"),
    ("features of wrong width", "features", req(features(np.zeros((3, FEATURES_D - 1)))), INVALID,
     f"FLOAT32 [T, {FEATURES_D}]"),
    ("token ids to a features model", "features", req(OK3), INVALID, "raw features"),
    ("1-d features", "features", req(features(np.zeros(FEATURES_D))), INVALID, "raw features"),
]


@pytest.fixture(scope="module")
def servers(serve_start, serve_export_dir, serve_features_export_dir):
    flags = ("--max-sequences-per-request", str(MAX_SEQUENCES), "--max-request-bytes", str(MAX_REQUEST_BYTES),
             "--max-request-tokens", str(MAX_REQUEST_TOKENS))
    running = {"tokens": serve_start(serve_export_dir, *flags),
               "features": serve_start(serve_features_export_dir, *flags)}
    channels = {name: grpc.insecure_channel(p.target) for name, p in running.items()}
    yield running, channels
    for channel in channels.values():
        channel.close()
    for p in running.values():
        assert p.terminate() == 0, p.log()


@pytest.fixture(scope="module")
def expected(serve_reference, serve_features_export_dir):
    """The answers of the post-case correctness checks: PyTorch for tokens; for features, the
    first answer (compared with itself after every case: the server must not drift or break)."""
    return {"tokens": serve_reference(CHECK_IDS)[1]}


def _raw(channel, payload: bytes, timeout: float = 10):
    call = channel.unary_unary(ENCODE)  # no serialisers: bytes in, bytes out
    try:
        return grpc.StatusCode.OK, "", pb.EncodeResponse.FromString(call(payload, timeout=timeout))
    except grpc.RpcError as error:
        return error.code(), error.details() or "", None


def _healthy_and_correct(servers, expected, model: str) -> None:
    running, channels = servers
    assert running[model].proc.poll() is None, running[model].log()
    status = health_pb2_grpc.HealthStub(channels[model]).Check(health_pb2.HealthCheckRequest(), timeout=5).status
    assert status == health_pb2.HealthCheckResponse.SERVING
    if model == "tokens":
        code, details, response = _raw(channels[model], req(ids(CHECK_IDS)))
        assert code == grpc.StatusCode.OK, details
        got = np.frombuffer(response.results[0].embedding.data, "<f4")
        np.testing.assert_allclose(got, expected["tokens"], atol=ATOL, rtol=ATOL)
    else:
        x = np.linspace(-1, 1, 5 * FEATURES_D, dtype=np.float32).reshape(5, FEATURES_D)
        code, details, response = _raw(channels[model], req(features(x)))
        assert code == grpc.StatusCode.OK, details
        got = np.frombuffer(response.results[0].embedding.data, "<f4")
        assert got.shape == (FEATURES_D,) and np.isfinite(got).all()
        reference = expected.setdefault("features", got.copy())
        np.testing.assert_array_equal(got, reference)


def test_the_corpus_is_big_and_named_uniquely():
    names = [case[0] for case in CASES]
    assert len(names) >= 30 and len(set(names)) == len(names)


@pytest.mark.parametrize("name,model,payload,code,words", CASES, ids=[c[0] for c in CASES])
def test_bad_input_gets_its_status_and_a_message_naming_the_problem(servers, expected, name, model, payload,
                                                                   code, words):
    got, details, _ = _raw(servers[1][model], payload)
    assert got == code, (got, details)
    assert words in details, details
    assert len(details.encode()) <= MAX_MESSAGE_BYTES + 64  # bounded, whatever the request held
    _healthy_and_correct(servers, expected, model)
    count(bad_inputs_tried=1)


def test_a_bad_item_in_a_stream_is_answered_in_place_and_the_stream_goes_on(servers, expected):
    channel = servers[1]["tokens"]
    stream = channel.stream_stream("/encoder.v1.EncoderService/EncodeStream")
    items = [req(OK3, request_id="a"), req(ids([1, 999]), request_id="b"), req(OK3, kind=17, request_id="c"),
             req(ids(CHECK_IDS), request_id="d")]
    answers = [pb.EncodeStreamResponse.FromString(r) for r in stream(iter(items), timeout=10)]
    assert [a.response.request_id for a in answers] == ["a", "b", "c", "d"]
    assert [a.error.code for a in answers] == [0, INVALID.value[0], INVALID.value[0], 0]
    assert "token id 999" in answers[1].error.message and "mask.kind" in answers[2].error.message
    got = np.frombuffer(answers[3].response.results[0].embedding.data, "<f4")
    np.testing.assert_allclose(got, expected["tokens"], atol=ATOL, rtol=ATOL)
    count(bad_inputs_tried=2)


# --- property-based fuzzing -------------------------------------------------------------------

DTYPES = st.sampled_from([0, pb.DATA_TYPE_FLOAT32, pb.DATA_TYPE_INT64, pb.DATA_TYPE_INT32, pb.DATA_TYPE_BOOL, 7])
ITEM = {pb.DATA_TYPE_FLOAT32: 4, pb.DATA_TYPE_INT64: 8, pb.DATA_TYPE_INT32: 4, pb.DATA_TYPE_BOOL: 1}


@st.composite
def tensors(draw, small_ids: bool):
    dtype = draw(DTYPES)
    shape = draw(st.lists(st.integers(-2, 140) | st.sampled_from([0, 2 ** 31, 2 ** 62]), min_size=0, max_size=3))
    exact = all(0 <= d <= 140 for d in shape) and draw(st.booleans())
    n = int(np.prod(shape)) if exact else 0
    if exact and n * ITEM.get(dtype, 1) <= 40_000:
        if dtype in (pb.DATA_TYPE_INT64, pb.DATA_TYPE_INT32) and small_ids:
            values = draw(st.lists(st.integers(-3, VOCAB + 3), min_size=n, max_size=n)) if n <= 64 else \
                list(np.random.default_rng(n).integers(0, VOCAB, n))
            data = np.asarray(values, "<i8" if dtype == pb.DATA_TYPE_INT64 else "<i4").tobytes()
        elif dtype == pb.DATA_TYPE_FLOAT32:
            fill = draw(st.sampled_from([0.0, 1.5, -2.0, float("nan"), float("inf"), 3e38]))
            data = struct.pack(f"<{n}f", *([fill] * n))
        else:
            data = draw(st.binary(min_size=n * ITEM.get(dtype, 1), max_size=n * ITEM.get(dtype, 1)))
    else:
        data = draw(st.binary(max_size=64))
    return T(dtype, shape, data)


@st.composite
def requests(draw):
    msg = pb.EncodeRequest(request_id=draw(st.text(max_size=8)))
    small = draw(st.booleans())
    for tensor in draw(st.lists(tensors(small), max_size=MAX_SEQUENCES + 1)):
        msg.sequences.append(tensor)
    msg.mask.kind = draw(st.integers(-2, 8))
    msg.mask.causal = draw(st.booleans())
    msg.mask.window = draw(st.sampled_from([0, 1, 3, 127, 128, 129, 2 ** 32 - 1]))
    msg.mask.step = draw(st.sampled_from([0, 1, 2, 128, 129, 2 ** 32 - 1]))
    if draw(st.booleans()):
        msg.mask.custom.CopyFrom(draw(tensors(False)))
    msg.output.pooling = draw(st.integers(-1, 5))
    msg.output.hidden_states = draw(st.booleans())
    if draw(st.booleans()):
        msg.output.normalize = draw(st.booleans())
    return msg.SerializeToString()


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(payload=requests() | st.binary(max_size=200), model=st.sampled_from(["tokens", "features"]))
def test_fuzzed_requests_are_answered_ok_or_invalid_argument_never_crash_or_hang(servers, payload, model):
    code, details, response = _raw(servers[1][model], payload, timeout=20)
    assert code in (grpc.StatusCode.OK, INVALID), (code, details)
    if code == INVALID:
        assert details and ":" in details  # names a field or the request
    else:
        sent = pb.EncodeRequest.FromString(payload)
        assert len(response.results) == len(sent.sequences)
        for result in response.results:
            if result.HasField("embedding"):
                assert np.isfinite(np.frombuffer(result.embedding.data, "<f4")).all()
    count(fuzz_requests=1)


def test_after_fuzzing_both_servers_are_healthy_and_correct(servers, expected):
    for model in ("tokens", "features"):
        _healthy_and_correct(servers, expected, model)
        assert "event=unexpected_error" not in servers[0][model].log()
