"""Fine-tuning jobs: the lifecycle operations the API calls (create, cancel) on a request
(`service.spec.request`: OpenAI's body plus our extensions, and how "auto" is decided).

A job is stored only when everything a client can get wrong has been checked: the model
exists for this tenant, the files are this tenant's processed fine-tuning files, the
hyperparameters are in range, the engine section is a valid `pstar_core` config. The
stored `plan` is what the Ray job driver runs, with every "auto" decided.

Status: validating_files -> queued -> running -> succeeded | failed | cancelled; a queued or
running job may be paused (-> paused) and resumed (-> queued).
"""

from __future__ import annotations

import math
import random
import time
from typing import Any, TypeVar

from service.control import storage
from service.errors import Conflict, InvalidRequest, NotFound, QuotaExceeded
from service.methods.base import ADAPTERS_NEED_PRETRAINED
from service.registry import ModelRef, resolve_model
from service.settings import Limits, Settings, loopback
from service.spec import auto
from service.spec.job import (
    AdapterSpec,
    EarlyStoppingSpec,
    FileSpec,
    HyperparametersSpec,
    JobSpec,
    MethodSpec,
    ModelSpec,
)
from service.spec.request import (
    JobRequest,
    check_engine_config,
    check_job_limits,
    check_reservation,
    checked_engine,
    gpu_cpus_per_worker,
)
from service.spec.resources import Resources
from service.store import (
    Checkpoint,
    Event,
    IdempotencyConflict,
    Job,
    Store,
    TooManyUnfinished,
    new_id,
    request_hash,
)
from service.store.models import PAUSED
from service.store.statements import View
from service.store.status import JobStatus

# a method's checks against the training file's lines (a grader's item keys) read this many
FIRST_LINES_CHECKED = 20

_J = TypeVar("_J")


