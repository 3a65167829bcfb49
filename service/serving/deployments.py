"""Which deployment answers for a model, and keeping those deployments on Ray Serve.

Every servable model maps to a `Target`: the Serve application that loads a model
directory, and for a LoRA fine-tune the adapter that application applies.
- a base model: its own application (`pstar-<id>-<hash of its path>`);
- a LoRA fine-tune, and each checkpoint of a LoRA job: the application of the model its
  adapter applies to, with the adapter's directory (relative to the data dir) in the
  request, so many adapters share one copy of the base in memory;
- a full fine-tune: an application of its own (`pstar-ft-<job id>`), as is a LoRA
  fine-tune whose base model has since been deleted (its merged export stands alone).

`Serving.endpoint(target)` deploys the target's application the first time it is asked
(through the dashboard's Serve REST API, the way KubeRay's RayService does; the config
names `service.serving.model_server:build`) and waits until Serve says it runs. Applications are
never taken down for being idle: their one deployment autoscales to zero replicas after
`PSTAR_SERVE_IDLE_S`, and the next request starts a replica again. A deployment Serve
cannot place or start is a 503 that quotes Serve's reason.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import shutil
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from service import ray_auth
from service.adapters import adapter_dir
from service.errors import (
    Conflict,
    Forbidden,
    InvalidRequest,
    NotFound,
    QuotaExceeded,
    Unavailable,
)
from service.registry import ModelRef, resolve_model
from service.settings import Settings
from service.store import Store

log = logging.getLogger(__name__)

APP_PREFIX = "pstar-"
BUILDER = "service.serving.model_server:build"
CHECKPOINT_RE = re.compile(r"^(ft:.+):ckpt-step-(\d+)$")
STATUS_FRESH_S = 30.0  # a replica's status file older than this is a replica gone


@dataclass(frozen=True)
class Target:
    model: str  # the id the client asked for
    app: str  # the Serve application
    model_dir: Path  # what the application loads
    adapter: str | None = None  # the adapter's directory relative to the data dir
    owned_by: str = "system"


def owner(target: Target) -> str | None:
    """The tenant whose own application the target's is (a full fine-tune, or its final
    checkpoint); None for a base model's, which every tenant's adapters share."""
    if target.adapter is None and target.owned_by != "system":
        return target.owned_by
    return None


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")[:40] or "model"


def base_app(model_dir: Path, name: str) -> str:
    digest = hashlib.sha256(str(model_dir.resolve()).encode()).hexdigest()[:8]
    return f"{APP_PREFIX}{slug(name)}-{digest}"


def target_of(settings: Settings, store: Store, tenant: str, model_id: str) -> Target:
    """The deployment that answers `model_id` for `tenant`; a 404 for a model the tenant
    does not have, a 400 for one that has no weights to serve (yet)."""
    ck = CHECKPOINT_RE.match(model_id)
    if ck:
        return _checkpoint_target(settings, store, tenant, model_id, ck[1], int(ck[2]))
    ref = resolve_model(settings, store, tenant, model_id)
    if ref is None:
        raise NotFound("model", model_id, param="model")
    if ref.kind == "zoo":
        raise InvalidRequest(
            f"model {model_id} is a zoo architecture without weights (jobs train it from "
            "scratch); serve a base model or a fine-tuned one",
            param="model",
            code="model_not_servable",
        )
    if ref.kind == "base":
        assert ref.path is not None  # a base model is a directory
        return Target(model_id, base_app(ref.path, model_id), ref.path)
    return _fine_tuned_target(settings, store, tenant, ref)


def _fine_tuned_target(settings: Settings, store: Store, tenant: str, ref: ModelRef) -> Target:
    assert ref.path is not None
    if not (ref.path / "config.json").is_file():
        raise InvalidRequest(
            f"model {ref.id} has no exported files on the service's storage",
            param="model",
            code="model_not_servable",
        )
    if ref.adapter_base is not None:
        adapter = adapter_dir(ref.path)
        base = _base_dir(settings, store, tenant, ref.adapter_base)
        if base is not None and (adapter / "adapter_config.json").is_file():
            return Target(
                ref.id,
                base_app(base, ref.adapter_base),
                base,
                data_relative(settings, adapter),
                tenant,
            )
    job_id = ref.id.rsplit(":", 1)[-1]
    return Target(ref.id, f"{APP_PREFIX}ft-{slug(job_id)}", ref.path, None, tenant)


def _base_dir(settings: Settings, store: Store, tenant: str, model_id: str) -> Path | None:
    """The directory of the model an adapter applies to, if it is still there."""
    ref = resolve_model(settings, store, tenant, model_id)
    if ref is None or ref.path is None or not (ref.path / "config.json").is_file():
        return None
    return ref.path


def _checkpoint_target(
    settings: Settings, store: Store, tenant: str, model_id: str, name: str, step: int
) -> Target:
    job_id = name.rsplit(":", 1)[-1]
    job = store.jobs.get(job_id, tenant)
    if job is None:
        raise NotFound("model", model_id, param="model")
    found = [c for c in store.checkpoints.page(job.id, None, 10_000)[0] if c.step == step]
    if not found:
        raise NotFound("model", model_id, param="model")
    ck = found[0]
    if job.model_deleted_at is not None or job.run_reclaimed_at is not None:
        raise NotFound("model", model_id, param="model")  # erased or reclaimed with its run
    from service.spec.job import spec_of

    if spec_of(job).trains_adapters:
        adapter = adapter_dir(ck.path)
        base = _base_dir(settings, store, tenant, job.model)
        if base is None or not (adapter / "adapter_config.json").is_file():
            raise InvalidRequest(
                f"checkpoint model {model_id}: its adapter or its base model is no longer "
                "on the service's storage (Ray keeps the newest checkpoints)",
                param="model",
                code="model_not_servable",
            )
        return Target(
            model_id, base_app(base, job.model), base, data_relative(settings, adapter), tenant
        )
    if ck.final and (settings.finetuned_dir(job.id) / "config.json").is_file():
        return Target(
            model_id,
            f"{APP_PREFIX}ft-{slug(job.id)}",
            settings.finetuned_dir(job.id),
            None,
            tenant,
        )
    raise InvalidRequest(
        f"checkpoint model {model_id}: a full fine-tuning job's checkpoints before its last "
        "are the engine's sharded chunks with the optimizer state, not a model; its final "
        "checkpoint, a LoRA job's every checkpoint and the fine-tuned model serve",
        param="model",
        code="model_not_servable",
    )


def rollout_target(
    settings: Settings, store: Store, tenant: str, job_id: str, attempt: int, step: int
) -> Target:
    """What samples a reinforcement job's answers by its adapters of `step` (exported by
    its attempt `attempt`: service.methods.rollouts): the base model's application, which
    every tenant's adapters share. A 404 for a job or weights that are not there, a 409
    for an attempt that is not the job's current one."""
    from service.methods import rollouts
    from service.spec.job import spec_of

    job = store.jobs.get(job_id, tenant)
    if job is None:
        raise NotFound("fine-tuning job", job_id, param="job_id")
    if job.attempt != attempt:
        raise Conflict(
            f"job {job_id} runs attempt {job.attempt}, not {attempt}: an earlier attempt's "
            "workers sample no more"
        )
    if not spec_of(job).trains_adapters:
        raise InvalidRequest(
            f"job {job_id} trains every weight: its answers are sampled on its own engine",
            param="job_id",
        )
    where = rollouts.weights_dir(rollouts.sampler_dir(settings.job_dir(job_id), attempt), step)
    base = _base_dir(settings, store, tenant, job.model)
    if base is None:
        raise NotFound("base model", job.model, param="job_id")
    if not (where / "adapter_config.json").is_file():
        raise NotFound("sampler weights", f"{job_id}/attempt-{attempt}/step-{step}", param="step")
    app = base_app(base, job.model)
    return Target(job.model, app, base, data_relative(settings, where), tenant)


