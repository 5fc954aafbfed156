"""The wire between front ends and the engine (serve/core/ipc.py): a burst of requests and a burst of answers each
cross as one header and one body, and read back as the arrays that were sent, each call's its own. The servers
that use it end to end are in tests/test_front_ends.py."""

from __future__ import annotations

import contextlib
import tempfile

import numpy as np
import orjson
import zmq

from model.mask_kinds import MaskKind
from serve.backend.feeds import Rows
from serve.core import ipc
from serve.core.remote import EngineLink, RemoteTicket
from serve.core.requests import EncodeResult, Work
from serve.errors import Overloaded, ServeError


def _result(rng, rows: int, width: int, *, hidden: bool, scores: bool) -> EncodeResult:
    return EncodeResult(
        request_id="", embeddings=rng.standard_normal((rows, width)).astype(np.float32),
        hidden_states=rng.standard_normal((rows, 3, width)).astype(np.float16) if hidden else None,
        scores=rng.standard_normal((rows, 5)).astype(np.float32) if scores else None,
        queue_s=0.001, inference_s=0.002, batch_size=rows, batch_length=3, execution_provider="CPUExecutionProvider",
        attention_paths=("dense",) * rows)


def _asked(rows: int) -> tuple[Work, Rows]:
    block = np.ones((rows, 3), np.int64)
    return Work(block), Rows(block, np.full(rows, 3, np.int64))


def test_a_burst_of_answers_reads_back_each_calls_own_arrays_and_errors():
    rng = np.random.default_rng(0)
    sent = {11: _result(rng, 1, 7, hidden=True, scores=False), 12: Overloaded("queue full (max_queue_size=1)"),
            13: _result(rng, 3, 5, hidden=False, scores=True), 14: _result(rng, 2, 7, hidden=True, scores=True)}
    frames = ipc.results_frames(list(sent.items()))
    assert len(frames) == 2  # one header, one body, however many answers
    header = orjson.loads(frames[0])
    assert [item["id"] for item in header["items"]] == list(sent)
    for item in header["items"]:
        expected = sent[item["id"]]
        got = ipc.read_result(item, frames[1], *_asked(2))
        if isinstance(expected, ServeError):
            assert type(got) is Overloaded and got.message == expected.message
            continue
        for name in ("embeddings", "hidden_states", "scores"):
            want, have = getattr(expected, name), getattr(got, name)
            assert (want is None) == (have is None), name
            if want is not None:
                assert have.dtype == want.dtype and have.flags.aligned
                np.testing.assert_array_equal(have, want)


def test_an_answer_alone_is_a_burst_of_one():
    result = _result(np.random.default_rng(1), 1, 4, hidden=False, scores=False)
    frames = ipc.results_frames([(7, result)])
    (item,) = orjson.loads(frames[0])["items"]
    np.testing.assert_array_equal(ipc.read_result(item, frames[1], *_asked(1)).embeddings, result.embeddings)


def test_an_error_alone_travels_without_a_body():
    frames = ipc.error_frames(3, ValueError("boom"))
    assert len(frames) == 1
    (item,) = orjson.loads(frames[0])["items"]
    error = ipc.read_result(item, None, *_asked(1))
    assert isinstance(error, ServeError) and "ValueError: boom" in error.message


def test_a_requests_rows_with_a_custom_mask_and_token_types_read_back_equal():
    rng = np.random.default_rng(2)
    lengths = np.array([3, 5], np.int64)
    block = rng.integers(1, 100, (2, 5)).astype(np.int64)
    custom = rng.random((2, 5, 5)) < 0.5  # bool: the bytes before the int64 token types are not a multiple of 8
    types = rng.integers(0, 2, (2, 5)).astype(np.int64)
    rows = Rows(block, lengths, int(MaskKind.CUSTOM), custom=custom, types=types,
                paths=(("dense", np.array([0, 1])),))
    frames = ipc.work_frames(0, [(9, "m", Work(block, hidden_states=True, pooling="mean"), rows, None)])
    work, got = ipc.read_work(orjson.loads(frames[0])["items"][0], frames[1])
    for name in ("block", "lengths", "custom", "types"):
        have = getattr(got, name)
        assert have.flags.aligned, name
        np.testing.assert_array_equal(have, getattr(rows, name))
    assert got.kind == int(MaskKind.CUSTOM) and work.hidden_states and work.pooling == "mean"
    np.testing.assert_array_equal(got.paths[0][1], [0, 1])


