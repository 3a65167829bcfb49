"""Launchers: how an attempt of a job becomes a Ray job, and how we ask Ray about it.

`RayLauncher` talks to a cluster through the Ray Job Submission API (the dashboard's
HTTP port): one Ray job per attempt, submission id `<job-id>-a<attempt>`, entrypoint
`python -m service.control.driver`, with the data dir and the path of the store's URL in its
environment (`service.settings.job_env`; never a secret: the dashboard shows it).
Submitting the same id twice is refused by Ray, which is what makes a retried
submission after a crash safe. `DryLauncher` accepts submissions and runs nothing (the
API benchmark and API tests use it).
"""

from __future__ import annotations

import logging
import os
import shlex
import sys
import threading
from collections.abc import AsyncIterator, Collection
from typing import Any

from service import ray_auth
from service.errors import Unavailable

log = logging.getLogger(__name__)


class SubmissionRefused(Exception):
    """Ray is reachable and refused to take one attempt (a bad runtime environment, a
    name clash): the reconciler retries that job alone, then fails it with this text."""

    code = "submission_refused"


# Ray's job states; PENDING and RUNNING are live
LIVE = ("PENDING", "RUNNING")
ENDED = ("SUCCEEDED", "FAILED", "STOPPED")
ASK_ONE_BY_ONE = 8  # open attempts up to which a tick asks Ray about each, not the list


class DryLauncher:
    """Records submissions; every Ray job stays PENDING (so a job stays `queued`)."""

    dashboard_url: str | None = None

    def __init__(self) -> None:
        self.submitted: dict[str, dict[str, Any]] = {}
        self.stopped: list[str] = []
        self._lock = threading.Lock()

    def ping(self) -> None:
        return None

    def submit(self, submission_id: str, job_id: str, attempt: int, env: dict[str, str]) -> None:
        with self._lock:
            if submission_id in self.submitted:
                raise RuntimeError(f"submission {submission_id} exists")
            self.submitted[submission_id] = {"job_id": job_id, "attempt": attempt}

    def status(self, submission_id: str) -> str | None:
        if submission_id in self.stopped:
            return "STOPPED"
        return "PENDING" if submission_id in self.submitted else None

    def statuses(self, submission_ids: Collection[str]) -> dict[str, str]:
        return {sid: st for sid in submission_ids if (st := self.status(sid))}

    def stop_quietly(self, submission_id: str) -> None:
        self.stopped.append(submission_id)

    def cluster_nodes(self) -> list[dict[str, float]] | None:
        return None

    def logs(self, submission_id: str) -> str:
        return ""

    async def tail(self, submission_id: str) -> AsyncIterator[str]:
        if False:  # pragma: no cover - an empty async generator
            yield ""