def data_relative(settings: Settings, path: Path) -> str:
    p = path.resolve()
    root = settings.data_dir.resolve()
    if not p.is_relative_to(root):
        raise InvalidRequest(
            f"the adapter at {p} is outside the data directory the model servers read",
            param="model",
            code="model_not_servable",
        )
    return str(p.relative_to(root))


class Serving:
    """Serve applications on the cluster of `dashboard_url()` (the Serve REST API)."""

    def __init__(
        self,
        settings: Settings,
        dashboard_url: Callable[[], str | None],
        training_waiting: Callable[[], int] = lambda: 0,
    ) -> None:
        self.settings = settings
        self.cfg = settings.serve
        self.dashboard_url = dashboard_url
        self.training_waiting = training_waiting
        self._lock = threading.Lock()
        self._running: dict[str, float] = {}  # app -> when Serve last said it runs
        self._cluster_gpus: float | None = None  # the cluster's GPUs, asked once

    # -- the Serve REST API ------------------------------------------------------------------

    def _http(self, method: str, path: str, body: Any = None, timeout: float = 30) -> Any:
        base = self.dashboard_url()
        if not base:
            raise Unavailable("models are served on Ray Serve, and no Ray dashboard is known")
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            base.rstrip("/") + path,
            data=data,
            method=method,
            headers={"Content-Type": "application/json", **ray_auth.headers()},
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                raw = r.read()
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")[:500]
            raise Unavailable(f"Ray Serve refused {method} {path}: {e.code} {detail}") from None
        except OSError as e:
            raise Unavailable(f"Ray's dashboard at {base} is not reachable: {e}") from None
        return json.loads(raw) if raw.strip() else None

    def applications(self) -> dict[str, Any]:
        """Serve's applications by name (their status, message and deployed config)."""
        got = self._http("GET", "/api/serve/applications/") or {}
        return got.get("applications") or {}

    def _put(self, apps: list[dict[str, Any]]) -> None:
        self._http(
            "PUT",
            "/api/serve/applications/",
            {
                "proxy_location": "HeadOnly",
                "http_options": {"host": self.cfg.host, "port": self.cfg.port},
                "applications": apps,
            },
        )

    def app_config(self, target: Target) -> dict[str, Any]:
        c = self.cfg
        return {
            "name": target.app,
            "route_prefix": f"/{target.app}",
            "import_path": BUILDER,
            "args": {
                "app": target.app,
                "model_dir": str(target.model_dir),
                "data_dir": str(self.settings.data_dir),
                "max_adapters": c.max_adapters,
                "max_batch": c.max_batch,
                "prefix_cache_mb": c.prefix_cache_mb,
                # the tenant whose own model it is (a full fine-tune's application), counted
                # against its share of Serve; None for a base (adapters share it)
                "owner": owner(target),
            },
            "deployments": [
                {
                    "name": "model",
                    "max_ongoing_requests": 2 * c.max_batch,
                    # a replica going (scaled down, its model deleted) finishes the answers
                    # it has begun first, the longest takes minutes on a CPU; an idle one
                    # goes at once
                    "graceful_shutdown_timeout_s": 300,
                    "autoscaling_config": {
                        "min_replicas": 0,
                        "initial_replicas": 1,
                        "max_replicas": c.max_replicas,
                        "target_ongoing_requests": c.max_batch,
                        "upscale_delay_s": 5,
                        "downscale_delay_s": c.idle_s,
                        # Serve averages load over this window before it may scale down: its
                        # default 30 s would add most of a short idle period again, and one
                        # shorter than the replicas' 10 s metrics push sees no load at all
                        "look_back_period_s": max(11.0, min(30.0, c.idle_s / 2)),
                    },
                    "ray_actor_options": {"num_cpus": c.replica_cpus, "num_gpus": self.gpus()},
                }
            ],
        }

    # -- what the API uses -------------------------------------------------------------------

    def endpoint(self, target: Target) -> str:
        """The proxy URL that answers `target`, its application deployed and running
        (waiting here, on this thread, for it to start)."""
        deadline = self.deploy(target)
        while deadline is not None and not self.started(target, deadline):
            time.sleep(0.5)
        return self.url(target)

    async def endpoint_async(self, target: Target) -> str:
        """As `endpoint`, for the API's event loop: a cold start (up to `start_timeout_s`)
        waits between short checks on the loop, not holding a server thread for its whole
        length."""
        import asyncio

        from starlette.concurrency import run_in_threadpool

        deadline = await run_in_threadpool(self.deploy, target)
        while deadline is not None and not await run_in_threadpool(self.started, target, deadline):
            await asyncio.sleep(0.5)
        return self.url(target)

    def url(self, target: Target) -> str:
        return f"{self.cfg.proxy_url}/{target.app}"

    def deploy(self, target: Target) -> float | None:
        """Deploy the target's application unless Serve has it: None when it was seen
        running moments ago, else the time by which it must be running. A tenant's own
        models in memory are bounded (`max_models_per_tenant`): past it, a 429."""
        if time.monotonic() - self._running.get(target.app, -1e9) < 5.0:
            return None
        reserves = self.cfg.replica_cpus > 0 or self.gpus() > 0
        with self._lock:
            apps = self.applications()
            if target.app not in apps:
                if reserves and (waiting := self.training_waiting()):
                    raise Unavailable(
                        f"model {target.model} is not running, and starting it would take "
                        f"resources {waiting} queued training job(s) wait for: training has "
                        "priority; retry when they have started"
                    )
                configs = [
                    a["deployed_app_config"] for a in apps.values() if a.get("deployed_app_config")
                ]
                if (tenant := owner(target)) is not None:
                    self._check_share(tenant, target, configs)
                self._put([*configs, self.app_config(target)])
                log.info("deploying %s for %s", target.app, target.model)
        return time.monotonic() + self.cfg.start_timeout_s

    def _check_share(self, tenant: str, target: Target, configs: list[dict[str, Any]]) -> None:
        mine = [c["name"] for c in configs if (c.get("args") or {}).get("owner") == tenant]
        cap = self.cfg.max_models_per_tenant
        if len(mine) >= cap:
            raise QuotaExceeded(
                f"tenant {tenant} has {len(mine)} of its own fine-tuned models in memory, as "
                f"many as one tenant may (PSTAR_SERVE_MAX_MODELS_PER_TENANT={cap}); a model "
                f"leaves after {self.cfg.idle_s:.0f} s without requests: retry then, or "
                f"delete one it no longer needs, to load {target.model}",
                param="model",
                code="too_many_models",
            )

    def started(self, target: Target, deadline: float) -> bool:
        """Whether the target's application runs now; raises when it failed to start or
        `deadline` passed."""
        app = self.applications().get(target.app) or {}
        status = app.get("status")
        if status == "RUNNING":
            self._running[target.app] = time.monotonic()
            return True
        if status in ("DEPLOY_FAILED", "UNHEALTHY"):
            raise Unavailable(f"model {target.model} could not start on Ray Serve: {why(app)}")
        if time.monotonic() > deadline:
            raise Unavailable(
                f"model {target.model} did not start within "
                f"{self.cfg.start_timeout_s:.0f} s: {self.placement()}"
                + (f"; Serve says: {why(app)}" if why(app) else f" (Serve: {status})")
            )
        return False

    def gpus(self) -> float:
        """The GPUs a replica reserves: as set, or (auto) one if the cluster has GPUs."""
        if self.cfg.replica_gpus is not None:
            return self.cfg.replica_gpus
        if self._cluster_gpus is None:
            usage = self._usage()  # the nodes that are up: an autoscaling GPU group at zero
            if usage:  # nodes shows none (the gpu overlay sets PSTAR_SERVE_REPLICA_GPUS)
                self._cluster_gpus = usage.get("GPU", [0, 0])[1]
        return 1.0 if self._cluster_gpus else 0.0

    def _usage(self) -> dict[str, list[float]]:
        """Resources in use and in total, by name, from the dashboard's cluster status."""
        try:
            got = self._http("GET", "/api/cluster_status", timeout=5)
            return got["data"]["clusterStatus"]["loadMetricsReport"]["usage"]
        except (Unavailable, KeyError, TypeError):
            return {}

    def placement(self) -> str:
        """What a replica asks of the cluster against what the cluster has in use, from the
        dashboard's cluster status (the reason a replica cannot be placed, most often)."""
        ask = f"a replica asks for {self.cfg.replica_cpus:g} CPU, {self.gpus():g} GPU"
        usage = self._usage()
        if not usage:
            return ask
        have = ", ".join(
            f"{k} {used:g} of {total:g} in use"
            for k, (used, total) in sorted(usage.items())
            if k in ("CPU", "GPU")
        )
        if "GPU" not in usage:
            have += " (no GPU)"
        return f"{ask}; the cluster has {have}"

    def not_starting(self, target: Target) -> str:
        """Serve's own words on why the target's deployment has no replica (a 503's text)."""
        try:
            said = why(self.applications().get(target.app) or {})
        except Unavailable as e:
            return str(e)
        return self.placement() + (f"; Serve says: {said}" if said else "")

    def remove(self, app: str) -> bool:
        """Take an application off Serve (a deleted full fine-tune); False if absent."""
        with self._lock:
            apps = self.applications()
            if app not in apps:
                return False
            keep = [
                a["deployed_app_config"]
                for name, a in apps.items()
                if name != app and a.get("deployed_app_config")
            ]
            self._put(keep)
            self._running.pop(app, None)
        shutil.rmtree(self.settings.serving_dir / app, ignore_errors=True)
        return True

    def loaded(self) -> dict[str, list[dict[str, Any]]]:
        """What the replicas say they hold, by application (fresh status files only)."""
        out: dict[str, list[dict[str, Any]]] = {}
        root = self.settings.serving_dir
        if not root.is_dir():
            return out
        now = time.time()
        for f in root.glob("*/*.json"):
            try:
                st = json.loads(f.read_text())
            except (OSError, ValueError):
                continue
            if now - st.get("updated_at", 0) <= STATUS_FRESH_S:
                out.setdefault(f.parent.name, []).append(st)
        return out


