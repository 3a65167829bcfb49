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
harm, because every step is a conditional write. The end of an attempt and what follows
(the next attempt or the failure) are one write; keeping its log comes after and cannot
change the outcome. Each job is reconciled in its own error boundary: one that keeps
raising is retried with backoff, then failed with the cause, and never holds up the rest.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NamedTuple

from sqlalchemy.exc import InterfaceError, OperationalError

from service.control.launcher import ENDED, LIVE
from service.errors import Unavailable
from service.faults import crash_point
from service.settings import Settings, job_env
from service.store import ActiveAttempt, ActiveJob, Attempt, Store
from service.store.models import PAUSED, PAUSED_RAY_STATUS
from service.store.status import AttemptState, JobStatus

log = logging.getLogger(__name__)


class Reconciler:
    def __init__(
        self,
        settings: Settings,
        store: Store,
        launcher: Any,
        interval_s: float = 1.0,
        on_ray_down: Any = None,
        session_workers: Callable[[], Mapping[str, int]] = dict,
    ) -> None:
        self.settings, self.store, self.launcher = settings, store, launcher
        # the engines each tenant's training sessions hold: they count toward its
        # running-workers limit beside its jobs'
        self.session_workers = session_workers
        self.on_ray_down = on_ray_down  # the embedded default restarts its local head
        self.interval_s = interval_s
        self._stop = threading.Event()
        # set when a tick need not wait out the interval: a file check is in, a job has just
        # become queued (each step of a new job used to wait a whole interval)
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self.ticks = 0
        self.ray_ok = True
        self._trouble: dict[str, _Trouble] = {}  # jobs whose reconcile raised, by id
        # file checks hash whole files: off this thread, one at a time
        self._checks = ThreadPoolExecutor(1, thread_name_prefix="pstar-file-check")
        self._checking: dict[str, Future[str | None]] = {}

    # -- the loop -----------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="pstar-reconciler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        self._checks.shutdown(wait=False, cancel_futures=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()  # a wake-up during the tick starts the next one at once
            try:
                self.tick()
            except Exception:  # one bad tick must not end reconciliation
                log.exception("reconciler tick failed")
            self._wake.wait(self.interval_s)

    def wake(self) -> None:
        """Tick now instead of at the end of the interval (thread-safe)."""
        self._wake.set()

    def tick(self) -> None:
        self.ticks += 1
        if self.ticks % SWEEP_EVERY_TICKS == 1:
            self._sweep()
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
        # one query for the unfinished jobs with their current attempts (of the waiting ones
        # only the oldest few) and Ray's view of the open attempts: a tick's cost follows
        # the jobs that run, not the length of the queue
        pairs = self.store.jobs.active_with_attempts(self._waiting_lookahead())
        orphans = self.store.attempts.open_of_finished_jobs()
        try:
            # Ray is asked about the attempts that may have ended, and about no other
            asked = {
                a.submission_id
                for _, a in pairs
                if a is not None and a.state == AttemptState.SUBMITTED
            }
            ray = RayView(self.launcher.statuses(asked | {a.submission_id for a, _ in orphans}))
            shares = TenantShares(self.settings.limits, pairs, self.session_workers())
            waiting: dict[str, str | None] = {}
            for job, att in pairs:
                if self._stop.is_set():
                    return
                # a job waiting for its first attempt, or resumed after a pause, starts
                # only within its tenant's running limits
                starting = att is None or att.paused
                if (
                    starting
                    and job.status == JobStatus.QUEUED
                    and not self._admitted(job, shares, waiting)
                ):
                    continue
                self._guarded(job, att, ray)
            if waiting:  # every new reason to wait (or none) of the tick, in one write
                self.store.jobs.set_status_details(waiting)
            self._stop_orphans(ray, orphans)
        except Unavailable as e:  # Ray or the store went away mid-tick: every job waits
            log.warning("reconciling stopped for this tick: %s", e.message)

    def _waiting_lookahead(self) -> int:
        """How many of a tenant's jobs waiting for a first attempt a tick reads, oldest
        first: more than its running limit admits, so a wide job at the head of the queue
        does not keep a smaller one behind it waiting; past that, a job waits unread (its
        status detail says nothing until it comes near the head)."""
        return 2 * self.settings.limits.max_running_jobs_per_tenant + 8

    def _admitted(
        self, job: ActiveJob, shares: TenantShares, waiting: dict[str, str | None]
    ) -> bool:
        """Whether a queued job's first attempt may start within its tenant's running
        limits; one that may not waits in `queued`, saying for what (in `waiting`, which
        the tick writes once for all)."""
        wait = shares.take(job)
        if wait is None:
            if job.status_detail and job.status_detail.startswith("waiting:"):
                waiting[job.id] = None
            return True
        if job.status_detail != wait:
            waiting[job.id] = wait
        return False

    def _guarded(self, job: ActiveJob, att: ActiveAttempt | None, ray: RayView) -> None:
        """`reconcile` in the job's own error boundary: a job that raises is retried with
        backoff on later ticks and failed after `MAX_JOB_ERRORS` in a row, naming the
        cause; the other jobs of the tick go on either way."""
        trouble = self._trouble.get(job.id)
        if trouble is not None and time.monotonic() < trouble.retry_at:
            return
        self._guarded_call(job, lambda: self.reconcile(job, att, ray))

    def _guarded_call(self, job: ActiveJob, fn: Any) -> None:
        try:
            fn()
        except Unavailable:
            raise
        except (OperationalError, InterfaceError) as e:
            # the store is down or locked: the tick stops, no job is blamed for it
            raise Unavailable(f"the store: {type(e).__name__}: {e}") from None
        except Exception as e:
            self._job_raised(job, e)
        else:
            self._trouble.pop(job.id, None)

    def _job_raised(self, job: ActiveJob, e: Exception) -> None:
        n = (self._trouble[job.id].errors if job.id in self._trouble else 0) + 1
        cause = f"{type(e).__name__}: {e}"
        if n < MAX_JOB_ERRORS:
            delay = min(BACKOFF_CAP_S, BACKOFF_S * 2 ** (n - 1))
            log.warning(
                "job %s: reconciling it failed (%d of %d, next try in %.0f s): %s",
                job.id,
                n,
                MAX_JOB_ERRORS,
                delay,
                cause,
                exc_info=e,
            )
            self._trouble[job.id] = _Trouble(n, time.monotonic() + delay)
            return
        log.error("job %s: reconciling it failed %d times; failing it: %s", job.id, n, cause)
        self._trouble.pop(job.id, None)
        code = getattr(e, "code", None) or "control_plane_error"
        message = (
            f"the control plane could not move this job on ({n} tries over "
            f"{sum(min(BACKOFF_CAP_S, BACKOFF_S * 2**i) for i in range(n - 1)):.0f} s): {cause}"
        )
        try:
            self.store.jobs.update(
                job.id,
                event=f"The job failed: {message}",
                status=JobStatus.FAILED,
                status_detail=None,
                error={"code": code, "message": message[:2000], "param": None},
            )
        except Exception:  # the store refuses this job's row too: nothing more to do here
            log.exception("job %s: could not record its failure", job.id)

    def _sweep(self) -> None:
        from service.control.files import sweep_partial_uploads

        try:
            if n := sweep_partial_uploads(self.settings):
                log.info("removed %d partial upload(s) left by a crash", n)
        except OSError as e:
            log.warning("could not sweep partial uploads: %s", e)
        from service.control import storage
        from service.serving.deployments import delete_model_files

        try:  # deleted models a job was still fine-tuning from, now that it has ended
            if swept := delete_model_files(self.settings, self.store):
                log.info("removed the files of %d deleted model(s)", len(swept))
        except Exception as e:  # the store or the volume: the next sweep tries again
            log.warning("could not remove deleted models' files: %s", e)
        try:  # ended jobs' storage measured, and old runs reclaimed
            storage.sweep(self.settings, self.store)
        except Exception as e:
            log.warning("could not measure or reclaim runs' storage: %s", e)
        try:  # the grader keys of jobs whose driver ended without revoking them
            from service.control import grader_access

            if n := grader_access.sweep(self.store):
                log.info("revoked %d grader key(s) of ended jobs", n)
        except Exception as e:
            log.warning("could not revoke ended jobs' grader keys: %s", e)
        try:  # sessions' checkpoints past their ttl_seconds
            from service.sessions.checkpoints import expire

            if gone := expire(self.settings.data_dir / "sessions"):
                log.info("removed %d expired session checkpoint(s)", len(gone))
        except Exception as e:
            log.warning("could not remove expired session checkpoints: %s", e)

    # -- one job ------------------------------------------------------------------------

    def reconcile(self, job: ActiveJob, att: ActiveAttempt | None, ray: RayView) -> None:
        """One unfinished job and its current attempt (None before the first)."""
        if job.status == JobStatus.VALIDATING_FILES:
            self._validate_files(job)
            return
        if att is None:
            self._next_attempt(job, "Attempt 1 submitted to Ray")
            return
        if att.paused:
            if (
                job.status == JobStatus.QUEUED
            ):  # resumed: a new attempt, which a pause does not spend
                nxt = self.store.attempts.close(
                    job.id,
                    att.number,
                    att.ray_status,
                    next_reason=f"Attempt {att.number + 1} submitted to Ray: it resumes the "
                    "paused job from its checkpoint",
                )
                if nxt is not None:
                    self._submit(job, nxt)
            return
        if att.state == AttemptState.SUBMITTING:
            # a crash may have come between recording the attempt and Ray taking it: ask
            # Ray itself (not the tick's snapshot, which predates a submission of this tick)
            if self.launcher.status(att.submission_id) is None:
                self._submit(job, att)
            else:
                self.store.attempts.update(job.id, att.number, state=AttemptState.SUBMITTED)
            return
        if att.state == AttemptState.SUBMITTED:
            status = ray.status(att.submission_id)
            if status in LIVE:
                return
            # ended, or unknown to the snapshot: make sure with Ray itself before acting
            status = self.launcher.status(att.submission_id)
            if status in LIVE:
                return
        elif att.state == AttemptState.ENDED:
            # ended by a control plane that died before writing what follows (older
            # versions wrote the two apart): carry it forward now
            status = self.launcher.status(att.submission_id)
        else:
            return
        # Ray says the attempt ended (or no longer knows it) and the job is not finished:
        # the driver did not report an end, so it or the head was lost. The end and what
        # follows are one write; the log is kept after it and cannot change the outcome.
        what = "Ray no longer knows it (head restarted)" if status is None else f"Ray says {status}"
        if job.pause_requested:
            # asked to pause, and the attempt ended first (stopped while it waited for
            # resources, or lost): the job pauses where its last checkpoint left it
            self.store.attempts.close(
                job.id,
                att.number,
                status,
                pause=f"Job paused: attempt {att.number} ended ({what}) before it trained on; "
                "resume continues from the last checkpoint",
            )
            self._keep_log(att)
            return
        if att.number - job.pauses >= job.max_attempts:  # attempts a pause ended are free
            self.store.attempts.close(
                job.id,
                att.number,
                status,
                failure={
                    "event": f"Attempt {att.number} ended without a result ({what}); "
                    "no attempts left",
                    "error": {
                        "code": "attempts_exhausted",
                        "message": f"the job's driver was lost {att.number} time(s) ({what}); "
                        "see GET .../logs",
                        "param": None,
                    },
                },
            )
            self._keep_log(att)
            return
        nxt = self.store.attempts.close(
            job.id,
            att.number,
            status,
            next_reason=f"Attempt {att.number} ended without a result ({what}); attempt "
            f"{att.number + 1} resumes from the last checkpoint",
        )
        crash_point("attempt-closed")
        self._keep_log(att)
        if nxt is not None:
            self._submit(job, nxt)

    def _validate_files(self, job: ActiveJob) -> None:
        """Check the job's files (present, stored size and checksum) on the file-check
        thread; the verdict is acted on at the first tick after it is in."""
        check = self._checking.get(job.id)
        if check is None:
            check = self._checks.submit(self._file_problem, job)
            self._checking[job.id] = check
            check.add_done_callback(lambda _f: self.wake())
            return
        if not check.done():
            return
        del self._checking[job.id]
        problem = check.result()  # a check that raised goes to the job's error boundary
        if problem:
            self.store.jobs.update(
                job.id,
                event=f"File validation failed: {problem}",
                status=JobStatus.FAILED,
                error={
                    "code": "invalid_training_file",
                    "message": problem,
                    "param": "training_file",
                },
            )
            return
        # only from validating_files: a job paused meanwhile stays paused (paused -> queued
        # is a resume's change, legal in the table, and not this write's to make)
        self.store.jobs.update(
            job.id,
            event="Files validated; the job is queued",
            status=JobStatus.QUEUED,
            only_from=JobStatus.VALIDATING_FILES,
        )
        self.wake()  # its first attempt is submitted by the next tick

    def _file_problem(self, job: ActiveJob) -> str | None:
        from service.control.files import file_path

        for fid in filter(None, (job.training_file, job.validation_file)):
            f = self.store.files.get(job.tenant, fid)
            if f is None:
                return f"file {fid} was deleted"
            path = file_path(self.settings, f)
            if not path.is_file():
                return f"file {fid} is missing from the service's storage"
            if path.stat().st_size != f.bytes:
                return f"file {fid} changed on the service's storage (size differs)"
            if _sha256(path) != f.sha256:
                return f"file {fid} changed on the service's storage (checksum differs)"
        return None

    def _next_attempt(self, job: ActiveJob, reason: str) -> None:
        att = self.store.attempts.start(job.id, job.attempt + 1, reason)
        crash_point("attempt-recorded")
        if att is not None:
            self._submit(job, att)

    def _submit(self, job: ActiveJob, att: Attempt | ActiveAttempt) -> None:
        # no secret: Ray's dashboard shows a job's environment (see `job_env`)
        env = job_env(self.settings)
        self.launcher.submit(att.submission_id, job.id, att.number, env)
        crash_point("ray-has-attempt")
        self.store.attempts.update(job.id, att.number, state=AttemptState.SUBMITTED)

    def _keep_log(self, att: Attempt | ActiveAttempt) -> None:
        """Copy an ended attempt's Ray log into the job's directory. Best effort: a full
        or read-only disk loses the copy, never the job."""
        from service.control.logs import save_attempt_log

        try:
            save_attempt_log(self.settings, self.launcher, att)
        except Exception as e:
            log.warning("could not keep the log of %s: %s", att.submission_id, e)

    def _stop_orphans(self, ray: RayView, orphans: list[tuple[Attempt, Any]]) -> None:
        """Attempts of finished jobs: stop what Ray still runs of a cancelled or failed job;
        mark ended what Ray has finished."""
        for att, job in orphans:
            status = ray.status(att.submission_id)
            paused = job.status == PAUSED
            if status in LIVE:
                # a paused job's driver ends by itself, once its workers have paused
                if job.status != JobStatus.SUCCEEDED and not paused:
                    self.launcher.stop_quietly(att.submission_id)
            elif status in ENDED or status is None:
                self.store.attempts.close(
                    att.job_id, att.number, PAUSED_RAY_STATUS if paused else status
                )
                self._keep_log(att)


