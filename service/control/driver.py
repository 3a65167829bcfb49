"""The Ray job driver of one attempt: `python -m service.control.driver JOB_ID ATTEMPT`.

Ray runs it as the entrypoint of Ray job `<job-id>-a<attempt>`; its environment names the
data dir and the file that holds the store's URL (never the URL: the Ray dashboard shows
a job's environment). It prepares the data (once per job: the encoded rows are cached in
the job's directory), runs `TorchTrainer` with the job's worker (`service.worker.finetune.
train_func` around the one loop of `service.worker.loop`), and reports the end: `succeeded`
with the fine-tuned model, trained tokens and a metrics CSV, or `failed` with the reason.
A driver that dies before reporting leaves the job active; the reconciler then starts the
next attempt, which resumes from the run's last checkpoint (same run name and storage).
Every write of a driver is fenced to its attempt: one that the reconciler has replaced
writes nothing, and stops itself once it notices (`watch_currency`). A store that cannot
be reached is waited for (`through_outage`): a finished training is not lost to an outage.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import logging
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from service.control import grader_access
from service.control.files import file_path
from service.control.grader_access import asks_models
from service.data.datasets import DataError
from service.data.prepare import prepare_files
from service.methods import rollouts
from service.registry import fine_tuned_name
from service.settings import Settings
from service.spec import auto
from service.spec.job import JobSpec, spec_of
from service.spec.run_plan import CHECKPOINTS_TO_KEEP, RunHyperparameters, RunPlan
from service.store import File, Job, StaleAttempt, Store
from service.store.models import PAUSED
from service.store.statements import View
from service.store.status import JobStatus

log = logging.getLogger("pstar.driver")


ROWS_LAYOUT = "npy-int32"  # `service.data.rows`: rows written by older code are made again


def _data_file(settings: Settings, job: Job, train: File | View, valid: File | View | None) -> Path:
    """The directory of the job's rows: named by what they are made from, so a new
    attempt reuses them."""
    made_of = [train.sha256, valid.sha256 if valid else None, job.plan, ROWS_LAYOUT]
    key = hashlib.sha256(json.dumps(made_of, sort_keys=True).encode()).hexdigest()[:16]
    return settings.job_dir(job.id) / "data" / f"rows-{key}"


PrepareFiles = Callable[[JobSpec, Path, Path | None, Path, Path], dict[str, Any]]


def prepare_run(
    settings: Settings,
    store: Store,
    job: Job,
    attempt: int,
    prepare_with: PrepareFiles = prepare_files,
) -> RunPlan:
    """Tokenize (or reuse the cached rows) and decide everything the workers need. The
    driver prepares `on_a_worker`; by default (tests, tools) in this process."""
    job_dir = settings.job_dir(job.id)
    spec = spec_of(job)
    train = store.files.get(job.tenant, job.training_file)
    valid = store.files.get(job.tenant, job.validation_file) if job.validation_file else None
    if train is None or (job.validation_file and valid is None):
        raise DataError("a file of this job was deleted")
    data_file = _data_file(settings, job, train, valid)
    meta_file = data_file.with_suffix(".json")
    if not meta_file.is_file():
        store.jobs.update(job.id, attempt=attempt, status_detail="preparing data")
        meta = prepare_with(
            spec,
            file_path(settings, train),
            file_path(settings, valid) if valid else None,
            job_dir / "tokenizer",
            data_file,
        )
        if "error" in meta:
            raise DataError(meta["error"])
        tr = meta["training_file"]
        if meta["format"] == "prompts":  # no tokens of the file are trained on: answers are
            said = (
                f"Data: {tr['examples']} training prompts -> {tr['rows']} rows of "
                f"{meta['seq_len']} tokens ({meta['layout']}; {tr['dropped_examples']} "
                f"dropped as too long to leave room for an answer); {meta['total_steps']} steps"
            )
        else:
            said = (
                f"Data: {tr['examples']} training examples -> {tr['rows']} rows of "
                f"{meta['seq_len']} tokens ({meta['layout']}, {tr['fill_ratio']:.0%} filled; "
                f"{tr['loss_tokens']} tokens trained on; {tr['truncated_examples']} truncated, "
                f"{tr['dropped_examples']} dropped); {meta['total_steps']} steps"
            )
        store.events.add(job.id, said, data=meta, attempt=attempt)
    meta = json.loads(meta_file.read_text())
    if job.data_report is None:
        store.jobs.update(
            job.id,
            attempt=attempt,
            data_report=_data_report(meta),
            memory_plan=_memory_plan(store, job, meta, attempt),
        )
    total = meta["total_steps"]
    hp = dict(spec.hyperparameters.model_dump(), seq_len=meta["seq_len"])
    engine = spec.engine_config()
    spill = str(settings.spill_dir(job.id))
    engine["memory"] = {**(engine.get("memory") or {}), "disk_dir": spill}
    store.jobs.update(job.id, attempt=attempt, progress_total=total)
    early = spec.early_stopping
    key_file = None
    on_server = hp.get("sampler") == "server"
    if asks_models(hp.get("grader")) or on_server:
        key_file = grader_access.grant(settings, store, job.id, job.tenant, attempt)
    return RunPlan(
        grader_api_url=settings.api_url if key_file is not None else None,
        grader_key_file=str(key_file) if key_file is not None else None,
        embedding_model=settings.embedding_model_name if key_file is not None else None,
        sampler_dir=str(rollouts.sampler_dir(job_dir, attempt)) if on_server else None,
        job_id=job.id,
        attempt=attempt,
        resume_from=_newest_checkpoint(store, job.id) if attempt > 1 else None,
        model=spec.model.model_dump(),
        method=spec.method.type,
        lora=spec.trains_adapters,
        early_stopping=early.model_dump() if early is not None else None,
        # the best evaluation's model, kept across attempts while early stopping watches
        best_dir=str(job_dir / "best"),
        engine=engine,
        hyperparameters=RunHyperparameters(**hp),
        seq_len=meta["seq_len"],
        vocab_size=meta["vocab_size"],
        total_steps=total,
        steps_per_epoch=meta["steps_per_epoch"],
        checkpoint_every=auto.checkpoint_every(spec.checkpoint_every, total, True),
        seed=job.seed,
        data_file=str(data_file),
        # a zoo model's tokenizer was trained on the data: the export carries it
        tokenizer_dir=str(job_dir / "tokenizer") if spec.model.kind == "zoo" else None,
        export_dir=str(settings.finetuned_dir(job.id)),
        storage_path=str(job_dir / "ray"),
    )


def on_a_worker(spec: JobSpec, job_id: str) -> PrepareFiles:
    """`prepare_files` as a Ray task shaped like one of the job's workers (its CPUs and the
    memory Ray reserves for one), which the workers do not hold yet: the whole files are
    read and tokenized there, never on the head (its CPUs are 0 in a cluster) or in the
    control plane. Out of memory there, the job fails saying what to raise."""
    import ray

    res = spec.resources
    options: dict[str, Any] = {"num_cpus": res.cpus_per_worker, "name": f"prepare {job_id}"}
    if res.memory_per_worker:
        options["memory"] = res.memory_per_worker
    task = ray.remote(prepare_files).options(**options)

    def run(*args: Any) -> dict[str, Any]:
        try:
            return ray.get(task.remote(*args))
        except ray.exceptions.OutOfMemoryError:
            held = (
                f"{res.memory_per_worker / 2**30:.1f} GiB reserved"
                if res.memory_per_worker
                else "no memory reserved"
            )
            return {
                "error": f"preparing the data ran out of memory on its worker ({held}); "
                "give the job more with resources.memory_per_worker, or a smaller file"
            }

    return run


def _memory_plan(
    store: Store, job: Job, meta: dict[str, Any], attempt: int
) -> dict[str, Any] | None:
    """The capacity planner's plan of the job (as the dry run makes it), with its data's
    real row length; an event says what it found. A plan that cannot be made is logged
    and left out: it never stops the job."""
    from service.control.estimate import estimate_memory

    rows_per_example = 2 if meta["format"] == "preference" else 1
    try:
        plan = estimate_memory(spec_of(job), meta["seq_len"], meta["vocab_size"], rows_per_example)
    except Exception as e:  # a model the planner cannot read: the job runs regardless
        log.warning("job %s: no memory plan: %s", job.id, e)
        return None
    it = plan["per_rank"]["iteration"]
    gib = 2**30
    text = (
        f"Memory plan: each of {plan['per_rank']['workers']} rank(s) holds "
        f"{plan['per_rank']['chunk_bytes'] / gib:.2f} GiB of chunks; activations peak near "
        f"{it['non_model_peak_bytes'] / gib:.2f} GiB; an iteration needs at least "
        f"{it['least_device_bytes'] / gib:.2f} GiB on the device"
    )
    if not plan["fits"]:
        change = plan.get("smallest_change")
        text += f"; does not fit: {'; '.join(plan['problems'])}"
        if change:
            text += f" (the smallest change that fits: {change['text']})"
    store.events.add(job.id, text, level="info" if plan["fits"] else "warn", attempt=attempt)
    return plan


def _data_report(meta: dict[str, Any]) -> dict[str, Any]:
    """What the job object and the dashboard show of the prepared data."""
    train = meta["training_file"]
    return {
        "format": meta["format"],
        "seq_len": meta["seq_len"],
        "packing": meta.get("packing", {}),
        **{
            k: train.get(k)
            for k in ("examples", "rows", "fill_ratio", "examples_per_row", "loss_tokens")
        },
        "truncated_examples": train.get("truncated_examples"),
        "dropped_examples": train.get("dropped_examples"),
        "steps_per_epoch": meta["steps_per_epoch"],
        "total_steps": meta["total_steps"],
    }


def _newest_checkpoint(store: Store, job_id: str) -> str | None:
    """The directory of the job's newest recorded checkpoint (see `finetune.resume`)."""
    rows, _ = store.checkpoints.page(job_id, None, CHECKPOINTS_TO_KEEP + 1)
    return max(rows, key=lambda c: c.step).path if rows else None