class JobService:
    """Create and cancel jobs; the reconciler and the driver run them."""

    def __init__(self, settings: Settings, store: Store, launcher: Any) -> None:
        from service.control.heavy import HeavyWork

        self.settings, self.store, self.launcher = settings, store, launcher
        self.heavy = HeavyWork()
        self.usage = storage.Usage(settings, store)  # each tenant's stored bytes, for the quota

    def _unreachable(self) -> str | None:
        """Why a job's workers could not reach this API (a Ray cluster elsewhere, the API
        at a loopback address), or None."""
        ray = self.settings.ray_address
        if ray and not loopback(ray) and loopback(self.settings.api_url):
            return (
                f"the workers of a Ray cluster at {ray} cannot reach this API at "
                f"{self.settings.api_url}: the operator sets PSTAR_API_URL to an address "
                "they reach"
            )
        return None

    def resolve(self, tenant: str, req: JobRequest) -> tuple[ModelRef, JobSpec]:
        """Check everything a client can get wrong; the spec the driver will run."""
        req = self._with_default_resources(req)
        check_job_limits(self.settings.limits, req)
        model = resolve_model(self.settings, self.store, tenant, req.model)
        if model is None:
            raise InvalidRequest(
                f"model '{req.model}' does not exist; GET /v1/models lists the models you can "
                "fine-tune",
                param="model",
                code="model_not_found",
            )
        method = req.training_method
        # adapters train on a pretrained model's frozen weights, whatever the method
        why = method.pretrained or (ADAPTERS_NEED_PRETRAINED if req.lora else None)
        if model.kind == "zoo" and why:
            raise InvalidRequest(
                f"method.type '{method.name}' {why}, and '{req.model}' is a zoo model trained "
                "from scratch (its weights start random); fine-tune a pretrained model (GET "
                "/v1/models: kind 'base' or 'fine-tuned')",
                param="model",
                code="model_not_available",
            )
        files = {}
        for param, fid in (
            ("training_file", req.training_file),
            ("validation_file", req.validation_file),
        ):
            if fid is None:
                continue
            f = self.store.files.get(tenant, fid)
            if f is None:
                raise InvalidRequest(
                    f"{param} '{fid}' does not exist; upload it with POST /v1/files "
                    "(purpose 'fine-tune')",
                    param=param,
                    code="file_not_found",
                )
            if f.purpose != "fine-tune" or f.status != "processed":
                raise InvalidRequest(
                    f"{param} '{fid}' is not a processed fine-tuning file (purpose "
                    f"'{f.purpose}', status '{f.status}')",
                    param=param,
                    code="invalid_file",
                )
            if not method.takes(f.format):
                raise InvalidRequest(
                    f"{param} '{fid}' holds {f.format} examples, and method.type "
                    f"'{method.name}' trains on {method.wants}",
                    param=param,
                    code="invalid_file",
                )
            files[param] = f
        if req.early_stopping is not None and "validation_file" not in files:
            raise InvalidRequest(
                "early_stopping watches the validation loss: give a validation_file",
                param="early_stopping",
                code="invalid_value",
            )
        train = files["training_file"]
        hp = req.hp
        workers = req.resources.num_workers
        batch = (
            auto.batch_size(train.examples, workers) if hp.batch_size == "auto" else hp.batch_size
        )
        if batch % workers:
            raise InvalidRequest(
                f"hyperparameters.batch_size {batch} must be a multiple of "
                f"resources.num_workers {workers} (each worker takes an equal share)",
                param="hyperparameters.batch_size",
                code="invalid_value",
            )
        epochs = auto.epochs(train.examples) if hp.n_epochs == "auto" else hp.n_epochs
        mult = 1.0 if hp.learning_rate_multiplier == "auto" else float(hp.learning_rate_multiplier)
        engine = checked_engine(req)  # before reading engine.optimizer.lr
        base_lr, lr = auto.learning_rate(
            model.kind, mult, (engine.get("optimizer") or {}).get("lr")
        )
        if not (math.isfinite(lr) and lr > 0):
            raise InvalidRequest(
                f"the learning rate engine.optimizer.lr ({base_lr:g}) times "
                f"hyperparameters.learning_rate_multiplier ({mult:g}) is not a positive "
                f"finite number ({lr:g})",
                param="hyperparameters.learning_rate_multiplier",
                code="invalid_value",
            )

        def first_lines() -> list[dict[str, Any]]:
            from service.control.files import file_path
            from service.data.datasets import iter_examples

            return list(iter_examples(file_path(self.settings, train), FIRST_LINES_CHECKED))

        def servable(model_id: str, max_tokens: int | None, grammar: bool) -> None:
            from service.serving.deployments import target_of
            from service.serving.guided import tokenizer_problem

            target = target_of(self.settings, self.store, tenant, model_id)
            why = tokenizer_problem(target.model_dir) if grammar else None
            if why is not None:
                raise InvalidRequest(
                    f"{why}, and a label_model's answer is decoded to its labels: save the "
                    "model with a tokenizer.json, or grade with score_model",
                    param="model",
                )
            limit = self.settings.limits.max_tokens_per_request
            if max_tokens is not None and max_tokens > limit:
                raise InvalidRequest(
                    f"at most {limit} tokens an answer here (PSTAR_MAX_TOKENS_PER_REQUEST)",
                    param="max_tokens",
                )
            if (why := self._unreachable()) is not None:
                raise InvalidRequest(why, param="model")

        own = method.check(
            req.method_section,
            first_lines,
            self.settings.python_graders,
            servable,
            embeddings=self.settings.embedding_model is not None,
            unreachable=self._unreachable(),
        )
        adapters = req.lora.settings() if req.lora is not None else None
        if adapters is not None:
            from service.adapters import wrap_meta
            from service.tools.planning import build_meta

            # the targets must name linear layers of this model: refused now, not when a
            # worker builds the engine
            assert model.path is not None  # every model but a zoo one is a HF directory
            path = str(model.path)
            self.heavy.run(lambda: wrap_meta(build_meta(path), adapters), tenant=tenant)
        valid = files.get("validation_file")
        spec = JobSpec(
            base_model=model.base,
            method=MethodSpec(
                type=method.name,
                lora=AdapterSpec.model_validate(adapters) if adapters is not None else None,
            ),
            model=ModelSpec(
                id=model.id, kind=model.kind, path=str(model.path) if model.path else None
            ),
            training_file=FileSpec(id=train.id, format=train.format, examples=train.examples),
            validation_file=(
                FileSpec(id=valid.id, format=valid.format, examples=valid.examples)
                if valid
                else None
            ),
            hyperparameters=HyperparametersSpec(
                n_epochs=epochs,
                batch_size=batch,
                learning_rate_multiplier=mult,
                learning_rate=lr,
                max_steps=hp.max_steps,
                seq_len=hp.seq_len,
                eval_every=hp.eval_every,
                packing=hp.packing,
                **method.decided(hp),
                **own,
            ),
            engine=engine,
            resources=req.resources,
            checkpoint_every=req.checkpoint_every,
            suffix=req.suffix,
            integrations=[i.model_dump(mode="json") for i in req.integrations or []],
            early_stopping=(
                EarlyStoppingSpec(**req.early_stopping.model_dump())
                if req.early_stopping is not None
                else None
            ),
        )
        check_engine_config(spec.engine_config())
        check_reservation(spec)
        return model, spec

    def _with_default_resources(self, req: JobRequest) -> JobRequest:
        """The deployment's default resources (PSTAR_DEFAULT_RESOURCES) under the fields
        the request gives; a GPU job that says nothing about CPUs gets its share of a GPU
        node's (`gpu_cpus_per_worker`), for the host Adam and the loading threads."""
        defaults = self.settings.default_resources or {}
        given = req.resources.model_fields_set if "resources" in req.model_fields_set else set()
        merged = {**defaults, **req.resources.model_dump(include=given)}
        if merged.get("use_gpu") and "cpus_per_worker" not in merged:
            share = gpu_cpus_per_worker(getattr(self.launcher, "cluster_nodes", lambda: None)())
            if share is not None:
                merged["cpus_per_worker"] = share
        if not merged:
            return req
        return req.model_copy(update={"resources": Resources(**merged)})

    def create(self, tenant: str, req: JobRequest, idempotency_key: str | None) -> tuple[Job, bool]:
        if idempotency_key is not None and not 1 <= len(idempotency_key) <= 255:
            raise InvalidRequest(
                "Idempotency-Key must be 1 to 255 characters",
                param="Idempotency-Key",
                code="invalid_value",
            )
        body = req.model_dump(mode="json", exclude_none=True)
        h = request_hash(body)
        if idempotency_key:
            existing = self.store.jobs.by_idempotency_key(tenant, idempotency_key)
            if existing is not None:
                return self._same(existing, h, idempotency_key), False
        _model, spec = self.resolve(tenant, req)
        storage.check_quota(self.settings, self.store, tenant, self.usage)  # files, ended runs
        now = int(time.time())
        job = Job(
            id=new_id("ftjob"),
            tenant=tenant,
            model=req.model,
            training_file=req.training_file,
            validation_file=req.validation_file,
            suffix=req.suffix,
            seed=req.seed if req.seed is not None else random.randrange(2**31),
            metadata_=req.metadata,
            request=body,
            request_hash=h,
            idempotency_key=idempotency_key,
            plan=spec.stored(),
            status=JobStatus.VALIDATING_FILES,
            status_detail=None,
            progress_step=0,
            progress_total=0,
            result_files=[],
            attempt=0,
            max_attempts=req.max_attempts,
            cancel_requested=False,
            created_at=now,
            workers=spec.resources.num_workers,
            gpus=spec.resources.num_workers if spec.resources.use_gpu else 0,
        )
        limit = self.settings.limits.max_unfinished_jobs_per_tenant
        try:
            return self.store.jobs.create(job, f"Created fine-tuning job: {job.id}", limit)
        except IdempotencyConflict as e:
            raise self._conflict(e.job, idempotency_key or "") from None
        except TooManyUnfinished as e:
            raise QuotaExceeded(
                f"tenant {tenant} has {e.n} unfinished jobs, its limit "
                f"({Limits.var('max_unfinished_jobs_per_tenant')}={limit}); wait for some to "
                "finish or cancel some",
                code="quota_exceeded",
            ) from None

    def _same(self, existing: Job, h: str, key: str) -> Job:
        if existing.request_hash != h:
            raise self._conflict(existing, key)
        return existing

    @staticmethod
    def _conflict(job: Job, key: str) -> Conflict:
        return Conflict(
            f"Idempotency-Key '{key}' was already used for job {job.id} with a different "
            "request body; send the same body to get that job, or use a new key",
            param="Idempotency-Key",
            code="idempotency_key_reused",
        )

    def get(self, tenant: str, job_id: str) -> Job:
        return _found(self.store.jobs.get(job_id, tenant), job_id)

    def page(
        self,
        tenant: str,
        after: str | None,
        limit: int,
        status: str | None = None,
        metadata: dict[str, str] | None = None,
    ) -> tuple[list[View], bool]:
        """A page of the tenant's jobs, newest first; whether more follow."""
        return self.store.jobs.page(tenant, after, limit, status, metadata)

    # -- a job's own records: the caller has the job (`get`), so the tenant is checked

    def events(
        self, job: Job, after: int | None, limit: int, kind: str | None = None, order="desc"
    ) -> tuple[list[Event], bool]:
        return self.store.events.page(job.id, after, limit, kind, order)

    def checkpoints(self, job: Job, after: str | None, limit: int) -> tuple[list[Checkpoint], bool]:
        return self.store.checkpoints.page(job.id, after, limit)

    def checkpoint(self, job: Job, checkpoint_id: str) -> Checkpoint:
        ck = self.store.checkpoints.get(job.id, checkpoint_id)
        if ck is None:
            raise NotFound("checkpoint", checkpoint_id, param="checkpoint_id")
        return ck

    def metric_points(
        self, job: Job, step_from: int | None, step_to: int | None, max_points: int | None = None
    ) -> list[Any]:
        return self.store.events.metric_points(job.id, step_from, step_to, max_points)

    def stats(self, job: Job) -> Any:
        """The engine's newest stats of the job (the tracer's timeline), or None."""
        return self.store.events.get_stats(job.id)

    def view(self, tenant: str, job_id: str) -> View:
        """What `GET .../jobs/{id}` shows (`store.jobs.view`); 404 for another tenant's."""
        return _found(self.store.jobs.view(job_id, tenant), job_id)

    def cancel(self, tenant: str, job_id: str) -> Job:
        job = self.get(tenant, job_id)
        if not self.store.jobs.update(
            job_id, event="Job cancelled", status=JobStatus.CANCELLED, cancel_requested=True
        ):
            job = self.get(tenant, job_id)
            raise Conflict(
                f"Job {job_id} has already ended (status '{job.status}') and cannot be cancelled",
                param="fine_tuning_job_id",
                code="job_not_cancellable",
            )
        if job.attempt:
            self.launcher.stop_quietly(f"{job_id}-a{job.attempt}")
        return self.get(tenant, job_id)

    def pause(self, tenant: str, job_id: str) -> Job:
        """Pause a job (OpenAI's `POST .../pause`): one waiting for its first attempt leaves
        the queue at once; one with an attempt writes a checkpoint at its next step
        boundary and frees its workers (while it waits for resources, its Ray job is stopped
        and it pauses at its last checkpoint). A paused job is paused already; any other
        status is refused, saying which."""
        job = self.get(tenant, job_id)
        if job.status == PAUSED:
            return job
        how = self.store.jobs.pause(job_id, tenant)
        if how is None:
            job = self.get(tenant, job_id)
            raise InvalidRequest(
                f"job {job_id} is {job.status}; only a job that has not ended can be paused",
                param="fine_tuning_job_id",
                code="job_not_pausable",
            )
        job = self.get(tenant, job_id)
        if how == "requested" and job.status == JobStatus.QUEUED and job.attempt:
            # waiting in Ray for resources (or recovering): nothing to wait for
            self.launcher.stop_quietly(f"{job_id}-a{job.attempt}")
        return job

    def resume(self, tenant: str, job_id: str) -> Job:
        """Resume a paused job (OpenAI's `POST .../resume`): queued again, its next attempt
        continues from the pause's checkpoint, with the losses an uninterrupted run has."""
        self.get(tenant, job_id)
        if not self.store.jobs.resume(job_id, tenant):
            job = self.get(tenant, job_id)
            raise InvalidRequest(
                f"job {job_id} is {job.status}"
                + (" (a pause is on its way)" if job.pause_requested else "")
                + "; only a paused job can be resumed",
                param="fine_tuning_job_id",
                code="job_not_resumable",
            )
        return self.get(tenant, job_id)


def _found(job: _J | None, job_id: str) -> _J:
    if job is None:
        raise NotFound("fine_tuning_job", job_id, param="fine_tuning_job_id")
    return job