def test_a_result_the_wire_cannot_carry_fails_its_own_call_and_moves_no_other_answer():
    rng = np.random.default_rng(3)
    before, after = _result(rng, 1, 6, hidden=True, scores=False), _result(rng, 2, 6, hidden=False, scores=True)
    unsendable = _result(rng, 1, 6, hidden=True, scores=False)
    object.__setattr__(unsendable, "embeddings", np.array([[object()]], dtype=object))  # pointers, not values
    frames = ipc.results_frames([(1, before), (2, unsendable), (3, after)])
    items = orjson.loads(frames[0])["items"]
    assert "error" in items[1] and items[1]["id"] == 2
    for item, sent in ((items[0], before), (items[2], after)):
        got = ipc.read_result(item, frames[1], *_asked(2))
        np.testing.assert_array_equal(got.embeddings, sent.embeddings)
        for name in ("hidden_states", "scores"):
            if getattr(sent, name) is not None:
                np.testing.assert_array_equal(getattr(got, name), getattr(sent, name))


def _plain(rng, rows: int, width: int) -> tuple[Work, Rows]:
    block = rng.integers(1, 100, (rows, width)).astype(np.int64)
    return Work(block, pooling="mean"), Rows(block, np.full(rows, width, np.int64))


def test_a_burst_of_requests_reads_back_each_calls_own_rows_and_settings():
    rng = np.random.default_rng(4)
    lengths = np.array([2, 3], np.int64)
    block = rng.integers(1, 100, (2, 3)).astype(np.int64)
    custom = rng.random((2, 3, 3)) < 0.5  # 18 bytes: the next request's arrays start unaligned unless padded
    masked = Rows(block, lengths, int(MaskKind.CUSTOM), custom=custom)
    sent = [(21, "a", *_plain(rng, 1, 4), None), (22, "b", Work(block, hidden_states=True), masked, 12.5),
            (23, "a", *_plain(rng, 3, 5), None)]
    frames = ipc.work_frames(1, sent)
    assert len(frames) == 2  # one header, one body, however many requests
    header = orjson.loads(frames[0])
    assert header["fe"] == 1 and [item["id"] for item in header["items"]] == [21, 22, 23]
    for item, (_, model, work, rows, deadline) in zip(header["items"], sent):
        assert item["model"] == model and item["deadline"] == deadline
        got_work, got = ipc.read_work(item, frames[1])
        assert got_work.hidden_states == work.hidden_states and got.kind == rows.kind
        for name in ("block", "lengths", "custom"):
            want, have = getattr(rows, name), getattr(got, name)
            assert (want is None) == (have is None), name
            if want is not None:
                assert have.flags.aligned, name
                np.testing.assert_array_equal(have, want)


@contextlib.contextmanager
def _link(index: int):
    """A front end's link, not started, and a PULL socket where the engine's would be (what the link sends, as the
    engine reads it)."""
    with tempfile.TemporaryDirectory() as folder:
        engine = ipc.receiver(zmq.Context.instance(), ipc.address(folder, ipc.ENGINE_SOCKET))
        link = EngineLink(folder, index)
        try:
            yield link, engine
        finally:
            link.stop()
            engine.close(linger=0)


def test_requests_queued_together_leave_as_one_message_with_the_cancels_after():
    rng = np.random.default_rng(5)
    with _link(3) as (link, engine):
        tickets = [RemoteTicket(*_plain(rng, 1, 4), None) for _ in range(3)]
        for ticket in tickets:  # before the sender starts: all three wait for it
            link.send_work(ticket, "m")
        tickets[1].cancel()
        link.start()
        header, body = ipc.receive(engine, 10.0)
        assert header["k"] == "work" and header["fe"] == 3
        assert [item["id"] for item in header["items"]] == [t.call_id for t in tickets]
        np.testing.assert_array_equal(ipc.read_work(header["items"][2], body)[1].block, tickets[2].rows.block)
        cancel, _ = ipc.receive(engine, 10.0)
        assert cancel == {"k": "cancel", "fe": 3, "ids": [tickets[1].call_id]}


def test_a_burst_the_wire_cannot_carry_fails_each_of_its_calls_and_nothing_waits():
    rng = np.random.default_rng(6)
    with _link(0) as (link, _):
        good = RemoteTicket(*_plain(rng, 1, 4), None)
        work, rows = _plain(rng, 1, 4)
        bad = RemoteTicket(work, Rows(np.array([[object()]]), rows.lengths), None)  # pointers, not values
        link.send_work(good, "m")
        link.send_work(bad, "m")
        link.start()
        for ticket in (good, bad):
            try:
                ticket.wait(10.0)
            except ServeError as error:
                assert "could not be sent to the engine process" in error.message
            else:
                raise AssertionError("a call of an unsendable burst was answered")
        assert link.in_flight() == 0