class RayLauncher:
    def __init__(
        self, address: str, python: str | None = None, env: dict[str, str] | None = None
    ) -> None:
        self.address = address.rstrip("/")
        self.dashboard_url = self.address if self.address.startswith("http") else None
        # the driver runs the project's python: this venv's on a local cluster, the image's
        # `python` on a remote one (PSTAR_RAY_PYTHON overrides)
        self.python = python or os.environ.get("PSTAR_RAY_PYTHON") or sys.executable
        self.env = env or {}
        self._client = None
        self._lock = threading.Lock()

    def retarget(self, address: str) -> None:
        """Talk to a new head from now on (the embedded default restarted it)."""
        with self._lock:
            self.address = address.rstrip("/")
            self.dashboard_url = self.address if self.address.startswith("http") else None
            self._client = None

    def client(self):
        from ray.job_submission import JobSubmissionClient

        with self._lock:
            if self._client is None:
                try:
                    # the header Ray would add itself, given explicitly: Ray reads the
                    # auth mode once per process, maybe before the control plane set it
                    self._client = JobSubmissionClient(self.address, headers=ray_auth.headers())
                except Exception as e:  # Ray raises ConnectionError/RuntimeError variants
                    raise Unavailable(f"Ray at {self.address} is not reachable: {e}") from None
            return self._client

    def ping(self) -> None:
        try:
            self.client().get_version()
        except Unavailable:
            raise
        except Exception as e:
            self._client = None
            raise Unavailable(f"Ray at {self.address} is not reachable: {e}") from None

    def submit(self, submission_id: str, job_id: str, attempt: int, env: dict[str, str]) -> None:
        entry = (
            f"{shlex.quote(self.python)} -m service.control.driver {shlex.quote(job_id)} {attempt}"
        )
        try:
            self.client().submit_job(
                entrypoint=entry,
                submission_id=submission_id,
                runtime_env={"env_vars": {**self.env, **env}},
                metadata={"pstar_job_id": job_id, "attempt": str(attempt)},
                entrypoint_num_cpus=0,
            )
        except Unavailable:
            raise
        except Exception as e:
            if self.status(submission_id) is not None:
                return  # already submitted (a retry after a crash): that is the attempt
            # Ray answered (status() just did) and said no: this job's problem, not Ray's
            raise SubmissionRefused(f"Ray refused the submission {submission_id}: {e}") from None

    def status(self, submission_id: str) -> str | None:
        """Ray's status of a submission, or None when Ray does not know it."""
        try:
            info = self.client().get_job_info(submission_id)
        except Unavailable:
            raise
        except RuntimeError as e:
            if "does not exist" in str(e) or "404" in str(e):
                return None
            self._client = None
            raise Unavailable(f"Ray at {self.address}: {e}") from None
        except Exception as e:
            self._client = None
            raise Unavailable(f"Ray at {self.address} is not reachable: {e}") from None
        return str(info.status.value if hasattr(info.status, "value") else info.status)

    def statuses(self, submission_ids: Collection[str]) -> dict[str, str]:
        """Ray's status of each of `submission_ids` that it knows. A few are asked one by
        one; past `ASK_ONE_BY_ONE`, one call lists every job Ray keeps (its whole history,
        which grows with every attempt ever run), so a quiet cluster costs nothing."""
        if len(submission_ids) <= ASK_ONE_BY_ONE:
            return {sid: st for sid in submission_ids if (st := self.status(sid))}
        try:
            jobs = self.client().list_jobs()
        except Unavailable:
            raise
        except Exception as e:
            self._client = None
            raise Unavailable(f"Ray at {self.address} is not reachable: {e}") from None
        return {
            j.submission_id: str(j.status.value if hasattr(j.status, "value") else j.status)
            for j in jobs
            if j.submission_id in submission_ids
        }

    def stop_quietly(self, submission_id: str) -> None:
        try:
            self.client().stop_job(submission_id)
        except Exception as e:
            log.warning("could not stop Ray job %s (the reconciler retries): %s", submission_id, e)

    def cluster_nodes(self) -> list[dict[str, float]] | None:
        """Each alive node's total resources (CPU, GPU, memory), from the dashboard; None
        when the dashboard does not say (the dry run then skips the resources check)."""
        import json
        import urllib.request

        if not self.dashboard_url:
            return None
        try:
            req = urllib.request.Request(
                f"{self.dashboard_url}/nodes?view=summary", headers=ray_auth.headers()
            )
            with urllib.request.urlopen(req, timeout=5) as r:
                summary = json.loads(r.read())["data"]["summary"]
        except (OSError, ValueError, KeyError):
            return None
        nodes = [
            n["raylet"]["resourcesTotal"]
            for n in summary
            if n.get("raylet", {}).get("state", "ALIVE") == "ALIVE"
            and "resourcesTotal" in n.get("raylet", {})
        ]
        return nodes or None

    def logs(self, submission_id: str) -> str:
        try:
            return self.client().get_job_logs(submission_id)
        except Exception as e:
            raise Unavailable(f"logs of {submission_id} are not available from Ray: {e}") from None

    async def tail(self, submission_id: str) -> AsyncIterator[str]:
        import asyncio

        client = await asyncio.to_thread(self.client)  # may connect: not on the event loop
        async for lines in client.tail_job_logs(submission_id):
            yield lines
