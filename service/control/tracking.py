"""A job's experiment trackers (`integrations`: W&B, MLflow), run by its driver.

The driver starts a `Tracking` beside the Ray Train workers: one run per tracker, the
job's config logged once (its model, method, hyperparameters as decided, resources), then
a thread that reads the job's new metric points from the store every few seconds and logs
them at their steps; when the workers end, the last points and the run's end (finished,
failed, paused). The workers never talk to a tracker: the store is what they report to.

Where a tracker logs is the operator's, read from the driver's environment (never the
request): W&B online with `WANDB_API_KEY` (and `WANDB_BASE_URL` for a server of one's
own), else offline run files under the job's directory (`wandb sync` uploads them later);
MLflow at `PSTAR_MLFLOW_TRACKING_URI`, else a SQLite store in the job's directory.

Each run keeps one id across attempts (W&B: the job id, resumed; MLflow: the run id
recorded in the store), so a resumed job's points go on in the same run. The job object
shows each run's URL (`jobs.integrations`). A tracker that fails (no network, a bad key, a
full disk) stops logging with a warning event; it never fails the job.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from pathlib import Path
from typing import Any

from service.spec.integrations import settings_of

log = logging.getLogger("pstar.tracking")

POLL_S = 5.0
MLFLOW_EXPERIMENT = "pstar-fine-tuning"


class Tracker:
    """One tracker's run: `start`, `log` points, `end`; each raises on failure."""

    kind: str
    run_id: str | None = None
    url: str | None = None

    def start(self, config: dict[str, Any]) -> None: ...
    def log(self, step: int, values: dict[str, float]) -> None: ...
    def end(self, state: str) -> None: ...


class WandbTracker(Tracker):
    kind = "wandb"

    def __init__(self, settings: dict[str, Any], job_id: str, job_dir: Path) -> None:
        self.settings, self.job_id, self.dir = settings, job_id, job_dir / "wandb"
        self.run: Any = None
        self.runs_dir = job_dir.parent

    def start(self, config: dict[str, Any]) -> None:
        import wandb

        self.dir.mkdir(parents=True, exist_ok=True)
        online = bool(os.environ.get("WANDB_API_KEY"))
        self.run = wandb.init(
            project=self.settings["project"],
            entity=self.settings.get("entity"),
            name=self.settings.get("name") or self.job_id,
            tags=self.settings.get("tags"),
            id=self.job_id,  # the same run across attempts
            resume="allow",
            config=config,
            dir=str(self.dir),
            mode="online" if online else "offline",
            settings=wandb.Settings(silent=True, console="off", x_disable_stats=True),
        )
        self.run_id = self.run.id
        # offline: where the run's files are, under the service's runs directory
        self.url = self.run.url if online else str(Path(self.run.dir).relative_to(self.runs_dir))

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def end(self, state: str) -> None:
        import wandb

        try:
            self.run.finish(exit_code=1 if state == "failed" else 0)
        finally:
            wandb.teardown()  # its service process ends with the run


class MlflowTracker(Tracker):
    kind = "mlflow"

    def __init__(
        self,
        settings: dict[str, Any],
        job_id: str,
        job_dir: Path,
        run_id: str | None,
        tenant: str,
    ) -> None:
        self.settings, self.job_id, self.run_id, self.tenant = settings, job_id, run_id, tenant
        # MLflow's own default store: a SQLite file (its file store is frozen)
        self.uri = (
            os.environ.get("PSTAR_MLFLOW_TRACKING_URI") or f"sqlite:///{job_dir / 'mlflow.db'}"
        )
        self.client: Any = None

    def start(self, config: dict[str, Any]) -> None:
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=self.uri)
        if self.run_id is None:  # the first attempt; a later one goes on in the same run
            # a tenant's experiments are its own: named under it
            name = f"{self.tenant}/{self.settings.get('experiment') or MLFLOW_EXPERIMENT}"
            exp = self._experiment(name)
            ours = {"pstar.job_id": self.job_id, "pstar.tenant": self.tenant}
            run = self.client.create_run(
                exp,
                run_name=self.settings.get("run_name") or self.job_id,
                tags={**(self.settings.get("tags") or {}), **ours},
            )
            self.run_id = run.info.run_id
            for k, v in _flat(config).items():
                self.client.log_param(self.run_id, k, v)
        else:
            self.client.update_run(self.run_id, status="RUNNING")
        exp_id = self.client.get_run(self.run_id).info.experiment_id
        # where MLflow's UI shows the run, served at (or pointed at) the tracking URI; a
        # local store is named by the job, not by a path on the server
        if self.uri.startswith(("http://", "https://")):
            self.url = f"{public(self.uri).rstrip('/')}/#/experiments/{exp_id}/runs/{self.run_id}"
        else:
            self.url = (
                f"mlflow.db in the job's run directory: experiment {exp_id}, run {self.run_id}"
            )

    def _experiment(self, name: str) -> str:
        """The experiment's id, made if there is none (another job may make it first)."""
        found = self.client.get_experiment_by_name(name)
        if found is not None:
            return str(found.experiment_id)
        try:
            return str(self.client.create_experiment(name))
        except Exception:
            found = self.client.get_experiment_by_name(name)
            if found is None:
                raise
            return str(found.experiment_id)

    def log(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, float(v), now, step) for k, v in values.items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def end(self, state: str) -> None:
        status = {"finished": "FINISHED", "failed": "FAILED"}.get(state, "KILLED")
        self.client.set_terminated(self.run_id, status=status)


