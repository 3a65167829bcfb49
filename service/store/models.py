"""The store's tables, as SQLAlchemy 2 typed models. Alembic migrations create them.

Every row a client can see carries its `tenant`; queries always filter on it, so one
tenant's files, jobs, events, checkpoints and models are invisible to another. Public ids
(`file-…`, `ftjob-…`) are strings; `seq` integers give a stable order for cursors.
Times are UNIX seconds (floats where sub-second order matters, as for events).
"""

from __future__ import annotations

import uuid
from typing import Any, ClassVar

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
    false,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from service.store.status import ACTIVE, TERMINAL, UNFINISHED, JobStatus

__all__ = ["ACTIVE", "PAUSED", "PAUSED_RAY_STATUS", "TERMINAL", "UNFINISHED"]

# a job's status, and which are active, unfinished, terminal: `service.store.status`
PAUSED = JobStatus.PAUSED
PAUSED_RAY_STATUS = "PAUSED"  # an attempt's `ray_status` when a pause ended it

# SQLite only auto-increments INTEGER PRIMARY KEY; PostgreSQL gets a BIGINT identity.
SeqType = BigInteger().with_variant(Integer(), "sqlite")


def new_id(prefix: str) -> str:
    """A public id: `prefix`, a dash and 24 hex digits (`file-…`, `ftjob-…`, `ftckpt-…`)."""
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


class Base(DeclarativeBase):
    type_annotation_map: ClassVar[dict[Any, Any]] = {dict[str, Any]: JSON, list[Any]: JSON}


class File(Base):
    __tablename__ = "files"

    seq: Mapped[int] = mapped_column(SeqType, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(64), unique=True)
    tenant: Mapped[str] = mapped_column(String(64), index=True)
    filename: Mapped[str] = mapped_column(String(255))
    purpose: Mapped[str] = mapped_column(String(32))
    bytes: Mapped[int] = mapped_column(BigInteger)
    sha256: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[int] = mapped_column(BigInteger)
    status: Mapped[str] = mapped_column(String(16))
    status_details: Mapped[str | None] = mapped_column(Text, nullable=True)
    # what the per-line validation found: format (chat/completion/text), line and
    # example counts; the stored name is chosen by the server, relative to files_dir
    format: Mapped[str] = mapped_column(String(16))
    examples: Mapped[int] = mapped_column(Integer)
    storage_name: Mapped[str] = mapped_column(String(128))


class ApiKey(Base):
    """An API key an operator made (`pstar keys create`, or an admin key's
    `POST /v1/admin/keys`): the SHA-256 of its secret, never the secret. A `tenant` key
    acts as its tenant; an `admin` key manages keys and nothing else."""

    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)  # key-..., shown, not secret
    tenant: Mapped[str] = mapped_column(String(64), index=True)
    role: Mapped[str] = mapped_column(String(16))
    name: Mapped[str] = mapped_column(String(128))
    hash: Mapped[str] = mapped_column(String(64), unique=True)
    hint: Mapped[str] = mapped_column(String(8))  # the secret's last 4 characters
    created_at: Mapped[int] = mapped_column(BigInteger)
    revoked_at: Mapped[int | None] = mapped_column(BigInteger, nullable=True)


