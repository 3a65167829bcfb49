"""Logs of a job: each attempt's Ray job log (driver output, with the workers' lines that
Ray forwards to it), read from Ray while it has them and kept in the job's directory once
the attempt ends, so they outlive a restarted head."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

from service.errors import Unavailable
from service.settings import Settings
from service.store import TERMINAL, Attempt, Job, Store
from service.store.jobs import ActiveAttempt

log = logging.getLogger(__name__)


def saved_log(settings: Settings, submission_id: str) -> Path:
    job_id = submission_id.rsplit("-a", 1)[0]
    return settings.job_dir(job_id) / "logs" / f"{submission_id}.log"


def save_attempt_log(settings: Settings, launcher: Any, att: Attempt | ActiveAttempt) -> None:
    try:
        text = launcher.logs(att.submission_id)
    except Unavailable:
        return
    if not text:
        return
    path = saved_log(settings, att.submission_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _one(settings: Settings, launcher: Any, submission_id: str) -> str:
    try:
        text = launcher.logs(submission_id)
        if text:
            return text
    except Unavailable as e:
        log.debug("%s", e.message)
    path = saved_log(settings, submission_id)
    if path.is_file():
        return path.read_text(errors="replace")
    return "(no log: Ray does not have it and it was not saved)\n"


def attempt_logs(
    settings: Settings, store: Store, launcher: Any, job: Job, attempt: int | None
) -> str:
    numbers = [attempt] if attempt else list(range(1, job.attempt + 1))
    if not numbers:
        return f"(job {job.id} has not started an attempt yet: status {job.status})\n"
    parts = []
    for n in numbers:
        sid = f"{job.id}-a{n}"
        parts.append(f"===== attempt {n} (Ray job {sid}) =====\n" + _one(settings, launcher, sid))
    return "\n".join(parts)


async def follow_logs(
    settings: Settings,
    store: Store,
    launcher: Any,
    job: Job,
    sleep: Callable[[float], Awaitable[None]],
) -> AsyncIterator[str]:
    """The current attempt's log as it grows; moves on to a new attempt, ends with the job.

    Store and Ray calls that block run in a worker thread: this generator runs on the
    server's event loop, which every other request shares."""
    seen = 0
    while True:
        fresh = await asyncio.to_thread(store.jobs.get, job.id) or job
        if fresh.attempt == 0 and fresh.status not in TERMINAL:
            await sleep(1.0)
            continue
        if fresh.attempt > seen:
            for n in range(seen + 1, fresh.attempt + 1):
                sid = f"{job.id}-a{n}"
                yield f"===== attempt {n} (Ray job {sid}) =====\n"
                if n < fresh.attempt:
                    yield await asyncio.to_thread(_one, settings, launcher, sid)
                    continue
                try:
                    async for chunk in launcher.tail(sid):
                        yield chunk
                except Exception as e:  # the head went away mid-stream
                    yield f"(log stream interrupted: {e})\n"
            seen = fresh.attempt
        again = await asyncio.to_thread(store.jobs.get, job.id)
        fresh = again or fresh
        if fresh.status in TERMINAL and fresh.attempt == seen:
            yield f"===== job {fresh.status} =====\n"
            return
        await sleep(1.0)