def run_trainer(run: RunPlan, job: Job, attempt: int) -> Any:
    from service.worker.finetune import train_func
    from service.worker.trainer import fit_on_workers

    assert run.storage_path is not None
    return fit_on_workers(
        train_func,
        # no store address in here: Ray shows a trainer's config on its dashboard; the
        # workers read it as the driver does
        {"job_id": job.id, "attempt": attempt, "run": run},
        name=job.id,
        storage_path=run.storage_path,
        resources=spec_of(job).resources,
        max_failures=2,
    )


def metrics_csv(store: Store, job_id: str) -> bytes:
    """OpenAI's result file: one row per step."""
    cols = [
        "step",
        "train_loss",
        "train_accuracy",
        "valid_loss",
        "valid_mean_token_accuracy",
        "tokens_per_second",
        "lr",
        "full_valid_loss",
        "full_valid_mean_token_accuracy",
    ]
    src = {"train_accuracy": "train_mean_token_accuracy"}
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(cols)
    for p in store.events.metric_points(job_id):
        w.writerow(["" if (v := p.values.get(src.get(c, c))) is None else v for c in cols])
    return buf.getvalue().encode()


def results_file_id(job_id: str) -> str:
    """The id of a job's metrics CSV: one per job, so an attempt that finishes again (its
    driver died after writing it) replaces it instead of leaving a second copy."""
    return "file-" + hashlib.sha256(f"{job_id}:results".encode()).hexdigest()[:24]


