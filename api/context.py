"""What every route is handed (`Context`, on `app.state.ctx`): the settings, the job
service and the others the app builds at start, and the long-lived responses open per
tenant (`Streams`). Its own module so the routes type it without importing the app."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from service.control.jobs import JobService
from service.errors import QuotaExceeded
from service.settings import Limits, Settings
from service.store import Store


class Streams:
    """The long-lived responses (event streams, followed logs; generations) open per
    tenant: at most `limit` each (429 past it), and all of them told to end when the server
    shuts down, so an open dashboard cannot hold a SIGTERM."""

    def __init__(
        self,
        limit: int,
        setting: str = "max_event_streams_per_tenant",
        what: str = "streams open",
        hint: str = "close one (a dashboard tab, a followed log) or poll the list routes instead",
        code: str = "too_many_streams",
    ) -> None:
        self.limit = limit
        self.setting, self.what, self.hint, self.code = setting, what, hint, code
        self.open: dict[str, int] = {}
        self.closing = False

    def take(self, tenant: str) -> None:
        n = self.open.get(tenant, 0)
        if n >= self.limit:
            raise QuotaExceeded(
                f"tenant {tenant} has {n} {self.what}, its limit "
                f"({Limits.var(self.setting)}={self.limit}); {self.hint}",
                code=self.code,
            )
        self.open[tenant] = n + 1

    def give_back(self, tenant: str) -> None:
        self.open[tenant] -= 1

    async def guard(self, tenant: str, body: AsyncIterator[Any]) -> AsyncIterator[Any]:
        """`body`, ending early when the server shuts down; its slot given back at the end
        (taken by the caller before the response starts, so a 429 can still be sent)."""
        try:
            async for part in body:
                yield part
                if self.closing:
                    return
        finally:
            self.give_back(tenant)


@dataclass
class Context:
    settings: Settings
    store: Store
    launcher: Any
    jobs: JobService
    reconciler: Any = None
    metrics: Any = None
    streams: Streams | None = None
    generations: Streams | None = None  # chat and text completions in flight
    serving: Any = None  # service.serving.deployments.Serving: which deployment answers a model
    backend: Any = None  # api.generate's backend: where a generation's events come from
    keys: Any = None  # api.auth.KeyCache: the store's API keys, as the gate asks for them
    readiness: Any = None  # (when, checks) of the last /readyz that asked the store and Ray
    sessions: Any = None  # service.sessions.runtime.Sessions: Tinker's training sessions
    embedder: Any = None  # service.serving.embeddings.Embedder, where one is configured
    embedding_work: Any = None  # service.control.heavy.HeavyWork: where its batches run
