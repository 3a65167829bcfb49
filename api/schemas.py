"""Response objects, in OpenAI's shapes (`object`, `id`, `created_at`, cursor lists), and
ours beside them. Built from store rows here, so routes stay short."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from service.methods.base import ECHOED
from service.registry import ModelRef
from service.spec.job import JobSpec, spec_of
from service.store import Checkpoint as CheckpointRow
from service.store import Event as EventRow
from service.store import File as FileRow
from service.store import Job as JobRow
from service.worker.early_stopping import EarlyStopping


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorEnvelope(BaseModel):
    error: ErrorBody


class FileObject(BaseModel):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: Literal["uploaded", "processed", "error"]
    status_details: str | None = None
    expires_at: int | None = None
    # ours: what the per-line validation found
    sha256: str
    format: str = Field(description="chat, completion or text")
    examples: int

    @classmethod
    def of(cls, f: FileRow) -> FileObject:
        return cls(
            id=f.id,
            bytes=f.bytes,
            created_at=f.created_at,
            filename=f.filename,
            purpose=f.purpose,
            status=f.status,  # type: ignore[arg-type]
            status_details=f.status_details,
            sha256=f.sha256,
            format=f.format,
            examples=f.examples,
        )


def page_ends(data: list[Any]) -> dict[str, str | None]:
    """`first_id` and `last_id` of a cursor page (None when it is empty)."""
    return {
        "first_id": data[0].id if data else None,
        "last_id": data[-1].id if data else None,
    }


class FileList(BaseModel):
    object: Literal["list"] = "list"
    data: list[FileObject]
    has_more: bool
    first_id: str | None = None
    last_id: str | None = None


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool


class ReplicaPlace(BaseModel):
    replica: str | None = None
    node: str | None = None
    device: str | None = None


class ModelServing(BaseModel):
    deployment: str = Field(description="the Ray Serve application that answers the model")
    adapter: bool = Field(description="served as a LoRA adapter on its base's deployment")
    replicas: int = Field(description="replicas of the deployment running now")
    loaded_in: list[ReplicaPlace] = Field(description="the replicas that hold the model")


class ModelObject(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    kind: str = Field(description="base (a HF directory), zoo (from scratch) or fine-tuned")
    base: str
    # ours: a LoRA job's model is an adapter on the model the job started from
    adapter: bool = Field(
        default=False,
        description="true for a LoRA job's model: its adapter on `adapter_base` (download it "
        "with GET /v1/fine_tuning/jobs/{id}/checkpoints/{checkpoint_id}/content)",
    )
    adapter_base: str | None = Field(
        default=None, description="the model the adapter applies to (null if not an adapter)"
    )
    serving: ModelServing | None = Field(
        default=None,
        description="where the model is in memory now (null when no replica holds it; a "
        "request to a model starts its deployment)",
    )

    @classmethod
    def of(cls, m: ModelRef, serving: dict[str, Any] | None = None) -> ModelObject:
        return cls(
            serving=ModelServing(**serving) if serving else None,
            id=m.id,
            created=m.created,
            owned_by=m.owned_by,
            kind=m.kind,
            base=m.base,
            adapter=m.adapter_base is not None,
            adapter_base=m.adapter_base,
        )


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelObject]


class JobError(BaseModel):
    code: str
    message: str
    param: str | None = None


class JobHyperparameters(BaseModel):
    batch_size: int | Literal["auto"]
    learning_rate_multiplier: float | Literal["auto"]
    n_epochs: int | Literal["auto"]


class Progress(BaseModel):
    step: int
    total: int


class JobStorage(BaseModel):
    bytes: int
    run_reclaimed_at: int | None = None


class FineTuningJob(BaseModel):
    id: str
    object: Literal["fine_tuning.job"] = "fine_tuning.job"
    created_at: int
    error: JobError | None = None
    fine_tuned_model: str | None = None
    finished_at: int | None = None
    hyperparameters: JobHyperparameters
    model: str
    organization_id: str
    result_files: list[str]
    seed: int
    status: Literal[
        "validating_files", "queued", "running", "paused", "succeeded", "failed", "cancelled"
    ]
    trained_tokens: int | None = None
    training_file: str
    validation_file: str | None = None
    estimated_finish: int | None = None
    integrations: list[Any] | None = None
    metadata: dict[str, str] | None = None
    method: dict[str, Any]
    user_provided_suffix: str | None = None
    # ours
    status_detail: str | None = Field(
        default=None,
        description="phase: loading model, preparing data, training, evaluating, "
        "checkpointing, exporting, recovering",
    )
    progress: Progress
    attempt: int
    max_attempts: int
    ray_submission_id: str | None = None
    hyperparameters_resolved: dict[str, Any] = Field(
        description="every hyperparameter the job runs with, 'auto' decided (a LoRA job's "
        "adapter settings under `lora`); `compute_dtype` is the engine's dtype, 'auto' until "
        "the workers have resolved it on their hardware, and `runtime` what they decided "
        "(CPU capability, threads, host Adam kernel)"
    )
    resources: dict[str, Any]
    pause_requested: bool = Field(
        default=False, description="a pause is on its way: at the next step boundary"
    )
    early_stopping: dict[str, Any] | None = Field(
        default=None,
        description="the early-stopping settings and what they found: watched (the metric: "
        "valid_loss, or a reinforcement job's valid_reward_mean), evals, best_step, "
        "best_value (and best_valid_loss when the loss is watched), "
        "evals_without_improvement, stopped (and stopped_at_step)",
    )
    data: dict[str, Any] | None = Field(
        default=None,
        description="the prepared training data: format, seq_len, rows, fill_ratio (real "
        "tokens over row slots), examples_per_row, packing (asked, decided, the padding "
        "one example per row would leave), loss_tokens, steps",
    )
    memory_plan: dict[str, Any] | None = Field(
        default=None,
        description="the capacity planner's plan of the job on its cluster, once its data "
        "is prepared: fits, problems, per_rank (lists_at_start per tier, iteration: the "
        "activations' peak, the least device memory, device and host peaks, bytes moved), "
        "and smallest_change for a job that does not fit (as POST .../validate)",
    )
    storage: JobStorage | None = Field(
        default=None,
        description="what the ended job keeps on the service's storage, counted against "
        "the tenant's quota: bytes (its run directory and exported model, as last "
        "measured) and run_reclaimed_at (when retention removed its checkpoints)",
    )

    @classmethod
    def of(cls, j: JobRow) -> FineTuningJob:
        spec = spec_of(j)
        hp = spec.hyperparameters.model_dump()
        openai_hp = {k: hp[k] for k in ECHOED}
        lora = spec.method.lora.settings() if spec.method.lora is not None else None
        kind = spec.method.type
        return cls(
            id=j.id,
            created_at=j.created_at,
            error=JobError(**j.error) if j.error else None,
            fine_tuned_model=j.fine_tuned_model,
            finished_at=j.finished_at,
            hyperparameters=JobHyperparameters(**openai_hp),
            model=j.model,
            organization_id=j.tenant,
            result_files=list(j.result_files or []),
            seed=j.seed,
            status=j.status,  # type: ignore[arg-type]
            trained_tokens=j.trained_tokens,
            training_file=j.training_file,
            validation_file=j.validation_file,
            estimated_finish=j.estimated_finish,
            metadata=j.metadata_,
            integrations=_integrations(spec.integrations, j.integrations) or None,
            method={"type": kind, kind: spec.training_method.echo(hp, lora)},
            user_provided_suffix=j.suffix,
            status_detail=j.status_detail,
            progress=Progress(step=j.progress_step, total=j.progress_total),
            attempt=j.attempt,
            max_attempts=j.max_attempts,
            ray_submission_id=f"{j.id}-a{j.attempt}" if j.attempt else None,
            hyperparameters_resolved=_resolved(hp, lora, spec.engine, j.runtime),
            resources=spec.resources.model_dump(),
            pause_requested=bool(j.pause_requested),  # None on a job just created in memory
            early_stopping=j.early_stopping or _early_stopping_settings(spec),
            data=j.data_report,
            memory_plan=j.memory_plan,
            storage=(
                JobStorage(bytes=j.storage_bytes, run_reclaimed_at=j.run_reclaimed_at)
                if j.storage_bytes is not None
                else None
            ),
        )


def _early_stopping_settings(spec: JobSpec) -> dict[str, Any] | None:
    """A job's early stopping before its first evaluation: the settings, nothing found."""
    from service import methods

    settings = spec.early_stopping
    raw = settings.model_dump() if settings is not None else None
    stopper = EarlyStopping.of(raw, watched=methods.get(spec.method.type).watched)
    return stopper.view() if stopper is not None else None


