"""A tenant's storage on the shared volume: counted, bounded, reclaimed and erased.

What a job keeps there is its run directory (`runs/<job id>`: checkpoints, the prepared
rows and tokenizer, the best evaluation's model, Ray Train's records) and its exported
model (`models/.ft/<job id>`); its spill is on each worker's node-local volume and gone
with the engine (unlinked files).

- **Counted**: the reconciler's sweep measures each ended job once (`storage_bytes`), and
  again whenever this module changes what it keeps. A tenant's use is its files plus what
  its jobs keep plus its training sessions' checkpoints (`sessions/<tenant>`, measured
  when asked).
- **Bounded**: a job created while the tenant's use is at `PSTAR_MAX_STORAGE_BYTES_PER_TENANT`
  is a 429 that gives the numbers and what to delete.
- **Reclaimed**: `PSTAR_RUN_RETENTION_DAYS` after a job ended, the sweep removes its run
  directory; its exported model stays until the tenant deletes it, and its checkpoints
  then say they were reclaimed.
- **Erased**: deleting a fine-tuned model removes its export and its run directory (every
  checkpoint with it) once no unfinished job reads the model; deleting a file removes it
  and the rows and tokenizer the tenant's ended jobs prepared from it.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path

from service.errors import QuotaExceeded
from service.settings import Limits, Settings
from service.store import Store

log = logging.getLogger("pstar.storage")

SWEEP_BATCH = 20  # jobs measured, and run directories reclaimed, per sweep at most
DAY_S = 86_400


def du(path: Path) -> int:
    """Bytes of the regular files under `path` (0 when it is not there)."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                st = os.lstat(os.path.join(root, name))
            except OSError:  # removed meanwhile
                continue
            total += st.st_size
    return total


def kept_bytes(settings: Settings, job_id: str) -> int:
    """What the job keeps on the shared volume now."""
    return du(settings.job_dir(job_id)) + du(settings.finetuned_dir(job_id))


def used_bytes(settings: Settings, store: Store, tenant: str) -> tuple[int, int]:
    """(bytes of the tenant's files, bytes its ended jobs and its sessions' checkpoints
    keep)."""
    kept = store.jobs.storage_bytes(tenant) + du(settings.sessions_dir(tenant))
    return store.files.total_bytes(tenant), kept


class Usage:
    """`used_bytes` per tenant, asked of the store at most once per `ttl_s`: a job create
    reads it, and what ended jobs keep is itself measured only every sweep (a minute)."""

    def __init__(self, settings: Settings, store: Store, ttl_s: float = 10.0) -> None:
        self.settings, self.store, self.ttl_s = settings, store, ttl_s
        self._seen: dict[str, tuple[float, tuple[int, int]]] = {}

    def of(self, tenant: str) -> tuple[int, int]:
        now = time.monotonic()
        hit = self._seen.get(tenant)
        if hit is not None and now - hit[0] < self.ttl_s:
            return hit[1]
        used = used_bytes(self.settings, self.store, tenant)
        if len(self._seen) > 10_000:  # tenants come and go: forget them all at once
            self._seen.clear()
        self._seen[tenant] = (now, used)
        return used


def check_quota(settings: Settings, store: Store, tenant: str, usage: Usage | None = None) -> None:
    """A 429 when the tenant's files and jobs already fill its storage quota."""
    quota = settings.limits.max_storage_bytes_per_tenant
    files, runs = usage.of(tenant) if usage is not None else used_bytes(settings, store, tenant)
    if files + runs < quota:
        return
    raise QuotaExceeded(
        f"tenant {tenant} stores {files + runs:,} bytes ({files:,} in files, {runs:,} in "
        f"ended jobs' checkpoints and models and its sessions' checkpoints) and may store "
        f"{quota:,} ({Limits.var('max_storage_bytes_per_tenant')}); delete fine-tuned "
        "models (DELETE /v1/models/{model}), checkpoints (RestClient.delete_checkpoint) or "
        "files it no longer needs, or wait for retention to reclaim old runs",
        code="storage_quota_exceeded",
    )


def erase_file_copies(settings: Settings, store: Store, tenant: str, file_id: str) -> list[str]:
    """After a file is deleted: remove the rows and the tokenizer the tenant's ended jobs
    prepared from it (unfinished ones kept the file from being deleted). The job ids."""
    jobs = store.jobs.ended_reading(tenant, file_id)
    for job_id in jobs:
        run = settings.job_dir(job_id)
        for part in ("data", "tokenizer"):
            shutil.rmtree(run / part, ignore_errors=True)
        store.jobs.set_storage(job_id, kept_bytes(settings, job_id))
    return jobs


def sweep(settings: Settings, store: Store, now: float | None = None) -> dict[str, int]:
    """The reconciler's periodic pass: measure ended jobs not measured yet, and reclaim the
    run directories past retention, a bounded batch of each."""
    now = time.time() if now is None else now
    measured = 0
    for job_id in store.jobs.ended_unmeasured(SWEEP_BATCH):
        store.jobs.set_storage(job_id, kept_bytes(settings, job_id))
        measured += 1
    reclaimed = 0
    if settings.run_retention_days > 0:
        before = int(now - settings.run_retention_days * DAY_S)
        for job_id in store.jobs.to_reclaim(before, SWEEP_BATCH):
            shutil.rmtree(settings.job_dir(job_id), ignore_errors=True)
            store.jobs.set_storage(job_id, kept_bytes(settings, job_id), reclaimed_at=int(now))
            reclaimed += 1
    if reclaimed:
        log.info("retention reclaimed the run directories of %d ended job(s)", reclaimed)
    return {"measured": measured, "reclaimed": reclaimed}
