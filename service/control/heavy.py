"""Heavy work a request can cause (building a meta model, tokenizing a file's sample for a
dry run) runs here: in a small pool with a queue bound and a timeout, so a burst of
`/validate` or LoRA creates cannot take every server thread or hold one for ever. Past
the queue or the timeout the request gets 503 with when to retry; the work a timed-out
request started finishes in the pool and is dropped. One tenant holds at most
`per_tenant` of the pool's places (running or queued), so a tenant's burst leaves room
for the others: past it, that tenant gets 429.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TypeVar

from service.errors import QuotaExceeded, Unavailable

T = TypeVar("T")


class HeavyWork:
    def __init__(
        self,
        workers: int = 2,
        queue: int = 8,
        timeout_s: float = 60.0,
        per_tenant: int = 2,
        what: str = "model checks or dry runs",
        smaller: str = "a smaller file",
    ) -> None:
        self.timeout_s = timeout_s
        self.per_tenant = per_tenant
        self.what, self.smaller = what, smaller  # named in its 503s and 429s
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="pstar-heavy")
        self._slots = threading.BoundedSemaphore(workers + queue)
        self._inside = threading.local()
        self._lock = threading.Lock()
        self._held: dict[str, int] = {}  # places held, by tenant

    def run(self, fn: Callable[..., T], *args: object, tenant: str | None = None) -> T:
        if getattr(self._inside, "yes", False):  # already on a pool thread: no second hop
            return fn(*args)
        self._take(tenant)
        if not self._slots.acquire(blocking=False):
            self._give(tenant)
            raise Unavailable(
                f"the server is busy with other {self.what}; retry in a few seconds",
                code="server_busy",
            )

        def task() -> T:
            self._inside.yes = True
            try:
                return fn(*args)
            finally:
                self._inside.yes = False
                self._slots.release()
                self._give(tenant)

        try:
            future = self._pool.submit(task)
        except BaseException:
            self._slots.release()
            self._give(tenant)
            raise
        try:
            return future.result(timeout=self.timeout_s)
        except FutureTimeout:
            raise Unavailable(
                f"this request took longer than {self.timeout_s:.0f} s; retry later "
                f"or with {self.smaller}",
                code="timeout",
            ) from None

    def _take(self, tenant: str | None) -> None:
        if tenant is None:
            return
        with self._lock:
            n = self._held.get(tenant, 0)
            if n >= self.per_tenant:
                raise QuotaExceeded(
                    f"tenant {tenant} has {n} {self.what} in progress, as many as one tenant "
                    "may; retry when they have answered",
                    code="too_many_requests",
                )
            self._held[tenant] = n + 1

    def _give(self, tenant: str | None) -> None:
        if tenant is None:
            return
        with self._lock:
            n = self._held.get(tenant, 0) - 1
            if n > 0:
                self._held[tenant] = n
            else:
                self._held.pop(tenant, None)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
