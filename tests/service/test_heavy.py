"""service/control/heavy: request-path heavy work is bounded in threads, queue and time."""

from __future__ import annotations

import threading

import pytest

from service.control.heavy import HeavyWork
from service.errors import Unavailable


def test_past_the_queue_a_request_is_refused_at_once_and_a_slow_one_times_out():
    heavy = HeavyWork(workers=1, queue=1, timeout_s=0.3)
    release = threading.Event()
    started = threading.Event()

    def slow() -> str:
        started.set()
        release.wait(10)
        return "done"

    results: list[object] = []

    def call() -> None:
        try:
            results.append(heavy.run(slow))
        except Unavailable as e:
            results.append(e.code)

    first = threading.Thread(target=call)
    first.start()
    started.wait(5)
    second = threading.Thread(target=call)  # queued behind the first
    second.start()
    for _ in range(100):  # until the second holds the queue's one place
        if heavy._slots._value == 0:
            break
        threading.Event().wait(0.01)
    with pytest.raises(Unavailable, match="busy") as e:
        heavy.run(lambda: "never")
    assert e.value.code == "server_busy"
    first.join()
    second.join()
    assert results == ["timeout", "timeout"]  # both waited past 0.3 s
    release.set()
    for _ in range(200):  # the dropped work ends in the pool and gives its places back
        if heavy._slots._value == 2:
            break
        threading.Event().wait(0.01)
    assert heavy.run(lambda: 7) == 7
    # work that asks for heavy work from a pool thread runs there, not deadlocked
    assert heavy.run(lambda: heavy.run(lambda: 8)) == 8
    heavy.shutdown()