def _resolved(
    hp: dict[str, Any],
    lora: dict[str, Any] | None,
    engine: dict[str, Any] | None,
    runtime: dict[str, Any] | None,
) -> dict[str, Any]:
    """The hyperparameters a job runs with: the plan's, the adapter settings, and the
    compute dtype ('auto' until the workers have decided it on their hardware)."""
    out = dict(hp)
    if lora:
        out["lora"] = lora
    out["compute_dtype"] = (runtime or {}).get("compute_dtype") or (engine or {}).get(
        "dtype", "auto"
    )
    if runtime:
        out["runtime"] = runtime
    return out


class JobList(BaseModel):
    object: Literal["list"] = "list"
    data: list[FineTuningJob]
    has_more: bool


class JobEvent(BaseModel):
    id: str
    object: Literal["fine_tuning.job.event"] = "fine_tuning.job.event"
    created_at: int
    level: Literal["info", "warn", "error"]
    message: str
    data: dict[str, Any] | None = None
    type: Literal["message", "metrics"]

    @classmethod
    def of(cls, e: EventRow) -> JobEvent:
        return cls(
            id=f"ftevent-{e.seq}",
            created_at=int(e.created_at),
            level=e.level,  # type: ignore[arg-type]
            message=e.message,
            data=e.data,
            type=e.type,  # type: ignore[arg-type]
        )