def finish_success(settings: Settings, store: Store, job: Job, attempt: int) -> None:
    """Attempt `attempt` succeeded: the metrics CSV, the fine-tuned model's name and the
    job's end in one fenced write. A stale attempt (`StaleAttempt`) writes nothing."""
    data = metrics_csv(store, job.id)
    fid = results_file_id(job.id)
    settings.files_dir.mkdir(parents=True, exist_ok=True)
    tmp = settings.files_dir / f".{fid}.a{attempt}.part"
    tmp.write_bytes(data)
    points = store.events.metric_points(job.id)
    trained = int(points[-1].values.get("trained_tokens", 0)) if points else 0
    name = fine_tuned_name(spec_of(job).base_model, job.suffix, job.id)
    early = job.early_stopping or {}
    stopped = early.get("stopped_at_step")
    results = File(
        id=fid,
        tenant=job.tenant,
        filename=f"{job.id}-metrics.csv",
        purpose="fine-tune-results",
        bytes=len(data),
        sha256=hashlib.sha256(data).hexdigest(),
        created_at=int(time.time()),
        status="processed",
        format="csv",
        examples=0,
        storage_name=fid,
    )
    try:
        store.jobs.finish(
            job.id,
            attempt,
            results,
            lambda: os.replace(tmp, settings.files_dir / fid),
            f"The job has successfully completed; fine-tuned model {name}"
            + (
                f" (stopped early at step {stopped}: the model of step {early['best_step']})"
                if stopped
                else ""
            ),
            status_detail=None,
            fine_tuned_model=name,
            trained_tokens=trained,
            result_files=[fid],
            progress_step=stopped or job.progress_total or (points[-1].step if points else 0),
        )
    finally:
        tmp.unlink(missing_ok=True)