def why(app: dict[str, Any]) -> str:
    """The application's and its deployments' messages, joined."""
    parts = [app.get("message") or ""]
    for d in (app.get("deployments") or {}).values():
        parts.append(d.get("message") or "")
    return "; ".join(p for p in parts if p)


def serving_info(target: Target, loaded: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Where a model is in memory now: the replicas of its application, and for an adapter
    the replicas that have it loaded."""
    replicas = loaded.get(target.app, [])
    holding = [
        r for r in replicas if target.adapter is None or target.adapter in r.get("adapters", [])
    ]
    return {
        "deployment": target.app,
        "adapter": target.adapter is not None,
        "replicas": len(replicas),
        "loaded_in": [
            {"replica": r.get("replica"), "node": r.get("node"), "device": r.get("device")}
            for r in holding
        ],
    }


def delete_model_files(settings: Settings, store: Store) -> list[str]:
    """Remove the files of deleted models, their checkpoints included, that no unfinished
    job still reads (a job fine-tuning from a model deleted meanwhile keeps it until it
    ends); the job ids swept."""
    deleted = store.jobs.deleted_models()
    if not deleted:
        return []
    busy = store.jobs.models_in_use()
    out = []
    for job in deleted:
        d, run = settings.finetuned_dir(job.id), settings.job_dir(job.id)
        if job.fine_tuned_model in busy or not (d.exists() or run.exists()):
            continue
        # the model, and its checkpoints with their run: a deleted model is erased whole
        shutil.rmtree(d, ignore_errors=True)
        shutil.rmtree(run, ignore_errors=True)
        store.jobs.set_storage(job.id, 0)  # it keeps nothing now
        out.append(job.id)
    return out


def delete_model(
    settings: Settings, store: Store, serving: Serving | None, tenant: str, model_id: str
) -> None:
    """Delete a tenant's fine-tuned model, as `DELETE /v1/models/{model}`: it is no longer
    listed, served or fine-tuned from; its job keeps its record; its files go now, or when
    the last unfinished job fine-tuning from it ends; replicas drop its adapter from memory
    within a status beat, and a full fine-tune's own deployment is taken off Serve."""
    if CHECKPOINT_RE.match(model_id):
        raise InvalidRequest(
            f"model {model_id} is a checkpoint of a fine-tuning job; checkpoints go with "
            "their job's storage, delete the fine-tuned model instead",
            param="model",
            code="invalid_value",
        )
    ref = resolve_model(settings, store, tenant, model_id)
    if ref is None:
        raise NotFound("model", model_id, param="model")
    if ref.kind != "fine-tuned":
        raise Forbidden(
            f"model {model_id} is a {ref.kind} model of the service; a tenant deletes only "
            "its own fine-tuned models",
            param="model",
            code="model_not_deletable",
        )
    job_id = model_id.rsplit(":", 1)[-1]
    if not store.jobs.delete_model(job_id, int(time.time())):
        raise NotFound("model", model_id, param="model")
    if serving is not None:
        try:
            serving.remove(f"{APP_PREFIX}ft-{slug(job_id)}")
        except Unavailable as e:  # the files go anyway; a replica without them cannot load
            log.warning("could not take %s's deployment off Serve: %s", model_id, e)
    delete_model_files(settings, store)


def serving_of(
    settings: Settings, store: Store, serving: Serving | None, tenant: str, refs: list[ModelRef]
) -> dict[str, dict[str, Any]]:
    """Where each of `refs` is served now (`serving_info`), for those in memory somewhere;
    nothing is looked up when no replica reports (the usual case costs a directory check)."""
    if serving is None:
        return {}
    loaded = serving.loaded()
    if not loaded:
        return {}
    out = {}
    for ref in refs:
        if ref.kind == "zoo":
            continue
        try:
            t = target_of(settings, store, tenant, ref.id)
        except (NotFound, InvalidRequest):
            continue
        info = serving_info(t, loaded)
        if info["loaded_in"]:
            out[ref.id] = info
    return out
