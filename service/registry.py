"""Which models a tenant may fine-tune, and where their weights are.

- base models: every Hugging Face model directory `$PSTAR_DATA_DIR/models/<id>/` (with a
  `config.json`), visible to all tenants; the id is the directory name;
- zoo models: the engine's GPT family (`pstar models`), trained from scratch with a
  tokenizer learned on the job's data;
- fine-tuned models: `ft:<base>:<suffix>:<job-id>`, the HF export of a succeeded job,
  visible to its tenant only. A LoRA job's model is its adapter on the model the job
  started from (`adapter_base`); its directory holds that pair merged (a full model, so
  it fine-tunes and loads like any other) and the adapter itself in `adapter/`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from service.settings import Settings
from service.spec.job import spec_of
from service.store import Job, Store

MODEL_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


@dataclass(frozen=True)
class ModelRef:
    id: str
    kind: Literal["base", "zoo", "fine-tuned"]
    path: Path | None  # a HF directory (base and fine-tuned); None for zoo models
    created: int
    owned_by: str
    base: str  # the base model a fine-tuned model descends from (itself otherwise)
    # a LoRA job's model: the model its adapter applies to (None for every other model)
    adapter_base: str | None = None


def base_models(settings: Settings) -> list[ModelRef]:
    root = settings.models_dir
    if not root.is_dir():
        return []
    out = []
    for d in sorted(root.iterdir()):
        if MODEL_ID_RE.match(d.name) and (d / "config.json").is_file():
            out.append(ModelRef(d.name, "base", d, int(d.stat().st_mtime), "system", d.name))
    return out


def zoo_models() -> list[ModelRef]:
    from pstar_core.models import ZOO

    return [ModelRef(name, "zoo", None, 0, "pstar-zoo", name) for name in ZOO]


def fine_tuned_models(settings: Settings, store: Store, tenant: str) -> list[ModelRef]:
    return [
        _fine_tuned(settings, job, job.fine_tuned_model, job.finished_at or job.created_at)
        for job in store.jobs.fine_tuned_models(tenant)
        if job.fine_tuned_model
    ]


def _fine_tuned(settings: Settings, job: Job, model_id: str, created: int) -> ModelRef:
    spec = spec_of(job)
    return ModelRef(
        model_id,
        "fine-tuned",
        settings.finetuned_dir(job.id),
        created,
        job.tenant,
        spec.base_model,
        adapter_base=job.model if spec.trains_adapters else None,
    )


def list_models(settings: Settings, store: Store, tenant: str) -> list[ModelRef]:
    return base_models(settings) + zoo_models() + fine_tuned_models(settings, store, tenant)


def resolve_model(settings: Settings, store: Store, tenant: str, model_id: str) -> ModelRef | None:
    """The model a tenant means by `model_id`, or None (also for another tenant's model)."""
    if model_id.startswith("ft:"):
        job = store.jobs.by_model(tenant, model_id)
        if job is None:
            return None
        return _fine_tuned(settings, job, model_id, job.finished_at or 0)
    if not MODEL_ID_RE.match(model_id):
        return None
    d = settings.models_dir / model_id
    if (d / "config.json").is_file():
        return ModelRef(model_id, "base", d, int(d.stat().st_mtime), "system", model_id)
    from pstar_core.models import ZOO

    if model_id in ZOO:
        return ModelRef(model_id, "zoo", None, 0, "pstar-zoo", model_id)
    return None


def fine_tuned_name(base: str, suffix: str | None, job_id: str) -> str:
    return f"ft:{base}:{suffix or ''}:{job_id}"
