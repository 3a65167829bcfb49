"""What the workers of a job tell the world while it runs.

Rank 0 writes to the store (status and phase, a metrics point and an OpenAI-style metrics
event per step, or per k-th step of a run longer than `MAX_RECORDED_STEPS`, the tracer
timeline, checkpoints); every rank sets Ray metrics gauges
(`ray_pstar_<name>` on the node's metrics port, tagged job id, attempt and rank) for
Prometheus. A store that cannot be written is logged and training goes on: metrics are
worth less than the run; the writes wait in order and go in once the store answers again.
A write the store refuses because another attempt owns the job (`StaleAttempt`) is the
exception: it ends this worker, and the driver stops.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

PENDING_WRITES = 10_000  # writes kept through a store outage: ~2 per step, hours of them
PAUSE_POLL_S = 1.0  # how often rank 0 asks the store whether a pause was asked for
# a job records the metrics of at most about this many steps: past it, every k-th step
# (`recorded`), each evaluation, checkpoint, pause and the last; gauges see every step
MAX_RECORDED_STEPS = 10_000

GAUGES = (
    "train_loss",
    "valid_loss",
    "tokens_per_second",
    "step_time_s",
    "tflops",
    "lr",
    "model_data_bytes_device",
    "model_data_bytes_host",
    "model_data_bytes_disk",
    "peak_non_model_bytes",
    "memory_utilization",
    "comm_bytes_sent",
    "bytes_moved",  # over every tier-to-tier direction, in the step
    # DPO's (service.methods.dpo_objective)
    "reward_margin",
    "reward_accuracy",
    "chosen_reward",
    "rejected_reward",
)


def metrics_message(step: int, total: int | None, v: dict[str, Any]) -> str:
    parts = []
    if "train_loss" in v:
        parts.append(f"training loss={v['train_loss']:.4f}")
    if v.get("valid_loss") is not None:
        parts.append(f"validation loss={v['valid_loss']:.4f}")
    if "tokens_per_second" in v:
        parts.append(f"{v['tokens_per_second']:.0f} tokens/s")
    where = f"Step {step}/{total}" if total else f"Step {step}"
    return f"{where}: " + ", ".join(parts)


def recorded(step: int, total: int | None, values: dict[str, Any]) -> bool:
    """Whether the store gets this step's metrics point, event and progress: every step of
    a run up to `MAX_RECORDED_STEPS` steps; of a longer one every k-th, so that it has
    about that many, and every step that evaluated."""
    if not total or total <= MAX_RECORDED_STEPS:
        return True
    stride = -(-total // MAX_RECORDED_STEPS)
    evaluated = "valid_loss" in values or "full_valid_loss" in values
    return step % stride == 0 or step >= total or evaluated


class Reporter:
    def __init__(self, config: dict[str, Any], rank: int, store: Any = None) -> None:
        self.job_id, self.attempt, self.rank = config["job_id"], config["attempt"], rank
        self.run = config["run"]
        self.store = store
        self._phase: str | None = None
        # writes the store refused (not as stale): (what, fn, args, kwargs), oldest first
        self._pending: list[tuple[str, Any, tuple, dict]] = []
        self._last: dict[str, Any] = {}
        # the last step `recorded` left out: written after all if a checkpoint, a pause or
        # the end lands on it (a resumed attempt reads its numbers)
        self._left_out: tuple[int, dict[str, Any], int | None] | None = None
        self._gauges: dict[str, Any] = {}
        self._pause, self._pause_read_at = False, float("-inf")
        try:
            from ray.util.metrics import Gauge

            tags = {"job_id": self.job_id, "attempt": str(self.attempt), "rank": str(rank)}
            for name in GAUGES:
                g = Gauge(f"pstar_{name}", f"pstar {name}", tag_keys=tuple(tags))
                g.set_default_tags(tags)
                self._gauges[name] = g
        except Exception as e:  # outside Ray (tests of the loop) there are no Ray metrics
            log.debug("no Ray metrics: %s", e)

    @classmethod
    def for_rank(cls, config: dict[str, Any], rank: int, world: int) -> Reporter:
        store = None
        if rank == 0:
            from service.settings import Settings
            from service.store import Store

            # the store's address as the driver reads it (service.settings.job_env)
            store = Store(Settings.from_env().db_url, pool_size=2)
        return cls(config, rank, store)

    def _write(self, what: str, fn, *args: Any, **kwargs: Any) -> Any:
        """`fn(*args, **kwargs)` against the store. While the store cannot be written (an
        outage, a failover), writes wait here in order, up to `PENDING_WRITES`, and go
        in before the next one once it answers: a step trained meanwhile keeps its
        metrics and checkpoint. Reads (`what` empty) are not kept."""
        if self.store is None:
            return None
        if self._pending and not self._flush():
            if what:
                self._keep(what, fn, args, kwargs)
            return None
        return self._try(what, fn, args, kwargs)

    def _try(self, what: str, fn, args: tuple, kwargs: dict) -> Any:
        from service.store import StaleAttempt

        try:
            return fn(*args, **kwargs)
        except StaleAttempt:
            raise  # another attempt owns the job: this one must stop, not go on quietly
        except Exception as e:
            if what:
                log.warning(
                    "could not write %s of %s to the store (kept to retry): %s",
                    what,
                    self.job_id,
                    e,
                )
                self._keep(what, fn, args, kwargs)
            return None

    def _keep(self, what: str, fn, args: tuple, kwargs: dict) -> None:
        if len(self._pending) >= PENDING_WRITES:
            dropped = self._pending.pop(0)
            log.error("dropping %s of %s: the store is down too long", dropped[0], self.job_id)
        self._pending.append((what, fn, args, kwargs))

    def _flush(self) -> bool:
        """Write what waits, oldest first; True once nothing does."""
        from service.store import StaleAttempt

        while self._pending:
            what, fn, args, kwargs = self._pending[0]
            try:
                fn(*args, **kwargs)
            except StaleAttempt:
                raise
            except Exception as e:
                log.debug("the store still refuses %s of %s: %s", what, self.job_id, e)
                return False
            self._pending.pop(0)
        log.info("the store answers again; the writes kept meanwhile are in")
        return True

    def flush(self, timeout_s: float = 120.0) -> bool:
        """Before the worker ends: keep trying the waiting writes for up to `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while self._pending and not self._flush() and time.monotonic() < deadline:
            time.sleep(1.0)
        if self._pending:
            log.error("%d write(s) of %s never reached the store", len(self._pending), self.job_id)
        return not self._pending

    def phase(self, detail: str) -> None:
        if detail != self._phase:
            self._phase = detail
            self._write(
                "the phase",
                self.store and self.store.jobs.update,
                self.job_id,
                attempt=self.attempt,
                status_detail=detail,
            )

    def event(self, message: str, **data: Any) -> None:
        self._write(
            "an event",
            self.store and self.store.events.add,
            self.job_id,
            message,
            data=data or None,
            attempt=self.attempt,
        )

    def runtime(self, values: dict[str, Any]) -> None:
        """What the engine decided on this hardware (the job object shows it)."""
        self._write(
            "the runtime",
            self.store and self.store.jobs.update,
            self.job_id,
            attempt=self.attempt,
            runtime=values,
        )

    def resumed(self, step: int) -> None:
        self.event(f"Attempt {self.attempt} resumed from the checkpoint at step {step}")

    def running(self) -> None:
        self._write(
            "the status", self.store and self.store.jobs.mark_running, self.job_id, self.attempt
        )

    def metrics(
        self, step: int, values: dict[str, Any], note: str = "", total: int | None = None
    ) -> None:
        moved = [v for k, v in values.items() if k.startswith("bytes_moved_")]
        for k, v in [*values.items(), ("bytes_moved", sum(moved) if moved else None)]:
            if k in self._gauges and isinstance(v, (int, float)):
                self._gauges[k].set(float(v))
        if self.store is None:
            return
        self._last = dict(values)
        if not recorded(step, total, values):
            self._left_out = (step, dict(values), total)
            return
        self._left_out = None
        self._record(step, values, note, total)

    def _record_left_out(self, step: int) -> None:
        if self._left_out is not None and self._left_out[0] == step:
            left, self._left_out = self._left_out, None
            self._record(left[0], left[1], "", left[2])

    def _record(self, step: int, values: dict[str, Any], note: str, total: int | None) -> None:
        assert self.store is not None
        msg = metrics_message(step, total, values) + (f" ({note})" if note else "")
        self._write(
            "metrics",
            self.store.events.record_metrics,
            self.job_id,
            self.attempt,
            step,
            {**values, "step": step},
            msg,
        )
        if total:
            eta = {}
            if values.get("estimated_finish") is not None:  # the loop's (service.worker.eta)
                eta["estimated_finish"] = int(values["estimated_finish"])
            self._write(
                "progress",
                self.store.jobs.update,
                self.job_id,
                attempt=self.attempt,
                progress_step=step,
                progress_total=total,
                **eta,
            )

    def last_values(self) -> dict[str, Any]:
        if self._last or self.store is None:
            return dict(self._last)
        points = self._write("", self.store.events.metric_points, self.job_id) or []
        return dict(points[-1].values) if points else {}

    def values_at(self, step: int) -> dict[str, Any]:
        """The numbers recorded for `step` (what a resumed attempt continues from)."""
        if self.store is None or step == 0:
            return {}
        points = self._write("", self.store.events.metric_points, self.job_id, step, step) or []
        return dict(points[0].values) if points else {}

    def stats(self, stats: dict[str, Any]) -> None:
        if self.store is None:
            return
        self._write(
            "tracer stats",
            self.store.events.set_stats,
            self.job_id,
            trace=stats["tracer"],
            tiers=stats["tiers"],
            attempt=self.attempt,
        )

    def checkpoint(self, step: int, values: dict[str, Any], final: bool, dir_name: str) -> None:
        """Record the checkpoint Ray Train wrote to `<storage>/<job id>/<dir_name>`."""
        if self.store is None:
            return
        self._record_left_out(step)
        assert self.run.storage_path is not None  # a job's run is on Ray's storage
        self._write(
            "a checkpoint",
            self.store.checkpoints.add,
            self.job_id,
            step,
            {k: v for k, v in values.items() if isinstance(v, (int, float))},
            str(Path(self.run.storage_path) / self.job_id / dir_name),
            keep=self.run.checkpoints_to_keep,
            final=final,
            attempt=self.attempt,
        )

    def early_stopping(self, view: dict[str, Any]) -> None:
        """Early stopping's settings and findings, for the job object."""
        self._write(
            "early stopping",
            self.store and self.store.jobs.update,
            self.job_id,
            attempt=self.attempt,
            early_stopping=view,
        )

    def pause_requested(self) -> bool:
        """Whether the job's owner asked to pause it (rank 0 reads the store, at most every
        `PAUSE_POLL_S`; a store that cannot be read asks for nothing)."""
        if self.store is None:
            return False
        now = time.monotonic()
        if now - self._pause_read_at >= PAUSE_POLL_S:
            self._pause_read_at = now
            got = self._write("", self.store.jobs.pause_requested, self.job_id)
            self._pause = bool(got)
        return self._pause

    def paused(self, step: int) -> None:
        """The pause's checkpoint is written: the job is paused (the attempt ends with its
        driver, which reads the pause in the run's last report)."""
        if self.store is not None:
            self._record_left_out(step)
        self._write(
            "the pause", self.store and self.store.jobs.paused, self.job_id, self.attempt, step
        )

    def finished(self, final: dict[str, Any]) -> None:
        if "full_valid_loss" in final:
            also = [
                f"{label} {final[k]:.3f}"
                for k, label in (
                    ("full_valid_mean_token_accuracy", "token accuracy"),
                    ("full_valid_reward_accuracy", "reward accuracy"),
                    ("full_valid_reward_margin", "reward margin"),
                )
                if isinstance(final.get(k), (int, float))
            ]
            self.event(
                f"Full validation loss {final['full_valid_loss']:.4f}"
                + "".join(f", {x}" for x in also),
                **final,
            )