class Job(Base):
    __tablename__ = "jobs"
    __table_args__ = (
        UniqueConstraint("tenant", "idempotency_key", name="uq_jobs_tenant_idem"),
        Index("ix_jobs_tenant_seq", "tenant", "seq"),
        Index("ix_jobs_status", "status"),
        # a tenant's unfinished jobs, counted at every create (its quota)
        Index("ix_jobs_tenant_status", "tenant", "status"),
    )

    seq: Mapped[int] = mapped_column(SeqType, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(64), unique=True)
    tenant: Mapped[str] = mapped_column(String(64))
    model: Mapped[str] = mapped_column(String(255))
    training_file: Mapped[str] = mapped_column(String(64))
    validation_file: Mapped[str | None] = mapped_column(String(64), nullable=True)
    suffix: Mapped[str | None] = mapped_column(String(64), nullable=True)
    seed: Mapped[int] = mapped_column(BigInteger)
    metadata_: Mapped[dict[str, Any] | None] = mapped_column("metadata", JSON, nullable=True)
    # the request as given (for the idempotency check and the `method` echo) and the
    # resolved plan the driver runs (hyperparameters with "auto" decided, engine config,
    # resources, paths on the server)
    request: Mapped[dict[str, Any]] = mapped_column(JSON)
    request_hash: Mapped[str] = mapped_column(String(64))
    idempotency_key: Mapped[str | None] = mapped_column(String(255), nullable=True)
    plan: Mapped[dict[str, Any]] = mapped_column(JSON)
    status: Mapped[str] = mapped_column(String(24))
    status_detail: Mapped[str | None] = mapped_column(String(255), nullable=True)
    progress_step: Mapped[int] = mapped_column(Integer, default=0)
    progress_total: Mapped[int] = mapped_column(Integer, default=0)
    error: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    fine_tuned_model: Mapped[str | None] = mapped_column(String(255), nullable=True)
    trained_tokens: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    result_files: Mapped[list[Any]] = mapped_column(JSON, default=list)
    attempt: Mapped[int] = mapped_column(Integer, default=0)
    max_attempts: Mapped[int] = mapped_column(Integer)
    cancel_requested: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[int] = mapped_column(BigInteger)
    started_at: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    finished_at: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    estimated_finish: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    # what the engine decided on the workers' hardware (the compute dtype 'auto' became,
    # the CPU it saw, threads, host Adam kernel), written by rank 0 when training starts
    runtime: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    # what a running attempt takes of the tenant's share (plan.resources, as columns: the
    # reconciler's admission reads them every tick without decoding the plan)
    workers: Mapped[int] = mapped_column(Integer, default=1, server_default="1")
    gpus: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    # pause and resume: asked for (the workers pause at the next step boundary), and how
    # many attempts a pause ended (they do not count against max_attempts)
    pause_requested: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    pauses: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    # early stopping's settings and what it found (service.worker.early_stopping), and the
    # prepared data's report (rows, fill, examples per row, packing)
    early_stopping: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    data_report: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    # when the tenant deleted the fine-tuned model (DELETE /v1/models/{model})
    model_deleted_at: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    # the capacity planner's plan of the job on its cluster (service.control.estimate), written
    # by the driver once the data is prepared
    memory_plan: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    # each experiment tracker's run (service.control.tracking): type, run_id, url, state
    # (logging, finished, failed) and error, written by the driver
    integrations: Mapped[list[dict[str, Any]] | None] = mapped_column(JSON, nullable=True)
    # what the ended job keeps on the shared volume (run directory and exported model),
    # counted against its tenant's quota (service.control.storage); None: not measured yet
    storage_bytes: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    # when retention reclaimed its run directory (checkpoints, prepared data)
    run_reclaimed_at: Mapped[int | None] = mapped_column(BigInteger, nullable=True)


class Attempt(Base):
    """One Ray job per attempt, submitted as `<job-id>-a<number>`."""

    __tablename__ = "attempts"

    job_id: Mapped[str] = mapped_column(
        String(64), ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True
    )
    number: Mapped[int] = mapped_column(Integer, primary_key=True)
    submission_id: Mapped[str] = mapped_column(String(96), unique=True)
    # submitting -> submitted -> ended; a crash between the row and the submission is
    # resolved by asking Ray for the submission id (it is deterministic)
    state: Mapped[str] = mapped_column(String(16))
    ray_status: Mapped[str | None] = mapped_column(String(16), nullable=True)
    reason: Mapped[str | None] = mapped_column(Text, nullable=True)
    created_at: Mapped[float] = mapped_column(Float)
    ended_at: Mapped[float | None] = mapped_column(Float, nullable=True)


class Event(Base):
    __tablename__ = "events"
    __table_args__ = (Index("ix_events_job_seq", "job_id", "seq"),)

    seq: Mapped[int] = mapped_column(SeqType, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(String(64), ForeignKey("jobs.id", ondelete="CASCADE"))
    created_at: Mapped[float] = mapped_column(Float)
    level: Mapped[str] = mapped_column(String(8))
    type: Mapped[str] = mapped_column(String(16))
    message: Mapped[str] = mapped_column(Text)
    data: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)


class MetricPoint(Base):
    """One step's measured numbers; a step re-run after a resume replaces the old row."""

    __tablename__ = "metric_points"
    __table_args__ = (UniqueConstraint("job_id", "step", name="uq_metric_job_step"),)

    seq: Mapped[int] = mapped_column(SeqType, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(String(64), ForeignKey("jobs.id", ondelete="CASCADE"))
    step: Mapped[int] = mapped_column(Integer)
    attempt: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[float] = mapped_column(Float)
    values: Mapped[dict[str, Any]] = mapped_column(JSON)


class Checkpoint(Base):
    __tablename__ = "checkpoints"
    __table_args__ = (Index("ix_checkpoints_job_step", "job_id", "step"),)

    seq: Mapped[int] = mapped_column(SeqType, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(64), unique=True)
    job_id: Mapped[str] = mapped_column(String(64), ForeignKey("jobs.id", ondelete="CASCADE"))
    step: Mapped[int] = mapped_column(Integer)
    metrics: Mapped[dict[str, Any]] = mapped_column(JSON)
    path: Mapped[str] = mapped_column(Text)
    final: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[int] = mapped_column(BigInteger)


class JobStats(Base):
    """The engine's warm-up trace and tier stats of a job (rank 0), replaced as they grow."""

    __tablename__ = "job_stats"

    job_id: Mapped[str] = mapped_column(
        String(64), ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True
    )
    updated_at: Mapped[float] = mapped_column(Float)
    trace: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    tiers: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
