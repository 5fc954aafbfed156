"""Calls made at once from many threads, for the tests that check concurrent requests batch together."""

from __future__ import annotations

import threading
from typing import Callable, TypeVar

T = TypeVar("T")


def call_concurrently(call: Callable[[int], T], n: int, timeout: float = 60.0) -> list[T | None]:
    """call(0) .. call(n - 1), each on its own thread, all started before any is joined; their
    results in index order (None where a call raised or did not finish within `timeout`)."""
    results: list[T | None] = [None] * n

    def run(i: int) -> None:
        results[i] = call(i)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
    return results
