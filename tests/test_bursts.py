"""serve/core/bursts.py: a queue its own thread empties in bursts (the front ends' sender, the engine's outbox,
the batcher's finisher)."""

from __future__ import annotations

import threading

from serve.core.bursts import BurstQueue


def test_what_gathers_while_a_pass_runs_is_handed_over_at_once_in_order():
    passes, first_taken, let_go = [], threading.Event(), threading.Event()

    def handle(items: list) -> None:
        passes.append(list(items))
        if len(passes) == 1:
            first_taken.set()
            assert let_go.wait(10)

    queue = BurstQueue("test-bursts", handle)
    queue.start()
    queue.put(1)  # alone: handed over at once
    assert first_taken.wait(10)
    for item in (2, 3, 4):  # put while the first pass runs
        queue.put(item)
    assert queue.unhandled() == [1, 2, 3, 4]
    let_go.set()
    queue.stop()
    assert passes == [[1], [2, 3, 4]] and queue.unhandled() == []


def test_stopping_hands_over_what_is_left_first():
    passes = []
    queue = BurstQueue("test-bursts", passes.append)
    for item in "abc":  # before its thread starts
        queue.put(item)
    queue.start()
    queue.stop()
    assert passes == [["a", "b", "c"]]


def test_a_pass_that_raises_leaves_the_thread_serving_the_next():
    handled, passes_over = [], threading.Semaphore(0)

    def handle(items: list) -> None:
        if items == ["bad"]:
            raise ValueError("boom")
        handled.extend(items)

    queue = BurstQueue("test-bursts", handle, handled=passes_over.release)
    queue.start()
    queue.put("bad")
    assert passes_over.acquire(timeout=10)
    queue.put("good")
    assert passes_over.acquire(timeout=10)
    queue.stop()
    assert handled == ["good"]