_USERINFO = re.compile(r"(?<=://)[^/@\s]+@")


def public(text: str) -> str:
    """`text` with the user and password of every URL in it left out (an operator's
    tracking URI may hold them; a tenant sees the URL and the errors)."""
    return _USERINFO.sub("", text)


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """A nested config as MLflow's flat params (values cut to its 6000 characters)."""
    out: dict[str, str] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flat(v, key + "."))
        else:
            out[key] = str(v)[:6000]
    return out


def numbers(values: dict[str, Any]) -> dict[str, float]:
    """The values a tracker takes: finite numbers (not bools, not the estimate's time)."""
    import math

    return {
        k: float(v)
        for k, v in values.items()
        if isinstance(v, (int, float))
        and not isinstance(v, bool)
        and math.isfinite(v)
        and k != "estimated_finish"
    }


class Tracking:
    """The job's trackers, fed from the store by a thread (see the module docstring)."""

    def __init__(self, store: Any, job: Any, attempt: int, trackers: list[Tracker]) -> None:
        self.store, self.job_id, self.attempt = store, job.id, attempt
        self.trackers = trackers
        self.state: list[dict[str, Any]] = []
        self.after = -1  # the last step logged
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    @classmethod
    def start(cls, settings: Any, store: Any, job: Any, attempt: int) -> Tracking | None:
        """The job's trackers started (None when it has none), logging from now on."""
        from service.spec.job import spec_of

        spec = spec_of(job)
        if not spec.integrations:
            return None
        before = {s["type"]: s for s in job.integrations or []}
        job_dir = settings.job_dir(job.id)
        trackers: list[Tracker] = []
        for i in spec.integrations:
            own = settings_of(i)
            if i["type"] == "wandb":
                trackers.append(WandbTracker(own, job.id, job_dir))
            else:
                run_id = before.get("mlflow", {}).get("run_id")
                trackers.append(MlflowTracker(own, job.id, job_dir, run_id, job.tenant))
        tracking = cls(store, job, attempt, trackers)
        # a later attempt goes on after the last step every run had logged
        logged = [s.get("step", -1) for s in before.values() if s.get("state") != "failed"]
        tracking.after = min(logged) if logged else -1
        config = {
            "model": job.model,
            "method": spec.method.type,
            "hyperparameters": spec.hyperparameters.model_dump(mode="json"),
            "resources": spec.resources.model_dump(mode="json"),
            "seed": job.seed,
            "suffix": spec.suffix,
        }
        config["hyperparameters"].pop("grader", None)  # the tenant's text: not a param
        for t in list(tracking.trackers):
            try:
                t.start(config)
                tracking._record(t, "logging")
            except Exception as e:
                tracking._failed(t, e)
        tracking._thread = threading.Thread(
            target=tracking._loop, name="pstar-tracking", daemon=True
        )
        tracking._thread.start()
        return tracking

    def _record(self, t: Tracker, state: str, error: str | None = None) -> None:
        entry = {
            "type": t.kind,
            "run_id": t.run_id,
            "url": t.url,
            "state": state,
            "error": error,
            "step": self.after,  # the last step it logged
        }
        self.state = [s for s in self.state if s["type"] != t.kind] + [entry]
        try:
            self.store.jobs.update(self.job_id, attempt=self.attempt, integrations=self.state)
        except Exception as e:  # the store's own trouble: the next record writes it
            log.warning("could not record the %s run of %s: %s", t.kind, self.job_id, e)

    def _failed(self, t: Tracker, e: BaseException) -> None:
        why = public(f"{type(e).__name__}: {e}")[:500]
        log.warning("%s logging of job %s stopped: %s", t.kind, self.job_id, why)
        if t in self.trackers:
            self.trackers.remove(t)
        self._record(t, "failed", why)
        try:
            self.store.events.add(
                self.job_id,
                f"{t.kind} logging stopped ({why}); the job goes on without it",
                level="warn",
                attempt=self.attempt,
            )
        except Exception:
            log.warning("could not say so in the job's events")

    def _loop(self) -> None:
        while not self._stop.wait(POLL_S):
            self.flush()

    def flush(self) -> None:
        """Log the store's points past the last step logged."""
        with self._lock:
            try:
                points = self.store.events.metric_points(self.job_id, step_from=self.after + 1)
            except Exception as e:
                log.warning("could not read job %s's metrics: %s", self.job_id, e)
                return
            for p in points:
                values = numbers(p.values)
                for t in list(self.trackers):
                    try:
                        t.log(p.step, values)
                    except Exception as e:
                        self._failed(t, e)
                self.after = max(self.after, p.step)
            if points:
                for t in self.trackers:
                    self._record(t, "logging")

    def end(self, state: str) -> None:
        """The last points, then each run's end: `finished`, `failed`, `cancelled`, or
        `paused` and `interrupted` (a later attempt goes on in the same run). Once."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        self.flush()
        for t in list(self.trackers):
            try:
                t.end(state)
                self._record(t, state)
            except Exception as e:
                self._failed(t, e)
