"""Fine-tuning jobs: the request (OpenAI's body plus our extensions), how "auto" values
are decided, and the lifecycle operations the API calls (create, cancel).

A job is stored only when everything a client can get wrong has been checked: the model
exists for this tenant, the files are this tenant's processed fine-tuning files, the
hyperparameters are in range, the engine section is a valid `pstar_core` config. The
stored `plan` is what the Ray job driver runs, with every "auto" decided.

Status: validating_files -> queued -> running -> succeeded | failed | cancelled.
"""

from __future__ import annotations

import math
import random
import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from pstar_core.config import ConfigError, EngineConfig
from service.errors import Conflict, InvalidRequest, NotFound
from service.registry import ModelRef, resolve_model
from service.settings import Settings
from service.store import IdempotencyConflict, Job, Store, new_id, request_hash

Auto = Literal["auto"]
StrictPosInt = Annotated[int, Field(strict=True)]
# pretrained weights want a small step; a from-scratch zoo model a large one
BASE_LR = {"base": 1e-4, "fine-tuned": 1e-4, "zoo": 1e-3}
# set by the service, never by a client: the device follows `resources.use_gpu`, spill
# files go to the job's directory
SERVICE_ENGINE_KEYS = {"device": "resources.use_gpu", "memory.disk_dir": "the job's directory"}


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class Hyperparameters(_Body):
    n_epochs: Auto | Annotated[int, Field(strict=True, ge=1, le=50)] = Field(
        default="auto", description="passes over the training file"
    )
    batch_size: Auto | Annotated[int, Field(strict=True, ge=1, le=4096)] = Field(
        default="auto", description="examples per optimizer step, over all workers"
    )
    learning_rate_multiplier: Auto | Annotated[float, Field(gt=0, le=1000)] = Field(
        default="auto", description="multiplies the base learning rate"
    )
    # ours
    max_steps: Annotated[int, Field(strict=True, ge=1, le=10_000_000)] | None = Field(
        default=None, description="stop after this many optimizer steps (at most n_epochs)"
    )
    seq_len: Auto | Annotated[int, Field(strict=True, ge=16, le=32768)] = Field(
        default="auto", description="tokens per example row; auto: fits the longest, up to 512"
    )
    eval_every: Annotated[int, Field(strict=True, ge=1, le=10_000_000)] | None = Field(
        default=None, description="steps between validation losses (default: 10 per run)"
    )


class Supervised(_Body):
    hyperparameters: Hyperparameters | None = None


class Method(_Body):
    type: Literal["supervised", "dpo", "reinforcement"]
    supervised: Supervised | None = None
    dpo: dict[str, Any] | None = None
    reinforcement: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _supervised_only(self) -> Method:
        if self.type != "supervised":
            raise ValueError(f"method.type '{self.type}' is not supported; use 'supervised'")
        return self


class Resources(_Body):
    num_workers: Annotated[int, Field(strict=True, ge=1, le=256)] = Field(
        default=1, description="Ray Train workers; the chunks are sharded over them (ZeRO)"
    )
    use_gpu: Annotated[bool, Field(strict=True)] = Field(
        default=False, description="one GPU per worker, NCCL between them"
    )
    cpus_per_worker: Annotated[float, Field(gt=0, le=512)] = 1.0