SWEEP_EVERY_TICKS = 60  # partial uploads left by a crash: looked for at start, then this often
MAX_JOB_ERRORS = 5  # a job whose reconcile raises this many times in a row fails
BACKOFF_S, BACKOFF_CAP_S = 2.0, 60.0  # between its tries: 2, 4, 8, 16 s


class _Trouble(NamedTuple):
    errors: int
    retry_at: float  # time.monotonic()


class TenantShares:
    """What each tenant's jobs with an attempt take now (jobs, workers, GPUs), from the
    tick's snapshot, and whether one more fits its running limits."""

    def __init__(
        self,
        limits: Any,
        pairs: list[tuple[ActiveJob, ActiveAttempt | None]],
        sessions: Mapping[str, int] | None = None,
    ) -> None:
        self.limits = limits
        self.used: dict[str, list[int]] = {}
        self.sessions = dict(sessions or {})  # workers held by training sessions' engines
        for tenant, workers in self.sessions.items():
            self.used.setdefault(tenant, [0, 0, 0])[1] += workers
        for job, att in pairs:
            if att is not None and not att.paused:  # a resumed job waits like a new one
                self._add(job)

    def _add(self, job: ActiveJob) -> None:
        u = self.used.setdefault(job.tenant, [0, 0, 0])
        u[0] += 1
        u[1] += job.workers
        u[2] += job.gpus

    def take(self, job: ActiveJob) -> str | None:
        """None (and the job's share counted) if it fits; else why it waits."""
        jobs, workers, gpus = self.used.get(job.tenant, (0, 0, 0))
        lim = self.limits
        for what, now, need, limit in (
            ("jobs", jobs, 1, lim.max_running_jobs_per_tenant),
            ("workers", workers, job.workers, lim.max_running_workers_per_tenant),
            ("GPUs", gpus, job.gpus, lim.max_running_gpus_per_tenant),
        ):
            if need and now + need > limit:
                name = {"jobs": "jobs", "workers": "workers", "GPUs": "gpus"}[what]
                var = f"PSTAR_MAX_RUNNING_{name.upper()}_PER_TENANT"
                held = self.sessions.get(job.tenant, 0) if what == "workers" else 0
                inside = f", {held} in training sessions" if held else ""
                return (
                    f"waiting: the tenant runs {now} {what} of its {limit} ({var}{inside}); "
                    f"this job needs {need}"
                )[:255]
        self._add(job)
        return None


def job_workers(store: Store, tenant: str) -> int:
    """Workers the tenant's running jobs take now (a paused or waiting job none), as the
    reconciler counts them."""
    return TenantShares(None, store.jobs.active_with_attempts(0)).used.get(tenant, [0, 0, 0])[1]


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
