"""`pstar import-openai`: an OpenAI fine-tuning job, recreated here.

It reads what `openai api fine_tuning.jobs.retrieve -i <id>` prints (the job object as
JSON; a `fine_tuning.job.create` request body works too) and maps it to our
`POST /v1/fine_tuning/jobs` body (`request_of`). Every field is either carried over, set
from a flag (the model: OpenAI's models are not served here; the files: their ids name
OpenAI's storage, so the exported JSONL files are given as paths), or left out with the
reason (`Mapped.notes`). `FIELDS` says what happens to each field of the job object; the
README's "Coming from OpenAI" lists the same.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

# each field of OpenAI's fine-tuning job object, and what an import does with it
FIELDS: dict[str, str] = {
    "model": "set from --model (OpenAI's base models are not served here)",
    "training_file": "set from --training-file (a path: the id names OpenAI's storage)",
    "validation_file": "set from --validation-file when given, else left out",
    "hyperparameters": "carried over (batch_size, learning_rate_multiplier, n_epochs)",
    "method": "carried over: supervised, dpo (beta) and reinforcement (grader, its "
    "hyperparameters); reasoning_effort is left out",
    "seed": "carried over",
    "suffix": "carried over (user_provided_suffix, or the one in fine_tuned_model)",
    "metadata": "carried over",
    "integrations": "carried over (wandb: project, name, entity, tags)",
    "id": "read-only, describes the old job",
    "object": "read-only",
    "created_at": "read-only",
    "finished_at": "read-only",
    "status": "read-only",
    "error": "read-only",
    "fine_tuned_model": "read-only (its suffix part is carried over)",
    "organization_id": "read-only",
    "result_files": "read-only",
    "trained_tokens": "read-only",
    "estimated_finish": "read-only",
    "user_provided_suffix": "carried over as suffix",
}
READ_ONLY = {k for k, v in FIELDS.items() if v.startswith("read-only")}
SUFFIX = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
HYPER = ("batch_size", "learning_rate_multiplier", "n_epochs")
WANDB_KEYS = ("project", "name", "entity", "tags")
RFT_HYPER = (*HYPER, "eval_interval", "eval_samples", "compute_multiplier")


class NotAJob(ValueError):
    """The input is not an OpenAI fine-tuning job; the message says what it lacks."""


@dataclass
class Mapped:
    body: dict[str, Any]  # our POST /v1/fine_tuning/jobs body, files as paths
    notes: list[str] = field(default_factory=list)  # what was left out or changed, and why


def request_of(
    job: Any, model: str, training_file: str, validation_file: str | None = None
) -> Mapped:
    """Our job request for OpenAI's `job` (see the module docstring)."""
    if not isinstance(job, dict) or not ("model" in job or "training_file" in job):
        raise NotAJob(
            "not an OpenAI fine-tuning job: expected the JSON object `openai api "
            "fine_tuning.jobs.retrieve` prints (with 'model' and 'training_file')"
        )
    notes: list[str] = []
    body: dict[str, Any] = {"model": model, "training_file": training_file}
    if job.get("model") and job["model"] != model:
        notes.append(f"model: {job['model']} -> {model}")
    if job.get("training_file"):
        notes.append(f"training_file: {job['training_file']} -> {training_file}")
    if validation_file is not None:
        body["validation_file"] = validation_file
    elif job.get("validation_file"):
        notes.append(
            f"validation_file: {job['validation_file']} left out (give --validation-file "
            "with its exported JSONL)"
        )
    if isinstance(job.get("seed"), int):
        body["seed"] = job["seed"]
    suffix = _suffix(job)
    if suffix is not None:
        body["suffix"] = suffix
    if isinstance(job.get("metadata"), dict) and job["metadata"]:
        body["metadata"] = job["metadata"]
    kept = []
    for i in job.get("integrations") or []:
        if isinstance(i, dict) and i.get("type") == "wandb" and isinstance(i.get("wandb"), dict):
            own = {k: i["wandb"][k] for k in WANDB_KEYS if i["wandb"].get(k) is not None}
            kept.append({"type": "wandb", "wandb": own})
        else:
            kind = i.get("type") if isinstance(i, dict) else i
            notes.append(f"integration {kind!r} left out: this service logs to wandb and mlflow")
    if kept:
        body["integrations"] = kept
    body["method"] = _method(job, notes)
    unknown = sorted(set(job) - set(FIELDS))
    if unknown:
        notes.append(f"unknown fields left out: {', '.join(unknown)}")
    return Mapped(body, notes)


def _suffix(job: dict[str, Any]) -> str | None:
    given = job.get("user_provided_suffix") or job.get("suffix")
    if isinstance(given, str) and SUFFIX.match(given):
        return given
    name = job.get("fine_tuned_model")
    if isinstance(name, str) and name.startswith("ft:"):
        # ft:<base>:<org>:<suffix>:<id>, the suffix part empty when none was given
        parts = name.split(":")
        if len(parts) == 5 and SUFFIX.match(parts[3]):
            return parts[3]
    return None


def _hyper(raw: Any, keys: tuple[str, ...], where: str, notes: list[str]) -> dict[str, Any]:
    if not isinstance(raw, dict):
        return {}
    out = {k: raw[k] for k in keys if k in raw and raw[k] is not None}
    dropped = sorted(k for k in set(raw) - set(keys) - {"beta"} if raw[k] is not None)
    if dropped:
        notes.append(f"{where}: {', '.join(dropped)} left out (not taken here)")
    return out


def _method(job: dict[str, Any], notes: list[str]) -> dict[str, Any]:
    method = job.get("method") if isinstance(job.get("method"), dict) else None
    kind = (method or {}).get("type") or "supervised"
    section = (method or {}).get(kind) or {}
    raw_hp = section.get("hyperparameters") or job.get("hyperparameters")
    if kind == "reinforcement":
        hp = _hyper(raw_hp, RFT_HYPER, "method.reinforcement.hyperparameters", notes)
        out: dict[str, Any] = {"hyperparameters": hp}
        if "grader" in section:
            out["grader"] = section["grader"]
        return {"type": kind, kind: out}
    hp = _hyper(raw_hp, HYPER, f"method.{kind}.hyperparameters", notes)
    if kind == "dpo" and isinstance(raw_hp, dict) and raw_hp.get("beta") is not None:
        hp["beta"] = raw_hp["beta"]
    return {"type": kind, kind: {"hyperparameters": hp}}
