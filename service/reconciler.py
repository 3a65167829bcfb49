"""The reconciler: brings the store in line with Ray, once a second and after a restart.

The store says what should run; Ray says what runs. For each unfinished job:
- `validating_files`: its files are checked again (present, same checksum) -> `queued`;
- no attempt yet, or the last one ended without the driver reporting an end: the next
  attempt is recorded (`submitting`) and submitted as Ray job `<job-id>-a<n>`; a new
  attempt resumes from the run's last checkpoint (Ray Train finds it by run name);
- an attempt left `submitting` by a crash is looked up in Ray by its id first, so it is
  never submitted twice;
- an attempt Ray no longer knows (the head was lost) counts as ended.
Attempts of finished jobs that Ray still runs (a cancel whose stop did not reach Ray) are
stopped. Everything here is idempotent: running two reconcilers, or one twice, does no
harm, because every step is a conditional write.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from typing import Any

from service.errors import Unavailable
from service.launcher import ENDED, LIVE
from service.settings import Settings
from service.store import TERMINAL, ActiveAttempt, ActiveJob, Attempt, Store

log = logging.getLogger(__name__)


class Reconciler:
    def __init__(
        self,
        settings: Settings,
        store: Store,
        launcher: Any,
        interval_s: float = 1.0,
        on_ray_down: Any = None,
    ) -> None:
        self.settings, self.store, self.launcher = settings, store, launcher
        self.on_ray_down = on_ray_down  # the embedded default restarts its local head
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.ticks = 0
        self.ray_ok = True

    # -- the loop -----------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="pstar-reconciler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.tick()
            except Exception:  # one bad tick must not end reconciliation
                log.exception("reconciler tick failed")
            self._stop.wait(self.interval_s)

    def tick(self) -> None:
        self.ticks += 1
        try:
            self.launcher.ping()
            if not self.ray_ok:
                log.warning("Ray is reachable again")
            self.ray_ok = True
        except Unavailable as e:
            if self.ray_ok:
                log.warning("Ray is not reachable; jobs wait: %s", e.message)
            self.ray_ok = False
            if self.on_ray_down is not None:
                self.on_ray_down()
            return
        # one query for the unfinished jobs with their current attempts, and one call for
        # Ray's view of every submission: a tick costs O(1) round trips, not O(jobs)
        pairs = self.store.active_jobs_with_attempts()
        try:
            ray = RayView(self.launcher.statuses())
            for job, att in pairs:
                if self._stop.is_set():
                    return
                self.reconcile(job, att, ray)
            self._stop_orphans(ray)
        except Unavailable as e:
            log.warning("Ray not reachable: %s", e.message)

    # -- one job ------------------------------------------------------------------------

    def reconcile(self, job: ActiveJob, att: ActiveAttempt | None, ray: RayView) -> None:
        """One unfinished job and its current attempt (None before the first)."""
        if job.status == "validating_files":
            self._validate_files(job)
            return
        if att is None:
            self._next_attempt(job, "Attempt 1 submitted to Ray")
            return
        if att.state == "submitting":
            # a crash may have come between recording the attempt and Ray taking it: ask
            # Ray itself (not the tick's snapshot, which predates a submission of this tick)
            if self.launcher.status(att.submission_id) is None:
                self._submit(job, att)
            else:
                self.store.update_attempt(job.id, att.number, state="submitted")
            return
        if att.state != "submitted":
            return
        status = ray.status(att.submission_id)
        if status in LIVE:
            return
        # ended, or unknown to the snapshot: make sure with Ray itself before acting
        status = self.launcher.status(att.submission_id)
        if status in LIVE:
            return
        # Ray says the attempt ended (or no longer knows it) and the job is not finished:
        # the driver did not report an end, so it or the head was lost
        fresh = self.store.get_job(job.id)
        if fresh is None or fresh.status in TERMINAL:
            self._end_attempt(att, status)
            return
        self._end_attempt(att, status)
        what = "Ray no longer knows it (head restarted)" if status is None else f"Ray says {status}"
        if att.number >= job.max_attempts:
            self.store.update_job(
                job.id,
                event=f"Attempt {att.number} ended without a result ({what}); no attempts left",
                status="failed",
                status_detail=None,
                error={
                    "code": "attempts_exhausted",
                    "message": f"the job's driver was lost {att.number} time(s) ({what}); "
                    "see GET .../logs",
                    "param": None,
                },
            )
            return
        self.store.update_job(job.id, status_detail="recovering")
        self._next_attempt(
            job,
            f"Attempt {att.number} ended without a result ({what}); attempt {att.number + 1} "
            "resumes from the last checkpoint",
        )

    def _validate_files(self, job: ActiveJob) -> None:
        from service.files import file_path

        for fid in filter(None, (job.training_file, job.validation_file)):
            f = self.store.get_file(job.tenant, fid)
            problem = None
            if f is None:
                problem = f"file {fid} was deleted"
            elif not file_path(self.settings, f).is_file():
                problem = f"file {fid} is missing from the service's storage"
            elif _sha256(file_path(self.settings, f)) != f.sha256:
                problem = f"file {fid} changed on the service's storage (checksum differs)"
            if problem:
                self.store.update_job(
                    job.id,
                    event=f"File validation failed: {problem}",
                    status="failed",
                    error={
                        "code": "invalid_training_file",
                        "message": problem,
                        "param": "training_file",
                    },
                )
                return
        self.store.update_job(job.id, event="Files validated; the job is queued", status="queued")

    def _next_attempt(self, job: ActiveJob, reason: str) -> None:
        att = self.store.start_attempt(job.id, job.attempt + 1, reason)
        if att is not None:
            self._submit(job, att)

    def _submit(self, job: ActiveJob, att: Attempt | ActiveAttempt) -> None:
        env = {
            "PSTAR_DB_URL": self.store.url,
            "PSTAR_DATA_DIR": str(self.settings.data_dir),
        }
        self.launcher.submit(att.submission_id, job.id, att.number, env)
        self.store.update_attempt(job.id, att.number, state="submitted")

    def _end_attempt(self, att: Attempt | ActiveAttempt, status: str | None) -> None:
        self.store.update_attempt(
            att.job_id, att.number, state="ended", ray_status=status or "LOST", ended_at=time.time()
        )
        from service.logs import save_attempt_log

        save_attempt_log(self.settings, self.launcher, att)

    def _stop_orphans(self, ray: RayView) -> None:
        """Attempts of finished jobs: stop what Ray still runs of a cancelled or failed job;
        mark ended what Ray has finished."""
        for att, job in self.store.open_attempts_of_finished_jobs():
            status = ray.status(att.submission_id)
            if status in LIVE:
                if job.status != "succeeded":
                    self.launcher.stop_quietly(att.submission_id)
            elif status in ENDED or status is None:
                self._end_attempt(att, status)


class RayView:
    """Ray's status of every submission it knows, read once per tick."""

    def __init__(self, statuses: dict[str, str]) -> None:
        self._statuses = statuses

    def status(self, submission_id: str) -> str | None:
        return self._statuses.get(submission_id)


def _sha256(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()