def fail(store: Store, job_id: str, attempt: int, code: str, message: str) -> None:
    store.jobs.update(
        job_id,
        event=f"The job failed: {message}",
        attempt=attempt,
        status=JobStatus.FAILED,
        status_detail=None,
        error={"code": code, "message": message, "param": None},
    )


def through_outage(fn: Any, *args: Any, within_s: float = 300.0, **kwargs: Any) -> Any:
    """`fn(*args, **kwargs)`, tried again while the store cannot be reached (an outage, a
    failover, a restart), for up to `within_s`: a driver whose training is done must not
    lose it to a store that is down for a minute. Other errors pass at once."""
    from sqlalchemy.exc import InterfaceError, OperationalError

    deadline = time.monotonic() + within_s
    delay = 1.0
    while True:
        try:
            return fn(*args, **kwargs)
        except (OperationalError, InterfaceError) as e:
            if time.monotonic() + delay > deadline:
                raise
            log.warning("the store is unreachable (%s); trying again in %.0f s", e, delay)
            time.sleep(delay)
            delay = min(delay * 2, 15.0)


def watch_currency(store: Store, job_id: str, attempt: int, every_s: float = 5.0) -> None:
    """End this driver (and with it the Ray job's trainer and workers) as soon as the
    store says the attempt is no longer current: the reconciler ended it and started
    another, or the job finished. A store that cannot be read proves nothing."""
    import threading

    def watch() -> None:
        while True:
            time.sleep(every_s)
            try:
                current = store.attempts.is_current(job_id, attempt)
            except Exception as e:
                log.warning("could not ask the store whether attempt %d is current: %s", attempt, e)
                continue
            if not current:
                log.error("job %s attempt %d is no longer current; stopping", job_id, attempt)
                os._exit(4)

    threading.Thread(target=watch, name="pstar-currency", daemon=True).start()


# the running attempt's experiment trackers, which a stop by Ray ends first (`_stopped`)
_TRACKING: list[Any] = []


def _stopped(*_: Any) -> None:
    """Stopped by Ray: the trackers' runs end (cancelled), for at most 10 s, then exit
    at once, writing nothing else."""
    import threading

    for tracking in _TRACKING:
        t = threading.Thread(target=tracking.end, args=("cancelled",), daemon=True)
        t.start()
        t.join(timeout=10)
    os._exit(143)


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    # stopped by Ray (cancel, head shutdown): exit at once, writing nothing; the store
    # already says what happened (cancelled) or the reconciler will (a new attempt)
    signal.signal(signal.SIGTERM, _stopped)
    job_id, attempt = argv[0], int(argv[1])
    # the store's address: from the file the job's environment names, never the URL
    # itself (see service.settings.job_env)
    settings = Settings.from_env()
    store = Store(settings.db_url, pool_size=2)
    job = through_outage(store.jobs.get, job_id)
    if job is None or not through_outage(store.attempts.is_current, job_id, attempt):
        log.info("job %s attempt %s is not current; nothing to do", job_id, attempt)
        return 0
    watch_currency(store, job_id, attempt)
    try:
        return _run(settings, store, job, attempt)
    except StaleAttempt as e:
        log.error("%s; this driver stops without writing", e)
        return 4
    finally:  # the attempt's grader key, if its graders ask models (grader_access)
        through_outage(grader_access.revoke, store, job_id, attempt)