class EventList(BaseModel):
    object: Literal["list"] = "list"
    data: list[JobEvent]
    has_more: bool


class CheckpointMetrics(BaseModel):
    step: float | None = None
    train_loss: float | None = None
    train_mean_token_accuracy: float | None = None
    valid_loss: float | None = None
    valid_mean_token_accuracy: float | None = None
    full_valid_loss: float | None = None
    full_valid_mean_token_accuracy: float | None = None


class JobCheckpoint(BaseModel):
    id: str
    object: Literal["fine_tuning.job.checkpoint"] = "fine_tuning.job.checkpoint"
    created_at: int
    fine_tuned_model_checkpoint: str
    fine_tuning_job_id: str
    metrics: CheckpointMetrics
    step_number: int
    # ours
    final: bool
    path: str = Field(description="the checkpoint directory on the service's storage")
    variants: list[Literal["adapter", "merged", "full"]] = Field(
        default_factory=list,
        description="the forms GET .../checkpoints/{id}/content?variant= sends now: 'adapter' "
        "(a LoRA job's every checkpoint), 'merged' (a LoRA job's final one), 'full' (a full "
        "fine-tuning job's final one)",
    )

    @classmethod
    def of(cls, c: CheckpointRow, model_name: str, variants: list[str]) -> JobCheckpoint:
        known = set(CheckpointMetrics.model_fields)
        return cls(
            id=c.id,
            created_at=c.created_at,
            fine_tuned_model_checkpoint=f"{model_name}:ckpt-step-{c.step}",
            fine_tuning_job_id=c.job_id,
            metrics=CheckpointMetrics(
                step=c.step, **{k: v for k, v in c.metrics.items() if k in known and k != "step"}
            ),
            step_number=c.step,
            final=c.final,
            path=c.path,
            variants=variants,  # type: ignore[arg-type]
        )


class CheckpointList(BaseModel):
    object: Literal["list"] = "list"
    data: list[JobCheckpoint]
    has_more: bool
    first_id: str | None = None
    last_id: str | None = None


class Series(BaseModel):
    name: str
    steps: list[int]
    values: list[float | None]


class MetricsResponse(BaseModel):
    object: Literal["fine_tuning.job.metrics"] = "fine_tuning.job.metrics"
    job_id: str
    step_from: int | None
    step_to: int | None
    series: dict[str, Series]


class MemoryResponse(BaseModel):
    object: Literal["fine_tuning.job.memory"] = "fine_tuning.job.memory"
    job_id: str
    available: bool = Field(description="false until the warm-up step has been traced")
    moments: int
    names: list[str]
    non_model_bytes: list[int]
    chunk_bytes: list[int] = Field(description="chunk bytes on the device at each moment")
    chunk_peak_bytes: list[int] = Field(
        default_factory=list, description="the most chunk bytes on the device in each moment"
    )
    peak_device_bytes: int = Field(
        default=0, description="max over moments of non-model + chunk bytes, since the start"
    )
    device_budget_bytes: int | None
    chunk_allowance_bytes: list[int] = Field(
        description="A_j = budget - max(N_j, N_{j+1}): chunk bytes the device may hold at j"
    )
    peak_non_model_bytes: int
    tiers: dict[str, Any]


class Health(BaseModel):
    status: str
    checks: dict[str, str] = {}
    ray_dashboard_url: str | None = None


def _integrations(asked: list[dict[str, Any]], runs: list[dict[str, Any]] | None) -> list[Any]:
    """OpenAI's `integrations` as the request gave them, each with its run as the driver
    started it: `run_id`, `url`, `state` (logging, finished, paused, interrupted, failed)
    and `error` inside the tracker's own section."""
    by_type = {r["type"]: r for r in runs or []}
    out = []
    for i in asked:
        kind = i["type"]
        run = by_type.get(kind, {})
        section = {**(i.get(kind) or {})}
        section.update({k: run.get(k) for k in ("run_id", "url", "state", "error")})
        out.append({"type": kind, kind: section})
    return out
