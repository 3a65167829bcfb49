"""jobs.plan becomes a versioned job spec (`service.spec.job.JobSpec`, version 1): every
setting stored once. The learning rate stays in `hyperparameters.learning_rate` (no longer
copied into `engine.optimizer.lr`), the adapter settings in `method.lora` (not copied into
`engine.lora`), the device follows `resources.use_gpu` (not `engine.device`); a plan
without a method is supervised, one without `base_model` names the job's model, one
without `packing` ran one example per row. The spec composes the engine's config from
them (`JobSpec.engine_config`), so the config a worker gets is the same as before.

A data migration: it rewrites each stored plan with rules of its own (not the spec's
code, which will move on), and leaves an empty plan as it is.

Revision ID: 0007
Revises: 0006
"""

from __future__ import annotations

import copy
from typing import Any

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

KEYS = (
    "version",
    "base_model",
    "method",
    "model",
    "training_file",
    "validation_file",
    "hyperparameters",
    "engine",
    "resources",
    "checkpoint_every",
    "suffix",
    "early_stopping",
)

jobs = sa.table(
    "jobs", sa.column("id", sa.String), sa.column("model", sa.String), sa.column("plan", sa.JSON)
)


def to_spec(plan: dict[str, Any], model: str) -> dict[str, Any]:
    """A plan as stored before 0007, in version 1's shape."""
    if not plan:
        return plan
    out = {k: copy.deepcopy(v) for k, v in plan.items() if k in KEYS}
    out["version"] = 1
    out.setdefault("base_model", model)
    out["method"] = out.get("method") or {"type": "supervised"}
    hp = out.setdefault("hyperparameters", {})
    hp.setdefault("packing", False)
    engine = out.get("engine") or {}
    engine.pop("device", None)
    lora = engine.pop("lora", None)
    if lora and not out["method"].get("lora"):
        out["method"]["lora"] = lora
    optimizer = engine.get("optimizer")
    if isinstance(optimizer, dict):
        optimizer.pop("lr", None)
        if not optimizer:
            engine.pop("optimizer")
    out["engine"] = engine
    return out


def to_plan(spec: dict[str, Any], model: str) -> dict[str, Any]:
    """Version 1's shape back in the plan's before 0007 (`model`: unused, as `to_spec`'s)."""
    if not spec:
        return spec
    out = copy.deepcopy(spec)
    out.pop("version", None)
    engine = out.setdefault("engine", {})
    optimizer = dict(engine.get("optimizer") or {})
    optimizer["lr"] = out["hyperparameters"]["learning_rate"]
    engine["optimizer"] = optimizer
    engine["device"] = "cuda" if (out.get("resources") or {}).get("use_gpu") else "cpu"
    if (out.get("method") or {}).get("lora"):
        engine["lora"] = out["method"]["lora"]
    return out


def _rewrite(how: Any) -> None:
    bind = op.get_bind()
    rows = bind.execute(sa.select(jobs.c.id, jobs.c.model, jobs.c.plan)).all()
    for job_id, model, plan in rows:
        new = how(plan or {}, model)
        if new != plan:
            bind.execute(jobs.update().where(jobs.c.id == job_id).values(plan=new))


def upgrade() -> None:
    _rewrite(to_spec)


def downgrade() -> None:
    _rewrite(to_plan)
