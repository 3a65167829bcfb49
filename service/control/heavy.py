"""Heavy work a request can cause (building a meta model, tokenizing a file for a dry
run) runs here: in a small pool with a queue bound and a timeout, so a burst of
`/validate` or LoRA creates cannot take every server thread or hold one for ever. Past
the queue or the timeout the request gets 503 with when to retry; the work a timed-out
request started finishes in the pool and is dropped.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TypeVar

from service.errors import Unavailable

T = TypeVar("T")


class HeavyWork:
    def __init__(self, workers: int = 2, queue: int = 8, timeout_s: float = 60.0) -> None:
        self.timeout_s = timeout_s
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="pstar-heavy")
        self._slots = threading.BoundedSemaphore(workers + queue)
        self._inside = threading.local()

    def run(self, fn: Callable[..., T], *args: object, **kwargs: object) -> T:
        if getattr(self._inside, "yes", False):  # already on a pool thread: no second hop
            return fn(*args, **kwargs)
        if not self._slots.acquire(blocking=False):
            raise Unavailable(
                "the server is busy with other model checks and dry runs; retry in a few seconds",
                code="server_busy",
            )

        def task() -> T:
            self._inside.yes = True
            try:
                return fn(*args, **kwargs)
            finally:
                self._inside.yes = False
                self._slots.release()

        try:
            future = self._pool.submit(task)
        except BaseException:
            self._slots.release()
            raise
        try:
            return future.result(timeout=self.timeout_s)
        except FutureTimeout:
            raise Unavailable(
                f"checking this request took longer than {self.timeout_s:.0f} s; retry later "
                "or with a smaller file",
                code="timeout",
            ) from None

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