def _run(settings: Settings, store: Store, job: Job, attempt: int) -> int:
    job_id = job.id
    log.info("job %s attempt %d: preparing", job_id, attempt)
    try:
        where = on_a_worker(spec_of(job), job_id)
        run = through_outage(prepare_run, settings, store, job, attempt, where)
    except DataError as e:
        through_outage(fail, store, job_id, attempt, "invalid_training_data", str(e))
        return 1
    log.info(
        "job %s attempt %d: %d steps on %s worker(s)",
        job_id,
        attempt,
        run.total_steps,
        spec_of(job).resources.num_workers,
    )
    tracking = _tracking(settings, store, job, attempt)
    paused = False
    try:
        result = run_trainer(run, job, attempt)
        error = getattr(result, "error", None)
        # the workers' last report: a pause's checkpoint says so (service.worker.loop)
        paused = bool((getattr(result, "metrics", None) or {}).get("paused_at_step"))
    except Exception as e:  # Ray Train raises when the worker group fails for good
        error = e
    if tracking is not None and through_outage(store.attempts.is_current, job_id, attempt):
        # (an attempt no longer current leaves the runs to the one that is)
        latest = through_outage(store.jobs.get, job_id) or job
        if error is not None:
            tracking.end("interrupted" if lost_cluster(error) else "failed")
        else:
            tracking.end("paused" if paused or latest.status == PAUSED else "finished")
    if error is not None and not through_outage(store.attempts.is_current, job_id, attempt):
        # a worker's write was refused (StaleAttempt): another attempt owns the job now
        raise StaleAttempt(job_id, attempt, "a worker's write was refused")
    if error is not None and lost_cluster(error):
        # not the training's fault: the head, a node or the controller went away under
        # this attempt. Leave the job active; the reconciler starts the next attempt.
        log.error("job %s attempt %d: the Ray cluster failed under it: %s", job_id, attempt, error)
        return 3
    if error is not None:
        text = "".join(traceback.format_exception_only(type(error), error)).strip()
        log.error("job %s attempt %d failed: %s", job_id, attempt, text)
        through_outage(fail, store, job_id, attempt, "training_failed", _short(text))
        return 1
    latest = through_outage(store.jobs.get, job_id) or job
    if paused or latest.status == PAUSED:
        # its workers paused it, with a checkpoint; the job may be resumed already, and
        # its next attempt starts once this one has ended
        through_outage(store.attempts.end_paused, job_id, attempt)
        log.info("job %s attempt %d: paused", job_id, attempt)
        return 0
    through_outage(finish_success, settings, store, latest, attempt)
    log.info("job %s attempt %d: succeeded", job_id, attempt)
    return 0


def _tracking(settings: Settings, store: Store, job: Job, attempt: int) -> Any:
    """The job's experiment trackers, logging (`service.control.tracking`); None when it
    has none, or when they could not start (a tracker never fails the job)."""
    from service.control.tracking import Tracking

    try:
        tracking = Tracking.start(settings, store, job, attempt)
        if tracking is not None:
            _TRACKING.append(tracking)
        return tracking
    except Exception as e:
        log.warning("job %s: the experiment trackers did not start: %s", job.id, e)
        return None


def lost_cluster(error: BaseException) -> bool:
    """True when `error` says the Ray cluster failed, not the training code: a lost
    controller, a preempted or dead node or actor, an unreachable head."""
    import ray
    from ray import exceptions as rx
    from ray.train.v2.api.exceptions import ControllerError, PreemptionError, WorkerGroupError

    def system(e: BaseException) -> bool:
        return isinstance(e, rx.RayError) and not isinstance(e, rx.RayTaskError)

    if isinstance(error, (ControllerError, PreemptionError)):
        return True
    if isinstance(error, WorkerGroupError):
        failures = list(error.worker_failures.values())
        return bool(failures) and all(system(e) for e in failures)
    if system(error) or isinstance(error, ConnectionError):
        return True
    try:
        ray.cluster_resources()
    except Exception:
        return True
    return False


def _short(text: str, limit: int = 2000) -> str:
    return text if len(text) <= limit else text[: limit - 20] + " ... (see the logs)"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