class JobRequest(_Body):
    """`POST /v1/fine_tuning/jobs`: OpenAI's body, plus `engine`, `resources`,
    `checkpoint_every`, `max_attempts` and `hyperparameters.max_steps/seq_len/eval_every`."""

    model: Annotated[str, Field(min_length=1, max_length=255)]
    training_file: Annotated[str, Field(min_length=1, max_length=64)]
    validation_file: Annotated[str, Field(min_length=1, max_length=64)] | None = None
    suffix: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")] | None = None
    seed: Annotated[int, Field(strict=True, ge=0, le=2**31 - 1)] | None = None
    metadata: (
        dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]] | None
    ) = None
    method: Method | None = None
    hyperparameters: Hyperparameters | None = None
    integrations: list[Any] | None = None
    engine: dict[str, Any] = Field(default_factory=dict, description="a pstar_core EngineConfig")
    resources: Resources = Field(default_factory=Resources)
    checkpoint_every: Annotated[int, Field(strict=True, ge=1, le=10_000_000)] | None = None
    max_attempts: Annotated[int, Field(strict=True, ge=1, le=10)] = 3

    @field_validator("metadata")
    @classmethod
    def _metadata_size(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        if v is not None and len(v) > 16:
            raise ValueError(f"at most 16 metadata keys, got {len(v)}")
        return v

    @field_validator("integrations")
    @classmethod
    def _no_integrations(cls, v: list[Any] | None) -> list[Any] | None:
        if v:
            raise ValueError("integrations are not supported; see GET .../metrics and /metrics")
        return v

    @model_validator(mode="after")
    def _one_hyperparameters(self) -> JobRequest:
        in_method = (
            self.method and self.method.supervised and self.method.supervised.hyperparameters
        )
        if in_method and self.hyperparameters is not None:
            raise ValueError(
                "give hyperparameters either in method.supervised.hyperparameters or at the "
                "top level, not both"
            )
        return self

    @property
    def hp(self) -> Hyperparameters:
        if self.method and self.method.supervised and self.method.supervised.hyperparameters:
            return self.method.supervised.hyperparameters
        return self.hyperparameters or Hyperparameters()


def parse_request(body: Any) -> JobRequest:
    """A `JobRequest`, or `InvalidRequest` naming the first wrong field."""
    try:
        return JobRequest.model_validate(body)
    except ValidationError as e:
        raise invalid_from(e) from None


def invalid_from(e: ValidationError, prefix: str = "") -> InvalidRequest:
    err = e.errors()[0]
    loc = ".".join(str(x) for x in err["loc"] if not str(x).startswith("function-after"))
    param = f"{prefix}{loc}" if loc else prefix.rstrip(".") or None
    msg = err["msg"].removeprefix("Value error, ")
    more = f" (and {len(e.errors()) - 1} more)" if len(e.errors()) > 1 else ""
    return InvalidRequest(f"{param or 'body'}: {msg}{more}", param=param, code="invalid_value")


# -- deciding the plan --------------------------------------------------------------------


def auto_batch_size(examples: int, workers: int) -> int:
    b = max(1, min(8, examples))
    return -(-b // workers) * workers


def auto_epochs(examples: int) -> int:
    """OpenAI-like: 3 passes, more for very small files (about 100 examples seen)."""
    return max(3, min(10, math.ceil(100 / max(1, examples))))


def engine_config(req: JobRequest, lr: float) -> dict[str, Any]:
    """The engine section a job runs with: the client's, plus the learning rate and the
    device; the driver adds the spill directory (under the job's directory)."""
    eng = req.engine
    if not isinstance(eng, dict):
        raise InvalidRequest("engine: must be an object", param="engine")
    for key, who in SERVICE_ENGINE_KEYS.items():
        head, _, tail = key.partition(".")
        if head in eng and (not tail or (isinstance(eng[head], dict) and tail in eng[head])):
            raise InvalidRequest(
                f"engine.{key} is set by the service (from {who}); remove it",
                param=f"engine.{key}",
                code="invalid_value",
            )
    cfg = {k: v for k, v in eng.items()}
    opt = (
        dict(cfg.get("optimizer") or {})
        if isinstance(cfg.get("optimizer"), dict)
        else cfg.get("optimizer")
    )
    if opt is not None and not isinstance(opt, dict):
        raise InvalidRequest("engine.optimizer: must be an object", param="engine.optimizer")
    opt = opt or {}
    opt["lr"] = lr
    cfg["optimizer"] = opt
    cfg["device"] = "cuda" if req.resources.use_gpu else "cpu"
    try:
        EngineConfig.parse(cfg)
    except ConfigError as e:
        raise InvalidRequest(f"engine.{e}", param="engine", code="invalid_value") from None
    return cfg


class JobService:
    """Create and cancel jobs; the reconciler and the driver run them."""

    def __init__(self, settings: Settings, store: Store, launcher: Any) -> None:
        self.settings, self.store, self.launcher = settings, store, launcher

    def resolve(self, tenant: str, req: JobRequest) -> tuple[ModelRef, dict[str, Any]]:
        """Check everything a client can get wrong; the plan the driver will run."""
        model = resolve_model(self.settings, self.store, tenant, req.model)
        if model is None:
            raise InvalidRequest(
                f"model '{req.model}' does not exist; GET /v1/models lists the models you can "
                "fine-tune",
                param="model",
                code="model_not_found",
            )
        files = {}
        for param, fid in (
            ("training_file", req.training_file),
            ("validation_file", req.validation_file),
        ):
            if fid is None:
                continue
            f = self.store.get_file(tenant, fid)
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
            files[param] = f
        train = files["training_file"]
        hp = req.hp
        workers = req.resources.num_workers
        batch = (
            auto_batch_size(train.examples, workers) if hp.batch_size == "auto" else hp.batch_size
        )
        if batch % workers:
            raise InvalidRequest(
                f"hyperparameters.batch_size {batch} must be a multiple of "
                f"resources.num_workers {workers} (each worker takes an equal share)",
                param="hyperparameters.batch_size",
                code="invalid_value",
            )
        epochs = auto_epochs(train.examples) if hp.n_epochs == "auto" else hp.n_epochs
        mult = 1.0 if hp.learning_rate_multiplier == "auto" else float(hp.learning_rate_multiplier)
        user_lr = (
            (req.engine.get("optimizer") or {}).get("lr")
            if isinstance(req.engine.get("optimizer"), dict)
            else None
        )
        base_lr = (
            float(user_lr)
            if isinstance(user_lr, (int, float)) and user_lr > 0
            else BASE_LR[model.kind]
        )
        plan = {
            "base_model": model.base,
            "model": {
                "id": model.id,
                "kind": model.kind,
                "path": str(model.path) if model.path else None,
            },
            "training_file": {"id": train.id, "format": train.format, "examples": train.examples},
            "validation_file": (
                {"id": v.id, "format": v.format, "examples": v.examples}
                if (v := files.get("validation_file"))
                else None
            ),
            "hyperparameters": {
                "n_epochs": epochs,
                "batch_size": batch,
                "learning_rate_multiplier": mult,
                "learning_rate": base_lr * mult,
                "max_steps": hp.max_steps,
                "seq_len": hp.seq_len,
                "eval_every": hp.eval_every,
            },
            "engine": engine_config(req, base_lr * mult),
            "resources": req.resources.model_dump(),
            "checkpoint_every": req.checkpoint_every,
            "suffix": req.suffix,
        }
        return model, plan

    def create(self, tenant: str, req: JobRequest, idempotency_key: str | None) -> tuple[Job, bool]:
        if idempotency_key is not None and not 1 <= len(idempotency_key) <= 255:
            raise InvalidRequest(
                "Idempotency-Key must be 1 to 255 characters", param="Idempotency-Key"
            )
        body = req.model_dump(mode="json", exclude_none=True)
        h = request_hash(body)
        if idempotency_key:
            existing = self.store.job_by_idempotency_key(tenant, idempotency_key)
            if existing is not None:
                return self._same(existing, h, idempotency_key), False
        _model, plan = self.resolve(tenant, req)
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
            plan=plan,
            status="validating_files",
            status_detail=None,
            progress_step=0,
            progress_total=0,
            result_files=[],
            attempt=0,
            max_attempts=req.max_attempts,
            cancel_requested=False,
            created_at=now,
        )
        try:
            return self.store.create_job(job, f"Created fine-tuning job: {job.id}")
        except IdempotencyConflict as e:
            raise self._conflict(e.job, idempotency_key or "") from None

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
        job = self.store.get_job(job_id, tenant)
        if job is None:
            raise NotFound("fine_tuning_job", job_id, param="fine_tuning_job_id")
        return job

    def cancel(self, tenant: str, job_id: str) -> Job:
        job = self.get(tenant, job_id)
        if not self.store.update_job(
            job_id, event="Job cancelled", status="cancelled", cancel_requested=True
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
