"""How a reinforcement job's model graders (`score_model`, `label_model`) reach their
models, its `cosine` metric the embedding model, and its workers the model server that
samples their answers (`sampler: server`): through this API's own
`/v1/chat/completions`, `/v1/embeddings` and the job's rollouts route, as the job's
tenant, the way `/graders/run` asks them.

Each attempt of such a job gets a key of its own (`store.keys`, role `grader`, named after
the job and the attempt) that reaches those and nothing else (`api.auth.require_tenant`;
the rollouts route answers its own job's key only). Its secret is written to
`<job dir>/secrets/grader_key.<n>` (mode 0600, on the volume the workers mount already, as
the store's URL is: a Ray job's environment is on Ray's dashboard), and the run plan names
that file and `PSTAR_API_URL`.
The key is revoked when its attempt ends (`revoke`, the driver), when a later attempt
takes over (`grant` revokes the earlier attempts' keys, never a later one's), and, should a
driver die first, once its attempt is no longer the job's current one, the job is paused,
or it has ended (`sweep`, the reconciler).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from service.methods.graders import EMBEDDED, MODEL_GRADERS
from service.settings import Settings
from service.store import Store
from service.store.keys import GRADER
from service.store.status import TERMINAL, JobStatus

log = logging.getLogger(__name__)


def key_name(job_id: str, attempt: int) -> str:
    return f"grader of {job_id} attempt {attempt}"


def job_of_key(name: str) -> str | None:
    """The job a grader key was granted for, by its name (None for another key's)."""
    parts = name.split(" ")
    return parts[2] if len(parts) == 5 and parts[0] == "grader" else None


def _attempt_of(name: str) -> int:
    return int(name.rsplit(" ", 1)[1])


def asks_models(grader: dict[str, Any] | None) -> bool:
    """Whether the (raw) grader has a model grader (score_model, label_model) in it, or a
    text similarity by embeddings (`cosine`)."""
    if not isinstance(grader, dict):
        return False
    if grader.get("type") in MODEL_GRADERS:
        return True
    if grader.get("type") == "text_similarity" and grader.get("evaluation_metric") == EMBEDDED:
        return True
    subs = grader.get("graders")
    if isinstance(subs, dict) and isinstance(subs.get("type"), str):
        return asks_models(subs)  # a multi grader's one grader, as the SDK's types show it
    return isinstance(subs, dict) and any(asks_models(g) for g in subs.values())


def grant(settings: Settings, store: Store, job_id: str, tenant: str, attempt: int) -> Path:
    """A new grader key of `tenant` for attempt `attempt` of `job_id` (the earlier
    attempts' revoked: a stale attempt's grant leaves a later one's key alone); the file
    holding its secret."""
    for key in store.keys.live(GRADER):
        if job_of_key(key.name) == job_id and _attempt_of(key.name) <= attempt:
            store.keys.revoke(key.id)
    _, secret = store.keys.create(tenant, role=GRADER, name=key_name(job_id, attempt))
    path = settings.job_dir(job_id) / "secrets" / f"grader_key.{attempt}"
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(f".grader_key.{attempt}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret + "\n")
    os.replace(tmp, path)
    return path


def revoke(store: Store, job_id: str, attempt: int | None = None) -> int:
    """Revoke the grader key of the job's attempt `attempt` (of every attempt: None);
    how many were live. An attempt revokes only its own: a newer one may own the job."""
    live = [
        k
        for k in store.keys.live(GRADER)
        if (k.name == key_name(job_id, attempt) if attempt else job_of_key(k.name) == job_id)
    ]
    for key in live:
        store.keys.revoke(key.id)
    return len(live)


def sweep(store: Store) -> int:
    """Revoke the grader keys no running attempt holds: of jobs that have ended (or are
    gone) or are paused, and of attempts that are no longer their job's current one (a
    driver stopped before its own revoke); how many."""
    done = 0
    for key in store.keys.live(GRADER):
        job_id = job_of_key(key.name)
        job = store.jobs.get(job_id) if job_id is not None else None
        if (
            job is None
            or job.status in TERMINAL
            or job.status == JobStatus.PAUSED
            or _attempt_of(key.name) < job.attempt
        ):
            store.keys.revoke(key.id)
            done += 1
    return done
