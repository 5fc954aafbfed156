"""Serving layers in isolation: tensors, config, errors, export directory, batcher, generated code."""

from __future__ import annotations

import filecmp
import json
import os
import shutil
import subprocess
import sys
import threading
import time

import grpc
import numpy as np
import pytest

from model.config import EncoderConfig
from model.mask_kinds import MaskKind
from serve import errors
from serve.protocols import status
from serve.protocols import proto_stamp
from tools import protogen
from serve.backend.session import BackendInfo, OnnxRuntimeBackend, dummy_batch
from serve.core.batch_plan import RunCost
from serve.core.batcher import Batcher
from serve.config import ServerConfig, load_config
from serve.backend.feeds import pad_batch
from serve.core.requests import Limits, MaskChoice, Work, to_rows
from serve.backend.export_dir import ExportError, load_export
from serve.protocols.pb import pb
from serve.protocols.tensors import from_numpy, to_numpy
from tests.subprocess_env import REPO, repo_env

CONFIG = EncoderConfig(d_model=8, n_heads=2, n_layers=1, d_ff=16, vocab_size=50, max_positions=32)


# --- tensors -----------------------------------------------------------------------------------
@pytest.mark.parametrize("array", [np.arange(6, dtype=np.int64).reshape(2, 3), np.float32([[1.5, -2.0]]),
                                   np.array([True, False]), np.int32([7])], ids=str)
def test_tensor_round_trip_keeps_dtype_shape_and_values(array):
    back = to_numpy(from_numpy(array), "t")
    assert back.dtype == array.dtype.newbyteorder("<") and back.shape == array.shape
    np.testing.assert_array_equal(back, array)


def test_tensor_decoding_views_the_message_bytes_without_copying():
    message = from_numpy(np.arange(1000, dtype=np.float32))
    array = to_numpy(message, "t")
    assert not array.flags.owndata and not array.flags.writeable


def test_tensor_big_endian_input_is_sent_little_endian():
    big = np.arange(3, dtype=">i8")
    assert to_numpy(from_numpy(big), "t").tolist() == [0, 1, 2]


def test_tensor_bytes_that_disagree_with_the_shape_name_the_field():
    bad = pb.Tensor(dtype=pb.DATA_TYPE_FLOAT32, shape=[2, 2], data=b"\0" * 12)
    with pytest.raises(errors.ValidationError, match=r"x\.data: 12 bytes, but shape \[2, 2\]"):
        to_numpy(bad, "x")


@pytest.mark.parametrize("field, layout, rank", [("sequences[0]", "[T]", 1), ("mask.custom", "[T, T] or [B, T, T]", 3)])
def test_a_tensor_of_more_dimensions_than_its_input_takes_is_refused_before_numpy_sees_it(field, layout, rank):
    for dims in (rank + 1, 65, 100_000):  # numpy itself refuses > 64 dimensions with a ValueError
        tensor = pb.Tensor(dtype=pb.DATA_TYPE_BOOL, shape=[1] * dims, data=b"\1")
        with pytest.raises(errors.ValidationError) as caught:
            to_numpy(tensor, field, layout, rank)
        assert caught.value.message == f"{field}.shape: {dims} dimensions; {field} must be of shape {layout}"
    assert to_numpy(pb.Tensor(dtype=pb.DATA_TYPE_BOOL, shape=[1] * rank, data=b"\1"), field, layout, rank).ndim == rank


# --- config ------------------------------------------------------------------------------------
def test_config_flags_override_environment_which_overrides_defaults():
    env = {"ENCODER_PORT": "6000", "ENCODER_HOST": "0.0.0.0", "ENCODER_WARMUP": "false"}
    config = load_config(["--port", "7000"], env)
    assert (config.port, config.host, config.warmup) == (7000, "0.0.0.0", False)
    assert load_config([], {}) == ServerConfig()
    assert ServerConfig().host == "127.0.0.1" and ServerConfig().port == 50051


def test_cuda_provider_keeps_fp32_exact_with_tf32_off_unless_asked_for():
    from serve.backend.session import CPU, CUDA, choose_providers

    available = [CUDA, CPU]
    assert choose_providers("cuda", 1, available) == [(CUDA, {"device_id": 1, "use_tf32": "0"}), CPU]
    assert choose_providers("cuda", 0, available, tf32=True)[0] == (CUDA, {"device_id": 0, "use_tf32": "1"})
    assert load_config(["--cuda-tf32", "true"], environ={}).cuda_tf32 is True
    assert ServerConfig().cuda_tf32 is False


def test_tensorrt_is_offered_only_where_its_library_loads():
    """The decision, on onnxruntime-gpu's provider list with the loader faked: no GPU and no TensorRT
    here. onnxruntime-gpu lists TensorRT whenever the wheel has the provider; the GPU image has no
    libnvinfer.so.10, so the server must not offer it (GetModelInfo.available_providers)."""
    from serve.backend.session import CPU, CUDA, TENSORRT, TENSORRT_LIBRARY, offered_providers

    gpu_wheel = [TENSORRT, CUDA, CPU]
    asked = []

    def missing(library):
        asked.append(library)
        return False

    assert offered_providers(gpu_wheel, loadable=missing) == [CUDA, CPU]
    assert asked == [TENSORRT_LIBRARY]
    assert offered_providers(gpu_wheel, loadable=lambda library: True) == gpu_wheel
    assert offered_providers([CPU], loadable=missing) == [CPU] and len(asked) == 1  # no TensorRT: not asked


def test_can_load_asks_the_real_dynamic_loader():
    from serve.backend.session import can_load

    assert can_load("libc.so.6")
    assert not can_load("libnvinfer-that-is-not-installed.so.10")


def test_length_split_is_on_by_default_and_its_run_cost_is_measured_unless_pinned():
    assert ServerConfig().length_split is True and ServerConfig().split_overhead_tokens == -1
    config = load_config(["--length-split", "false", "--split-overhead-tokens", "24"], environ={})
    assert (config.length_split, config.split_overhead_tokens) == (False, 24.0)
    with pytest.raises(ValueError, match="split_overhead_tokens must be >= 0, or -1"):
        ServerConfig(split_overhead_tokens=-3)


def test_front_ends_by_default_follow_the_device():
    """No GPU here: the rule is read for --device cuda with the CPU count given (the server on CUDA is
    tests/test_cuda.py's)."""
    from serve.config import front_end_count

    assert ServerConfig().front_ends == -1
    assert front_end_count(ServerConfig()) == 0  # --device cpu: ONNX Runtime needs the cores
    assert front_end_count(ServerConfig(device="auto"), cpus=64) == 0  # auto may end on the CPU
    cuda = ServerConfig(device="cuda")
    assert [front_end_count(cuda, cpus=n) for n in (1, 2, 6, 16, 64)] == [1, 1, 3, 8, 8]
    assert front_end_count(ServerConfig(device="cuda", front_ends=0), cpus=16) == 0  # as set, 0 included
    assert front_end_count(ServerConfig(front_ends=3)) == 3
    with pytest.raises(ValueError, match="front_ends must be >= 0 .* or -1"):
        ServerConfig(front_ends=-2)


