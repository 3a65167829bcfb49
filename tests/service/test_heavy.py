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


def test_one_tenant_holds_at_most_its_share_and_the_others_still_get_in():
    from service.errors import QuotaExceeded

    heavy = HeavyWork(workers=2, queue=4, timeout_s=10, per_tenant=2)
    release = threading.Event()
    running = threading.Semaphore(0)

    def slow() -> str:
        running.release()
        release.wait(10)
        return "done"

    out: list[object] = []
    burst = [
        threading.Thread(target=lambda: out.append(heavy.run(slow, tenant="acme")))
        for _ in range(2)
    ]
    for t in burst:
        t.start()
    for _ in range(2):
        assert running.acquire(timeout=5)
    with pytest.raises(QuotaExceeded, match="tenant acme has 2") as e:
        heavy.run(lambda: "third", tenant="acme")
    assert e.value.code == "too_many_requests"
    # the pool has room: another tenant's request waits its turn instead of a refusal
    rival = threading.Thread(target=lambda: out.append(heavy.run(lambda: "rival", tenant="rival")))
    rival.start()
    release.set()
    for t in (*burst, rival):
        t.join()
    assert sorted(map(str, out)) == ["done", "done", "rival"]
    assert heavy._held == {}  # every place given back
    assert heavy.run(lambda: "again", tenant="acme") == "again"
    heavy.shutdown()