def test_run_slots_by_default_follow_the_device_and_the_models(tmp_path):
    """No GPU here: the rule is read for --device cuda (the server on CUDA is tests/test_cuda.py's). A model
    folder is one with a metadata.json (Triton's layout rule)."""
    from serve.assembly.repository import run_slots

    for name in ("a", "b", "c"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metadata.json").write_text("{}")
    (tmp_path / "not-a-model").mkdir()
    cpus = len(os.sched_getaffinity(0))
    assert ServerConfig().instances == 0
    assert run_slots(ServerConfig(), None) == 1  # --export-dir on the CPU
    assert run_slots(ServerConfig(device="auto"), None) == 1  # auto may end on the CPU
    assert run_slots(ServerConfig(device="cuda"), None) == 2  # one batch's Python beside the other's run
    assert run_slots(ServerConfig(), tmp_path) == min(cpus, 3)  # one per model, at most one per CPU
    assert run_slots(ServerConfig(device="cuda"), tmp_path) == max(2, min(cpus, 3))
    assert run_slots(ServerConfig(device="cuda", instances=1), tmp_path) == 1  # as set


def test_config_bad_environment_value_names_the_variable():
    with pytest.raises(ValueError, match="ENCODER_PORT"):
        load_config([], {"ENCODER_PORT": "http"})


# --- errors ------------------------------------------------------------------------------------
@pytest.mark.parametrize("error, code", [
    (errors.ValidationError("x"), grpc.StatusCode.INVALID_ARGUMENT),
    (errors.Unsupported("x"), grpc.StatusCode.UNIMPLEMENTED),
    (errors.Overloaded("x"), grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.Unavailable("x"), grpc.StatusCode.UNAVAILABLE),
    (errors.DeadlineExceeded("x"), grpc.StatusCode.DEADLINE_EXCEEDED),
    (errors.BackendError("x"), grpc.StatusCode.INTERNAL),
    (KeyError("k"), grpc.StatusCode.INTERNAL),
], ids=lambda v: type(v).__name__ if isinstance(v, Exception) else v.name)
def test_errors_map_to_one_grpc_status_each_and_never_unknown(error, code):
    assert status.to_status(error)[0] == code


def test_client_strings_in_messages_are_cut_to_a_bounded_length():
    name = "m" * 65536
    assert errors.quote("short") == "'short'" and errors.clip("short") == "short"
    assert errors.quote(name) == repr("m" * errors.QUOTE_CHARS) + "…(65536 bytes)"
    assert errors.clip("é" * 300) == "é" * errors.QUOTE_CHARS + "…(600 bytes)"
    assert errors.clip(b"\xff" * 300).endswith("…(300 bytes)")
    # and whatever a message holds, the status carries at most MAX_MESSAGE_BYTES (+ the note)
    for error in (errors.ValidationError(f"model {name} is not served"), KeyError(name)):
        code, message = status.to_status(error)
        assert len(message.encode()) < errors.MAX_MESSAGE_BYTES + 64 and "message cut" in message


# --- validation --------------------------------------------------------------------------------
def test_rows_carry_their_own_mask_choice():
    request = Work((np.int64([1, 2, 3]), np.int32([4])),
                            MaskChoice(MaskKind.LOCAL_STRIDED, causal=True, window=1, step=2))
    rows = to_rows(request, CONFIG, Limits(4, 32))
    assert (rows.kind, rows.causal, rows.window, rows.step) == (4, True, 1, 2)
    assert rows.lengths.tolist() == [3, 1] and len(rows) == 2


def test_rows_are_one_block_padded_with_the_pad_id():
    request = Work((np.int64([1, 2, 3]), np.int32([4])))
    rows = to_rows(request, CONFIG, Limits(4, 32))
    pad = CONFIG.pad_token_id
    assert rows.block.dtype == np.int64
    np.testing.assert_array_equal(rows.block, [[1, 2, 3], [4, pad, pad]])


def test_what_lies_past_a_rows_length_in_a_sent_block_becomes_padding():
    block = np.int64([[1, 2, 3], [4, -7, 10**9]])  # out-of-vocabulary ids past row 1's length
    rows = to_rows(Work(block, lengths=np.int64([3, 1])), CONFIG, Limits(4, 32))
    np.testing.assert_array_equal(rows.block[1], [4, CONFIG.pad_token_id, CONFIG.pad_token_id])
    with pytest.raises(errors.ValidationError, match=r"sequences\[1\]: token id -7 out of range"):
        to_rows(Work(block, lengths=np.int64([3, 2])), CONFIG, Limits(4, 32))


def test_a_custom_mask_padded_to_the_longest_sequence_serves_sequences_of_unequal_length():
    custom = np.random.default_rng(0).random((2, 5, 5)) < 0.5
    request = Work((np.int64([1, 2, 3, 4, 5]), np.int64([6, 7, 8])), MaskChoice(MaskKind.CUSTOM, custom=custom))
    rows = to_rows(request, CONFIG, Limits(4, 32))
    np.testing.assert_array_equal(rows.custom[0], custom[0])
    np.testing.assert_array_equal(rows.custom[1, :3, :3], custom[1, :3, :3])
    assert not rows.custom[1, 3:].any() and not rows.custom[1, :, 3:].any()  # entries past length 3 are ignored
    for shape in ((2, 4, 4), (2, 6, 6), (3, 5, 5)):
        bad = Work(request.sequences, MaskChoice(MaskKind.CUSTOM, custom=np.ones(shape, bool)))
        with pytest.raises(errors.ValidationError, match=r"must be \[2, 5, 5\]: one matrix per sequence"):
            to_rows(bad, CONFIG, Limits(4, 32))
    # the exact forms still hold: [T, T] for sequences all of length T, [B, T, T] of equal lengths
    same = (np.int64([1, 2, 3]), np.int64([4, 5, 6]))
    assert to_rows(Work(same, MaskChoice(MaskKind.CUSTOM, custom=np.eye(3, dtype=bool))), CONFIG,
                   Limits(4, 32)).custom.shape == (2, 3, 3)
    with pytest.raises(errors.ValidationError, match=r"needs \[3, 3\].*\[B, Tmax, Tmax\]"):
        to_rows(Work(request.sequences, MaskChoice(MaskKind.CUSTOM, custom=np.eye(5, dtype=bool))),
                CONFIG, Limits(4, 32))


def test_a_request_that_fills_its_run_is_fed_its_own_block():
    rows = to_rows(Work(np.int64([[1, 2], [3, 4]])), CONFIG, Limits(4, 32))
    feeds = pad_batch([(rows, None)], 2, CONFIG)
    assert np.shares_memory(feeds["input_ids"], rows.block)
    assert feeds["custom_mask"].all() and feeds["custom_mask"].shape == (2, 2, 2)


# --- export directory --------------------------------------------------------------------------
def test_export_dir_refuses_a_graph_whose_hash_changed(serve_export_dir, tmp_path):
    copy = tmp_path / "e"
    shutil.copytree(serve_export_dir, copy)
    assert load_export(copy).sha256 == json.loads((copy / "metadata.json").read_text())["graphs"]["fp32"]["sha256"]
    (copy / "model.onnx").write_bytes((copy / "model.onnx").read_bytes() + b"x")
    with pytest.raises(ExportError, match="sha256 .* does not match metadata.json"):
        load_export(copy)


def test_export_dir_missing_says_to_run_the_exporter(tmp_path):
    with pytest.raises(ExportError, match="python -m export"):
        load_export(tmp_path)


def test_export_dir_unknown_graph_lists_the_ones_available(serve_export_dir):
    with pytest.raises(ExportError, match=r"no graph 'int8'.*\['fp32'\]"):
        load_export(serve_export_dir, "int8")


# --- batcher -----------------------------------------------------------------------------------
class FakeBackend:
    """Echoes the input ids as hidden states; can block until released."""

    info = BackendInfo(("FakeProvider",), ("FakeProvider",))

    def __init__(self) -> None:
        self.release = threading.Event()
        self.release.set()
        self.entered = threading.Event()  # set once the worker is inside encode (a batch is running)
        self.batches: list[int] = []
        self.fetched_hidden: list[bool] = []  # per run: whether the runner asked for the hidden states

    def health(self) -> None:
        pass

    def encode(self, batch, path="dense", *, wide=False, hidden=True):
        self.entered.set()
        self.release.wait(10)
        ids = batch["input_ids"].astype(np.float32)
        self.batches.append(ids.shape[0])
        self.fetched_hidden.append(hidden)
        states = np.repeat(ids[:, :, None], CONFIG.d_model, axis=2)
        mask = batch["attention_mask"][:, :, None]
        return (states if hidden else None), (states * mask).sum(1) / np.maximum(mask.sum(1), 1)


def _submit(batcher, ids, deadline=None):
    request = Work((np.int64(ids),), hidden_states=True, pooling="mean")  # resolved, as a task verb hands it
    return batcher.submit(request, to_rows(request, CONFIG, Limits(4, 32)), deadline)


def _batcher(backend, **overrides):
    options = dict(max_batch_size=8, max_batch_tokens=1000, max_queue_delay_s=0.05, max_queue_size=4)
    batcher = Batcher(backend, CONFIG, **{**options, **overrides})
    batcher.start()
    return batcher


def test_batcher_groups_concurrent_requests_and_unpads_each_result():
    backend = FakeBackend()
    batcher = _batcher(backend)
    tickets = [_submit(batcher, list(range(1, n + 1))) for n in (3, 1, 5)]
    results = [t.wait(5) for t in tickets]
    assert backend.batches == [3]
    for n, result in zip((3, 1, 5), results):
        assert result.batch_size == 3 and result.batch_length == 5
        np.testing.assert_array_equal(result.outputs[0].hidden_states[:, 0], np.arange(1, n + 1))
        assert result.outputs[0].embedding[0] == pytest.approx((n + 1) / 2)
    batcher.stop(5)


def test_a_request_that_ran_as_one_piece_is_answered_with_views_of_the_runs_output():
    backend = FakeBackend()
    outputs = []
    encode = backend.encode
    backend.encode = lambda batch, **options: outputs.append(encode(batch, **options)) or outputs[-1]
    batcher = _batcher(backend)
    result = _submit(batcher, [1, 2, 3]).wait(5)
    assert np.shares_memory(result.hidden_states, outputs[0][0])
    assert np.shares_memory(result.embeddings, outputs[0][1])
    batcher.stop(5)


def test_a_run_fetches_hidden_states_only_when_a_caller_reads_them():
    backend = FakeBackend()
    batcher = _batcher(backend, max_queue_delay_s=0.0)
    pooled_only = Work((np.int64([1, 2, 3]),), pooling="mean")
    first_token = Work((np.int64([4, 5]),), pooling="first")  # read off the hidden states
    for request in (pooled_only, first_token):
        batcher.submit(request, to_rows(request, CONFIG, Limits(4, 32)), None).wait(5)
    assert _submit(batcher, [6, 7]).wait(5).outputs[0].hidden_states is not None
    assert backend.fetched_hidden == [False, True, True]
    backend.release.clear()  # a batch of both kinds: the run fetches them, the pooled-only request gets none
    backend.entered.clear()
    blocker = batcher.submit(pooled_only, to_rows(pooled_only, CONFIG, Limits(4, 32)), None)
    assert backend.entered.wait(5)
    mixed = [batcher.submit(r, to_rows(r, CONFIG, Limits(4, 32)), None) for r in (pooled_only, first_token)]
    backend.release.set()
    blocker.wait(5)
    plain, first = (t.wait(5) for t in mixed)
    assert backend.fetched_hidden[-1] is True and plain.batch_size == 2
    assert plain.hidden_states is None and plain.embeddings[0][0] == pytest.approx(2.0)  # mean of 1, 2, 3
    assert first.embeddings[0][0] == pytest.approx(4.0)
    batcher.stop(5)


def test_the_onnx_backend_fetches_only_the_row_output_when_asked(serve_export_dir):
    backend = OnnxRuntimeBackend(load_export(serve_export_dir))
    feeds = dummy_batch(backend.export.config, 2, 5)
    states, pooled = backend.encode(feeds)
    nothing, alone = backend.encode(feeds, hidden=False)
    assert states is not None and nothing is None
    np.testing.assert_array_equal(alone, pooled)


def _answered_on(ticket) -> list[str]:
    """The name of the thread that answers `ticket` (its done callback's), once it is answered."""
    names: list[str] = []
    ticket.add_done_callback(lambda _: names.append(threading.current_thread().name))
    return names


def test_a_lone_requests_answer_is_assembled_by_the_worker_that_ran_it():
    batcher = _batcher(FakeBackend(), max_queue_delay_s=0.0)
    ticket = _submit(batcher, [1, 2, 3])
    names = _answered_on(ticket)
    ticket.wait(5)
    assert names == ["batcher-0"]  # no hand-off: nothing else waited
    batcher.stop(5)


class ThreadRecordingBackend(FakeBackend):
    """FakeBackend that records the thread each run ran on."""

    def __init__(self) -> None:
        super().__init__()
        self.threads: list[str] = []

    def encode(self, batch, *args, **options):
        self.threads.append(threading.current_thread().name)
        return super().encode(batch, *args, **options)


def _express_batcher(**overrides):
    """An idle batcher that has run one request (so it knows its seconds per token) and allows express runs."""
    backend = ThreadRecordingBackend()
    batcher = _batcher(backend, **{"max_queue_delay_s": 0.0, "express_run_s": 60.0, **overrides})
    _submit(batcher, [1, 2]).wait(5)
    assert batcher.drain(5)
    return backend, batcher


def _granted(submit):
    """`submit()` with the express grant, as the native transport's pump gives it (serve/core/express.py)."""
    from serve.core import express

    with express.granted(True):
        return submit()


def test_an_idle_models_granted_request_runs_on_the_submitting_thread():
    backend, batcher = _express_batcher()
    ticket = _granted(lambda: _submit(batcher, [4, 5, 6]))
    assert ticket.done()  # answered before submit returned: it ran here
    np.testing.assert_array_equal(ticket.wait(0).outputs[0].hidden_states[:, 0], [4, 5, 6])
    assert backend.threads == ["batcher-0", threading.current_thread().name]
    batcher.stop(5)


def test_a_request_without_the_grant_is_handed_to_the_batcher():
    backend, batcher = _express_batcher()
    _submit(batcher, [4, 5, 6]).wait(5)
    assert backend.threads == ["batcher-0", "batcher-0"]
    batcher.stop(5)


def test_a_grant_covers_one_express_run_and_a_second_request_of_the_call_queues():
    backend, batcher = _express_batcher()
    first, second = _granted(lambda: (_submit(batcher, [4]), _submit(batcher, [5])))
    assert first.wait(5) and second.wait(5)
    assert backend.threads == ["batcher-0", threading.current_thread().name, "batcher-0"]
    batcher.stop(5)


def test_a_model_that_has_not_run_yet_gets_no_express_run():
    backend = ThreadRecordingBackend()
    batcher = _batcher(backend, max_queue_delay_s=0.0, express_run_s=60.0)
    _granted(lambda: _submit(batcher, [4])).wait(5)  # its time cannot be predicted yet
    assert backend.threads == ["batcher-0"]
    batcher.stop(5)


def test_a_run_predicted_over_the_express_budget_is_handed_to_the_batcher():
    backend, batcher = _express_batcher(express_run_s=1e-12)
    _granted(lambda: _submit(batcher, [4, 5, 6])).wait(5)
    assert backend.threads == ["batcher-0", "batcher-0"]
    batcher.stop(5)


def test_express_runs_are_off_when_requests_wait_for_company():
    backend, batcher = _express_batcher(max_queue_delay_s=0.001)
    _granted(lambda: _submit(batcher, [4])).wait(5)
    assert backend.threads == ["batcher-0", "batcher-0"]
    batcher.stop(5)


def test_a_granted_request_queues_while_its_model_runs_a_batch():
    backend, batcher = _express_batcher()
    backend.release.clear()
    backend.entered.clear()
    running = _submit(batcher, [4])
    assert backend.entered.wait(5)  # the worker holds a batch inside the backend
    queued = _granted(lambda: _submit(batcher, [5]))
    assert not queued.done()
    backend.release.set()
    assert running.wait(5) and queued.wait(5)
    assert backend.threads == ["batcher-0"] * 3
    batcher.stop(5)


def test_a_drain_waits_for_an_express_run():
    backend, batcher = _express_batcher()
    backend.release.clear()
    backend.entered.clear()
    express_thread = threading.Thread(target=lambda: _granted(lambda: _submit(batcher, [4])), name="transport")
    express_thread.start()
    assert backend.entered.wait(5)  # inside the backend, on the express caller's thread
    assert backend.threads[-1] == "transport"
    assert not batcher.drain(0)
    backend.release.set()
    assert batcher.drain(5)
    express_thread.join(5)
    batcher.stop(5)


def test_a_failing_express_run_fails_its_request_alone_and_the_batcher_serves_on():
    backend, batcher = _express_batcher()
    encode = backend.encode
    backend.encode = lambda *args, **options: (_ for _ in ()).throw(RuntimeError("boom"))
    failed = _granted(lambda: _submit(batcher, [4]))
    with pytest.raises(errors.ServeError, match="boom"):
        failed.wait(0)
    backend.encode = encode
    assert _granted(lambda: _submit(batcher, [5])).wait(5).outputs[0].hidden_states[0, 0] == 5
    batcher.stop(5)


def test_answering_alone_is_said_of_its_own_thread_and_block_only():
    from serve.core import express

    seen = {}
    with express.answering_alone(True):
        seen["inside"] = express.alone()
        other = threading.Thread(target=lambda: seen.setdefault("other thread", express.alone()))
        other.start()
        other.join(5)
        with express.answering_alone(False):
            seen["not alone, nested"] = express.alone()
    seen["after"] = express.alone()
    assert seen == {"inside": True, "other thread": False, "not alone, nested": True, "after": False}


def test_the_next_batch_starts_while_the_last_runs_answers_are_still_being_assembled():
    """With work queued behind a run, its answers are assembled on the finisher thread: here the first answer's
    callback holds until the second batch is inside the backend, which cannot happen if the worker that must start
    that batch were the one assembling."""
    backend = FakeBackend()
    backend.release.clear()
    batcher = _batcher(backend, max_queue_delay_s=0.0)
    first = _submit(batcher, [1, 2, 3])
    assert backend.entered.wait(5)
    second_started, held, first_names = threading.Event(), threading.Event(), []

    def hold(_ticket) -> None:
        first_names.append(threading.current_thread().name)
        if backend.entered.wait(5):  # the second batch's run began meanwhile
            second_started.set()
        held.set()

    first.add_done_callback(hold)
    second = _submit(batcher, [4, 5])  # queued while the first runs
    second_names = _answered_on(second)
    backend.entered.clear()
    backend.release.set()
    assert held.wait(10)
    assert second_started.is_set() and first_names == ["batcher-finish"]
    np.testing.assert_array_equal(second.wait(5).outputs[0].hidden_states[:, 0], [4, 5])
    assert second_names == ["batcher-0"]  # nothing queued behind it: answered by its worker
    batcher.stop(5)


def test_a_drain_waits_for_answers_still_being_assembled():
    backend = FakeBackend()
    backend.release.clear()
    batcher = _batcher(backend, max_queue_delay_s=0.0)
    first = _submit(batcher, [1, 2])
    assert backend.entered.wait(5)
    assembling, let_go = threading.Event(), threading.Event()
    first.add_done_callback(lambda _: (assembling.set(), let_go.wait(10)))
    second = _submit(batcher, [3])  # queued: the first's answer goes to the finisher
    backend.release.set()
    assert assembling.wait(5)
    second.wait(5)
    assert not batcher.drain(0.05)  # the first's answer is still being assembled
    let_go.set()
    assert batcher.drain(5)
    batcher.stop(5)


def test_batcher_respects_the_token_budget():
    backend = FakeBackend()
    batcher = _batcher(backend, max_batch_tokens=10)
    tickets = [_submit(batcher, [1] * 4) for _ in range(3)]  # 2 rows x 4 fit in 10 tokens, 3 do not
    for t in tickets:
        t.wait(5)
    assert backend.batches == [2, 1]
    batcher.stop(5)


def test_on_cuda_the_batcher_never_forms_a_run_past_the_attention_element_bound():
    """A run's rows are padded to its longest; with the budget's element bound (CUDA's 2^31 - 1, here one
    that two rows of 4 tokens fill: 2 rows x 2 heads x 4²) a third row waits for the next run."""
    from model.attention_paths import DENSE
    from serve.core.attention_budget import AttentionBudget

    budget = AttentionBudget(CONFIG, (DENSE,), 1 << 30, max_elements=2 * CONFIG.n_heads * 4 ** 2)
    backend = FakeBackend()
    batcher = _batcher(backend, budget=budget)
    request = Work((np.int64([1, 2, 3, 4]),), hidden_states=True, pooling="mean")
    tickets = [batcher.submit(request, to_rows(request, CONFIG, Limits(4, 32), budget), None) for _ in range(3)]
    for t in tickets:
        t.wait(5)
    assert backend.batches == [2, 1]
    batcher.stop(5)


def test_batcher_full_queue_is_overloaded():
    backend = FakeBackend()
    backend.release.clear()
    batcher = _batcher(backend, max_queue_size=2, max_queue_delay_s=0)
    first = _submit(batcher, [1])
    assert backend.entered.wait(5)  # the worker took `first` and blocks in the backend
    _submit(batcher, [1]), _submit(batcher, [1])
    with pytest.raises(errors.Overloaded, match="max_queue_size=2"):
        _submit(batcher, [1])
    backend.release.set()
    first.wait(5)
    batcher.stop(5)


def test_batcher_drops_expired_and_cancelled_requests_before_running_them():
    backend = FakeBackend()
    backend.release.clear()
    batcher = _batcher(backend, max_queue_delay_s=0)
    blocker = _submit(batcher, [1])
    assert backend.entered.wait(5)  # the worker runs `blocker`; the next three queue behind it
    expired = _submit(batcher, [2], deadline=time.monotonic() - 1.0)  # already past when the batch forms
    cancelled = _submit(batcher, [3])
    cancelled.cancel()
    kept = _submit(batcher, [4])
    backend.release.set()
    blocker.wait(5)
    assert kept.wait(5).batch_size == 1
    with pytest.raises(errors.DeadlineExceeded):
        expired.wait(5)
    with pytest.raises(errors.Cancelled):
        cancelled.wait(5)
    assert backend.batches == [1, 1]
    batcher.stop(5)


def test_batcher_after_close_refuses_new_work_but_finishes_queued_work():
    backend = FakeBackend()
    backend.release.clear()
    batcher = _batcher(backend, max_queue_delay_s=0)
    queued = [_submit(batcher, [i + 1]) for i in range(3)]
    batcher.close()
    with pytest.raises(errors.Unavailable, match="shutting down"):
        _submit(batcher, [1])
    backend.release.set()
    assert batcher.drain(5)
    assert all(t.wait(0).outputs for t in queued)
    batcher.stop(5)


def test_batcher_abandon_answers_queued_and_running_requests_with_the_error_it_is_given():
    backend = FakeBackend()
    backend.release.clear()
    batcher = _batcher(backend, max_queue_delay_s=0)
    running = _submit(batcher, [1])
    assert backend.entered.wait(5)
    queued = _submit(batcher, [2])
    assert batcher.abandon(errors.Unavailable("grace period ran out")) == 2
    for ticket in (running, queued):
        with pytest.raises(errors.Unavailable, match="grace period ran out"):
            ticket.wait(0)
    backend.release.set()  # the running batch ends later: its result is dropped, the answer stays
    assert batcher.drain(5)
    with pytest.raises(errors.Unavailable):
        running.wait(0)
    batcher.stop(5)


class CountingBackend(FakeBackend):
    """FakeBackend that counts the calls inside encode at once; `both_inside` is set when two are."""

    def __init__(self) -> None:
        super().__init__()
        self.inside, self.most_inside = 0, 0
        self.both_inside = threading.Event()
        self._lock = threading.Lock()

    def encode(self, batch, *args, **options):
        with self._lock:
            self.inside += 1
            self.most_inside = max(self.most_inside, self.inside)
            if self.inside == 2:
                self.both_inside.set()
        try:
            return super().encode(batch, *args, **options)
        finally:
            with self._lock:
                self.inside -= 1


def test_batcher_with_two_instances_runs_two_batches_at_once_and_drains_both():
    backend = CountingBackend()
    backend.release.clear()
    batcher = _batcher(backend, max_queue_delay_s=0, instances=2)
    first = _submit(batcher, [1, 2])
    assert backend.entered.wait(5)  # worker 0 holds `first` inside the backend
    second = _submit(batcher, [3])
    assert backend.both_inside.wait(5)  # worker 1 took `second` while `first` still runs
    assert not batcher.drain(0)  # two batches running: not drained
    backend.release.set()
    assert batcher.drain(5)
    assert first.wait(0).batch_size == 1 and second.wait(0).batch_size == 1
    np.testing.assert_array_equal(second.wait(0).outputs[0].hidden_states[:, 0], [3])
    assert backend.most_inside == 2
    batcher.stop(5)


class WideBackend(CountingBackend):
    """CountingBackend with a wide session (every CPU): records whether each run asked for it."""

    has_wide = True

    def __init__(self) -> None:
        super().__init__()
        self.wide_calls: list[bool] = []

    def encode(self, batch, path="dense", *, wide=False, **options):
        self.wide_calls.append(wide)
        return super().encode(batch, path, **options)


def test_a_batch_that_runs_alone_gets_every_cpu_and_one_beside_another_gets_its_share():
    backend = WideBackend()
    backend.release.clear()
    batcher = _batcher(backend, max_queue_delay_s=0, instances=2)
    first = _submit(batcher, [1])
    assert backend.entered.wait(5)  # alone: nothing else running or queued
    second = _submit(batcher, [2])
    assert backend.both_inside.wait(5)  # runs beside `first`
    backend.release.set()
    first.wait(5), second.wait(5)
    assert backend.wide_calls == [True, False]
    batcher.stop(5)


def test_batcher_abandon_covers_every_running_instance():
    backend = CountingBackend()
    backend.release.clear()
    batcher = _batcher(backend, max_queue_delay_s=0, instances=2)
    running = [_submit(batcher, [1])]
    assert backend.entered.wait(5)
    running.append(_submit(batcher, [2]))
    assert backend.both_inside.wait(5)
    assert batcher.abandon(errors.Unavailable("grace period ran out")) == 2
    for ticket in running:
        with pytest.raises(errors.Unavailable, match="grace period ran out"):
            ticket.wait(0)
    backend.release.set()
    assert batcher.drain(5)
    batcher.stop(5)


@pytest.mark.parametrize("policy, entries", [
    (None, {"session.intra_op.allow_spinning": "0"}),  # the default: never
    ("run", {"session.intra_op.allow_spinning": "1", "session.force_spinning_stop": "1"}),
    ("always", {"session.intra_op.allow_spinning": "1"})])
def test_the_spin_policy_reaches_the_session_and_never_is_the_default(serve_export_dir, policy, entries):
    from serve.backend.session import OnnxRuntimeBackend

    kwargs = {} if policy is None else {"intra_op_spin": policy}
    options = OnnxRuntimeBackend(load_export(serve_export_dir), **kwargs).session.get_session_options()
    assert {key: options.get_session_config_entry(key) for key in entries} == entries
    assert ServerConfig().intra_op_spin == "never"


def test_instances_share_the_cpus_among_their_intra_op_threads(serve_export_dir):
    import os

    from serve.backend.session import OnnxRuntimeBackend

    cpus = len(os.sched_getaffinity(0))
    for instances in (1, 2):
        backend = OnnxRuntimeBackend(load_export(serve_export_dir), instances=instances)
        assert backend.session.get_session_options().intra_op_num_threads == max(1, cpus // instances)
        # a second, wide session (every CPU) for batches that run alone, only where instances split the CPUs
        assert backend.has_wide == (max(1, cpus // instances) < cpus)
        # a lone batch of several runs runs this many at once on the narrow session (serve/core/runs.py)
        assert backend.parallel_runs == (cpus // max(1, cpus // instances) if backend.has_wide else 1)
        if backend.has_wide:
            assert backend.wide.get_session_options().intra_op_num_threads == cpus
            ids = np.array([[5, 6, 7]], np.int64)
            feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids), "mask_kind": np.zeros(1, np.int64),
                     "mask_causal": np.zeros(1, bool), "mask_window": np.zeros(1, np.int64),
                     "mask_step": np.ones(1, np.int64), "custom_mask": np.ones((1, 3, 3), bool)}
            feeds = {name: feeds[name] for name in (i.name for i in backend.session.get_inputs())}
            for narrow, wide in zip(backend.encode(feeds), backend.encode(feeds, wide=True)):
                np.testing.assert_allclose(wide, narrow, atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="instances must be >= 0"):
        ServerConfig(instances=-1)


class ShapeRecordingBackend(FakeBackend):
    """FakeBackend that records (rows, padded length) per run and holds runs longer than `gate` until
    `open` is set."""

    def __init__(self, gate: int = 10_000) -> None:
        super().__init__()
        self.shapes: list[tuple[int, int]] = []
        self.gate, self.open = gate, threading.Event()

    def encode(self, batch, *args, **options):
        rows, length = batch["input_ids"].shape
        self.shapes.append((rows, length))
        if length > self.gate:
            self.open.wait(10)
        return super().encode(batch, *args, **options)


def _submit_many(batcher, sequences):
    request = Work(tuple(np.int64(ids) for ids in sequences), hidden_states=True, pooling="mean")
    return batcher.submit(request, to_rows(request, CONFIG, Limits(4, 32)))


def test_batcher_with_a_run_cost_runs_mixed_lengths_as_length_sorted_runs():
    backend = ShapeRecordingBackend()
    batcher = _batcher(backend, run_cost=RunCost.for_config(CONFIG, 8.0))
    lengths = (2, 30, 3, 28)
    tickets = [_submit(batcher, list(range(1, n + 1))) for n in lengths]
    results = [t.wait(5) for t in tickets]
    assert backend.shapes == [(2, 3), (2, 30)]  # one batch, two runs: each padded to its own longest row
    for n, result in zip(lengths, results):
        np.testing.assert_array_equal(result.outputs[0].hidden_states[:, 0], np.arange(1, n + 1))
        assert (result.batch_size, result.batch_length) == ((2, 3) if n <= 3 else (2, 30))
    batcher.stop(5)


def test_batcher_without_a_run_cost_pads_mixed_lengths_into_one_run():
    backend = ShapeRecordingBackend()
    batcher = _batcher(backend)
    tickets = [_submit(batcher, list(range(1, n + 1))) for n in (2, 30, 3, 28)]
    for t in tickets:
        t.wait(5)
    assert backend.shapes == [(4, 30)]
    batcher.stop(5)


def test_short_requests_of_a_split_batch_are_answered_before_the_long_run_ends():
    backend = ShapeRecordingBackend(gate=10)
    batcher = _batcher(backend, run_cost=RunCost.for_config(CONFIG, 8.0))
    short, long = _submit(batcher, [1, 2]), _submit(batcher, list(range(1, 31)))
    assert short.wait(5).batch_length == 2
    assert not long.done()  # its run is still held by the backend
    backend.open.set()
    assert long.wait(5).batch_length == 30
    batcher.stop(5)


def test_a_request_whose_rows_fall_in_different_runs_gets_every_row_in_its_own_order():
    backend = ShapeRecordingBackend()
    batcher = _batcher(backend, run_cost=RunCost.for_config(CONFIG, 8.0))
    both = _submit_many(batcher, [list(range(1, 31)), [7, 8]])
    other = _submit(batcher, [5, 6, 7])
    result = both.wait(5)
    other.wait(5)
    assert backend.shapes == [(2, 3), (1, 30)]
    np.testing.assert_array_equal(result.outputs[0].hidden_states[:, 0], np.arange(1, 31))
    np.testing.assert_array_equal(result.outputs[1].hidden_states[:, 0], [7, 8])
    assert result.token_counts == (30, 2) and result.batch_length == 30
    batcher.stop(5)


def test_a_request_split_over_runs_that_fetched_no_hidden_states_gets_each_rows_embedding_in_order():
    backend = ShapeRecordingBackend()
    batcher = _batcher(backend, run_cost=RunCost.for_config(CONFIG, 8.0))
    request = Work((np.int64(range(1, 31)), np.int64([7, 8])), pooling="mean")
    result = batcher.submit(request, to_rows(request, CONFIG, Limits(4, 32))).wait(5)
    assert backend.shapes == [(1, 2), (1, 30)] and backend.fetched_hidden == [False, False]
    assert result.hidden_states is None
    np.testing.assert_allclose(result.embeddings[:, 0], [15.5, 7.5])  # each row's mean, in the request's order
    batcher.stop(5)


class PoisonBackend(ShapeRecordingBackend):
    """Fails any run that holds token 13."""

    def encode(self, batch, *args, **options):
        if (batch["input_ids"] == 13).any():
            self.shapes.append(batch["input_ids"].shape)
            raise RuntimeError("poisoned run")
        return super().encode(batch, *args, **options)


def test_a_failing_run_of_a_split_batch_fails_only_the_request_that_poisons_it():
    backend = PoisonBackend()
    batcher = _batcher(backend, run_cost=RunCost.for_config(CONFIG, 8.0))
    short = _submit(batcher, [1, 2])
    good_long, bad_long = _submit(batcher, [3] * 30), _submit(batcher, [13] * 29)
    assert short.wait(5).batch_length == 2  # its run succeeded before the long run failed
    assert good_long.wait(5).batch_size == 1  # re-run alone after the shared run failed
    with pytest.raises(errors.ServeError, match="poisoned run"):
        bad_long.wait(5)
    batcher.stop(5)


class ParallelRunsBackend(WideBackend, ShapeRecordingBackend):
    """WideBackend (the session each run asked for, how many ran at once) with the shapes recorded, whose narrow
    session fills the CPUs two runs at a time (parallel_runs 2). Each run waits (bounded) inside until another is
    inside too (FakeBackend's `release` is CountingBackend's `both_inside`), so runs made one after another show
    as most_inside 1, never as a hang. Fails any run that holds token `poison`."""

    parallel_runs = 2

    def __init__(self, poison: int | None = None) -> None:
        super().__init__()
        self.release = self.both_inside
        self.poison = poison

    def encode(self, batch, *args, **options):
        outputs = super().encode(batch, *args, **options)
        if self.poison is not None and (batch["input_ids"] == self.poison).any():
            raise RuntimeError("poisoned run")
        return outputs


def test_a_lone_batch_of_several_runs_runs_them_at_once_on_the_narrow_session():
    backend = ParallelRunsBackend()
    batcher = _batcher(backend, run_cost=RunCost.for_config(CONFIG, 8.0), instances=2)
    result = _submit_many(batcher, [list(range(1, 31)), [7, 8]]).wait(10)
    assert sorted(backend.shapes) == [(1, 2), (1, 30)]
    assert backend.most_inside == 2 and backend.wide_calls == [False, False]
    np.testing.assert_array_equal(result.outputs[0].hidden_states[:, 0], np.arange(1, 31))
    np.testing.assert_array_equal(result.outputs[1].hidden_states[:, 0], [7, 8])
    assert result.token_counts == (30, 2) and (result.batch_size, result.batch_length) == (1, 30)
    batcher.stop(5)


def test_a_lone_batch_of_one_run_takes_the_wide_session():
    backend = ParallelRunsBackend()
    backend.both_inside.set()  # one run: nothing to wait for
    batcher = _batcher(backend, run_cost=RunCost.for_config(CONFIG, 8.0), instances=2)
    _submit(batcher, [1, 2, 3]).wait(10)
    assert backend.wide_calls == [True]
    batcher.stop(5)


def test_a_failing_run_among_runs_at_once_fails_only_the_request_that_poisons_it():
    backend = ParallelRunsBackend(poison=13)
    batcher = _batcher(backend, run_cost=RunCost.for_config(CONFIG, 8.0), instances=2, max_queue_delay_s=1.0,
                       max_batch_size=2)  # the two requests form one batch at once
    short, bad_long = _submit(batcher, [1, 2]), _submit(batcher, [13] * 29)
    assert short.wait(10).outputs[0].hidden_states[:, 0].tolist() == [1, 2]
    with pytest.raises(errors.ServeError, match="poisoned run"):
        bad_long.wait(10)
    assert backend.most_inside == 2
    batcher.stop(5)


# --- generated code and the torch boundary -----------------------------------------------------
def test_generated_code_in_use_equals_what_the_protos_generate_now(tmp_path):
    # No regeneration first: this compares the package the server imports with a fresh one from
    # protos/, so it fails when the staleness stamp misses a change (or the code was edited by hand).
    fresh = tmp_path / "_proto"
    protogen.generate(fresh)
    ours = sorted(p.relative_to(protogen.OUT_DIR) for p in protogen.OUT_DIR.rglob("*") if p.is_file()
                  and "__pycache__" not in p.parts)
    theirs = sorted(p.relative_to(fresh) for p in fresh.rglob("*") if p.is_file())
    assert ours == theirs
    mismatch = [str(p) for p in ours if not filecmp.cmp(protogen.OUT_DIR / p, fresh / p, shallow=False)]
    assert not mismatch


@pytest.fixture
def generated(tmp_path):
    """(protos/, serve/_proto/) copies in tmp_path, generated and current."""
    protos, out = tmp_path / "protos", tmp_path / "_proto"
    shutil.copytree(protogen.PROTO_DIR, protos)
    protogen.generate(out, protos)
    assert not protogen.is_stale(out, protos)
    proto_stamp.check(out, protos)
    return protos, out


@pytest.mark.parametrize("proto", ["encoder/v1/encoder.proto", "encoder/v1/admin.proto", proto_stamp.KSERVE_PROTO])
def test_a_changed_proto_makes_the_generated_code_stale_and_refused_at_import(generated, proto):
    protos, out = generated
    path = protos / proto
    path.write_text(path.read_text() + "\n// a comment changes the sources\n")
    assert protogen.is_stale(out, protos)
    with pytest.raises(proto_stamp.GeneratedCodeError, match=r"stale.*python -m tools\.protogen"):
        proto_stamp.check(out, protos)


@pytest.mark.parametrize("artefact", [proto_stamp.KSERVE_DESCRIPTORS, "encoder/v1/encoder_pb2.py",
                                      "encoder/v1/admin_pb2_grpc.py", proto_stamp.STAMP])
@pytest.mark.parametrize("how", ["deleted", "edited"])
def test_a_missing_or_edited_generated_file_is_refused_at_import(generated, artefact, how):
    protos, out = generated
    path = out / artefact
    if how == "deleted":
        path.unlink()
    else:
        path.write_bytes(path.read_bytes() + b"\n# edited by hand\n")
    assert protogen.is_stale(out, protos)
    with pytest.raises(proto_stamp.GeneratedCodeError, match=r"python -m tools\.protogen"):
        proto_stamp.check(out, protos)


def test_the_kserve_descriptors_describe_the_v2_service_the_server_registers():
    from serve.protocols import kserve_v2 as kserve
    from serve.protocols.pb import kserve_descriptors

    names = {file.name for file in kserve_descriptors().file}
    assert proto_stamp.KSERVE_PROTO in names
    methods = {m.name for m in kserve.POOL.FindServiceByName(kserve.SERVICE).methods}
    assert {"ServerLive", "ServerReady", "ModelReady", "ServerMetadata", "ModelMetadata", "ModelInfer"} <= methods


def test_serving_never_imports_torch_nor_onnx_nor_runs_protoc(serve_export_dir):
    # grpcio-tools is a build dependency (python -m tools.protogen), not the server's; onnx is the exporter's
    # (the serve extra and the image have only onnxruntime)
    code = f"""
import sys
sys.modules["torch"] = None  # any `import torch` now raises ImportError
sys.modules["onnx"] = None  # and `import onnx`
sys.modules["grpc_tools"] = None  # and so does any `import grpc_tools` (protoc)
import serve.assembly.app, client, serve.protocols.encoder_v1, serve.protocols.kserve_v2, serve.protocols.admin, serve.backend.session, serve.core.batcher
import serve.__main__
from serve.assembly.app import create_server
from client import EncoderClient
from serve.config import ServerConfig
server, port = create_server(ServerConfig(port=0, metrics_port=-1, http_port=0, admin=True,
                                          export_dir={str(serve_export_dir)!r}))
server.start(); server.load()
with EncoderClient(f"127.0.0.1:{{port}}", retries=0) as client:
    assert client.encode([[1, 2, 3]], mask="causal").embeddings.shape == (1, 32)
server.shutdown(5)
assert not any(name == "torch" or name.startswith("torch.") for name in sys.modules if sys.modules[name])
print("ok")
"""
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60,
                            env=repo_env())
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr


# --- the scheduler: the server's run slots, shared by every model (serve/core/scheduler.py) ----------
def _acquire_in_thread(scheduler, oldest, model):
    got = threading.Event()
    thread = threading.Thread(target=lambda: scheduler.acquire(oldest, model=model) and got.set(), daemon=True)
    thread.start()
    return got, thread


def test_a_model_with_no_run_going_starts_one_at_once_even_when_another_holds_every_slot():
    from serve.core.scheduler import Scheduler
    from tests.reliability_common import wait_until

    scheduler = Scheduler(1)
    assert scheduler.acquire(1.0, model="flooded")
    second, _ = _acquire_in_thread(scheduler, 2.0, "flooded")  # its second run waits for the slot
    assert wait_until(lambda: scheduler.busy() == (1, 1), 10)
    quiet, _ = _acquire_in_thread(scheduler, 3.0, "quiet")  # younger, yet runs at once: no run of its own
    assert quiet.wait(10) and not second.is_set()
    scheduler.release("quiet")
    scheduler.release("flooded")
    assert second.wait(10)
    scheduler.release("flooded")
    assert scheduler.busy() == (0, 0)


def test_a_freed_slot_goes_to_the_waiter_with_the_oldest_request():
    from serve.core.scheduler import Scheduler
    from tests.reliability_common import wait_until

    class Granted(dict):  # the runs-per-model table, recording each grant in order (under the lock)
        def __setitem__(self, model, runs):
            if runs > self.get(model, 0):
                grants.append(model)
            super().__setitem__(model, runs)

    grants: list[str] = []
    scheduler = Scheduler(3)
    scheduler._by_model = Granted()
    for oldest, model in ((0.0, "a"), (0.1, "b"), (0.2, "c")):
        assert scheduler.acquire(oldest, model=model)
    threading.Thread(target=scheduler.acquire, args=(9.0,), kwargs={"model": "a"}, daemon=True).start()
    assert wait_until(lambda: scheduler.busy() == (3, 1), 10)
    threading.Thread(target=scheduler.acquire, args=(1.0,), kwargs={"model": "b"}, daemon=True).start()
    assert wait_until(lambda: scheduler.busy() == (3, 2), 10)
    scheduler.release("c")  # one slot: the older request ("b") takes it
    assert wait_until(lambda: scheduler.busy() == (3, 1), 10)
    assert grants == ["a", "b", "c", "b"]
    scheduler.release("b")
    assert wait_until(lambda: scheduler.busy() == (3, 0), 10)
    assert grants == ["a", "b", "c", "b", "a"]


def test_a_slot_is_taken_at_once_only_while_one_is_free_and_no_one_waits():
    from serve.core.scheduler import Scheduler
    from tests.reliability_common import wait_until

    scheduler = Scheduler(1)
    assert scheduler.try_acquire("a")
    assert not scheduler.try_acquire("b")  # no slot free
    waiter, _ = _acquire_in_thread(scheduler, 1.0, "a")
    assert wait_until(lambda: scheduler.busy() == (1, 1), 10)
    scheduler.release("a")
    assert waiter.wait(10)
    scheduler.release("a")
    assert scheduler.busy() == (0, 0) and scheduler.try_acquire("b")
    scheduler.release("b")
    assert scheduler.busy() == (0, 0)


def test_while_another_model_is_active_a_model_leaves_it_one_slot():
    from serve.core.scheduler import Scheduler
    from tests.reliability_common import wait_until

    scheduler = Scheduler(2, active_s=3600)  # "recently" spans the whole test
    assert scheduler.acquire(0.0, model="alone")
    assert scheduler.acquire(0.1, model="alone")  # no other model: it takes every slot
    scheduler.release("alone")
    scheduler.release("alone")
    assert scheduler.acquire(0.2, model="quiet")  # the quiet model asks once, runs, and is done
    scheduler.release("quiet")
    assert scheduler.acquire(0.3, model="alone")
    stop = threading.Event()
    second = threading.Event()
    threading.Thread(target=lambda: scheduler.acquire(0.4, stop.is_set, model="alone") and second.set(),
                     daemon=True).start()
    assert wait_until(lambda: scheduler.busy() == (1, 1), 10)  # a slot is free, and kept for "quiet"
    assert scheduler.acquire(0.5, model="quiet")  # which finds it at once
    assert not second.is_set()
    stop.set()
    scheduler.wake()
    assert wait_until(lambda: scheduler.busy() == (2, 0), 10) and not second.is_set()


# -- tasks (serve/core/tasks.py) and sentence pairs in a batch ------------------------------------------

def test_a_pairs_token_types_reach_the_graph_and_other_rows_get_zeros():
    from serve.backend.feeds import Rows

    config = EncoderConfig(type_vocab_size=2)
    pair = Rows(np.array([[1, 2, 3, 4]]), np.array([4]), types=np.array([[0, 0, 1, 1]]))
    single = Rows(np.array([[5, 6, 0, 0]]), np.array([2]))
    feeds = pad_batch([(pair, None), (single, None)], 4, config)
    np.testing.assert_array_equal(feeds["token_type_ids"], [[0, 0, 1, 1], [0, 0, 0, 0]])


def test_rerank_order_is_highest_first_with_ties_in_document_order_and_top_n():
    from serve.core.tasks.rerank import ranking

    np.testing.assert_array_equal(ranking(np.array([0.1, 0.9, 0.5, 0.9])), [1, 3, 2, 0])
    np.testing.assert_array_equal(ranking(np.array([0.1, 0.9, 0.5, 0.9]), 2), [1, 3])


def test_scores_are_the_exports_activation_of_the_logits_unless_raw():
    from serve.core.tasks.classify import activate

    logits = np.array([[0.0, np.log(3.0)]], np.float32)
    np.testing.assert_allclose(activate(logits, "softmax"), [[0.25, 0.75]], rtol=1e-6)
    np.testing.assert_allclose(activate(logits, "sigmoid"), [[0.5, 0.75]], rtol=1e-6)
    np.testing.assert_array_equal(activate(logits, "softmax", raw=True), logits)


def test_a_route_that_does_not_fit_the_task_lists_the_routes_that_do():
    from serve.core import tasks

    routes = {"POST /embed": "embed", "POST /rerank": "rerank", "POST /predict": "classify"}
    tasks.check("rerank", "classify", route="POST /predict", model="m", routes=routes)
    with pytest.raises(errors.ValidationError, match=r"task 'rerank'.*Routes that fit it: POST /rerank, POST /predict"):
        tasks.check("rerank", "embed", route="POST /embed", model="m", routes=routes)


# -- the route table (serve/protocols/routes.py) -------------------------------------------------------

@pytest.fixture(scope="module")
def router():
    from serve.protocols import routes

    return routes.router(api=None)


def test_a_path_on_a_model_is_that_route_with_the_model_named(router):
    match = router.match("POST", "/models/reranker/rerank")
    assert match.route.key == "POST /rerank" and match.params == {"model": "reranker"}
    assert router.match("POST", "/models/reranker").route.key == "POST /"
    assert router.match("GET", "/v1/models").params == {}


def test_a_templated_path_gives_its_segments(router):
    match = router.match("POST", "/v2/models/m/versions/1/infer")
    assert match.route.key == "POST /v2/models/{model}/versions/{version}/infer"
    assert match.params == {"model": "m", "version": "1"}


def test_an_unknown_path_is_404_and_a_known_path_with_another_method_405_in_its_familys_body(router):
    from serve.protocols import kserve_rest, openai, tei

    unknown = router.match("POST", "/nowhere")
    assert (unknown.route, unknown.status, unknown.error_body) == (None, 404, openai.error_body)
    assert router.match("GET", "/v2/nowhere").error_body is kserve_rest.error_body
    wrong = router.match("GET", "/embed")
    assert (wrong.route, wrong.status, wrong.error_body) == (None, 405, tei.error_body)
    assert router.match("POST", "/v2/models/m/ready").status == 405


def test_every_route_is_in_the_listing_and_every_task_route_names_a_core_verb(router):
    import json

    from serve.core.tasks import VERBS
    from serve.protocols import routes

    listing = json.loads(routes.LISTING)
    for route in routes.ROUTES:
        assert route.method.lower() in listing["paths"][route.path], route.key
        assert route.verb is None or route.verb in VERBS, route.key
    assert set(router.verbs) == {route.key for route in routes.ROUTES if route.verb is not None}


def test_a_route_declared_twice_is_refused_when_the_router_is_built():
    from serve.protocols import openai, routes
    from serve.protocols.routing import Family, HttpRoutes, Route

    twice = Family("twice", openai.error_body, (Route("POST", "/v1/embeddings", openai.embeddings, "embed"),))
    with pytest.raises(RuntimeError, match="POST /v1/embeddings is declared twice"):
        HttpRoutes(None, (*routes.FAMILIES, twice), routes.UNMATCHED)
