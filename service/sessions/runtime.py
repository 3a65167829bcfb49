"""Sessions, their training models and the futures of their requests (docs/sessions.md).

A session belongs to a tenant and holds training models. A model is an engine on one of
the base models (`service.registry.base_models`): LoRA adapters of the asked rank on the
attention and MLP projections (and the output head with `train_unembed`), or every
weight (rank 0: full fine-tuning, on the chunk engine's tiers). A model runs its
requests one at a time, on its own thread, in the order of their `seq_id` (`Ordered`):
the SDK numbers them and may submit the next before it reads the last one's result, and
a request it sends again (its retries) gets the first one's future.

Each request answers with a future id at once; its result (a JSON object, or the
protobuf bytes of `forward_backward`) is fetched later (`Sessions.result`). Errors the
caller can fix (`losses.BadInput`, `losses.Unsupported`) are the future's "user" errors.

A model's engines run where `service.sessions.hosts` puts them (Ray actors, or this
process); a model itself, its ordered runner and its saves are `service.sessions.model`'s.
"""

from __future__ import annotations

import itertools
import json
import logging
import shutil
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from service.errors import Gone, InvalidRequest, NotFound, QuotaExceeded, Unavailable
from service.registry import base_models
from service.sessions import checkpoints, fit
from service.sessions.hosts import Host, ModelSpec, local_hosts
from service.sessions.losses import BadInput, Unsupported
from service.sessions.model import Ordered, SaveOptions, TrainingModel
from service.sessions.sampling import Sampler, Samplers
from service.settings import Limits, Settings

log = logging.getLogger("pstar.sessions")

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
UNEMBED = ("lm_head",)
KEEP_READ_S = 120.0
KEEP_UNREAD_S = 3600.0  # a result nobody asked for (its client gone) is dropped after this
ENDED_KEPT = 10_000  # ended sessions remembered (a 410 for their heartbeats, not a 404)
HOSTS_WAIT_S = 120.0  # how long a new model waits for its Ray head to be started again


@dataclass
class Session:
    id: str
    tenant: str
    created: float
    last_seen: float
    models: list[str] = field(default_factory=list)
    beating: bool = False  # its client sends heartbeats (then silence means it is gone)
    name: str | None = None  # the client's display_name


@dataclass
class Pending:
    tenant: str
    future: Future
    forget: Callable[[], None]  # drops the model's own reference to the result
    retrieved_at: float | None = None
    created: float = field(default_factory=time.time)


class Sessions:
    """Every session of this control plane, their models and their requests' futures."""

    def __init__(
        self,
        settings: Settings,
        engine: dict[str, Any] | None = None,
        check_quota: Callable[[str], None] = lambda tenant: None,
        observe: Callable[[str, float, int], None] = lambda op, seconds, tokens: None,
        hosts: Callable[[ModelSpec], tuple[Host, str]] = local_hosts,
        job_workers: Callable[[str], int] = lambda tenant: 0,
    ) -> None:
        self.settings = settings
        # workers the tenant's running fine-tuning jobs take: a model's engines count
        # toward the same PSTAR_MAX_RUNNING_WORKERS_PER_TENANT
        self.job_workers = job_workers
        self.hosts = hosts  # where a new training model's engine runs (service.sessions.hosts)
        self.check_quota = check_quota  # a 429 when the tenant's storage is full
        self.observe = observe  # each operation: its name, seconds, tokens (the metrics)
        self.engine_defaults: dict[str, Any] = dict(engine or {"dtype": "auto"})
        self.sessions: dict[str, Session] = {}
        # sessions that ended, newest last: (tenant, how), so a heartbeat gets a 410 that
        # stops the client's loop and a second finish is a no-op (ENDED_KEPT of them)
        self.ended: OrderedDict[str, tuple[str, str]] = OrderedDict()
        self.models: dict[str, TrainingModel] = {}
        self.pending: dict[str, Pending] = {}
        self._request_ids: dict[Future, str] = {}
        self._lock = threading.RLock()  # create_model answers a repeat under it
        # cleared while the cluster engines run on is being replaced (hosts_moving)
        self._hosts_ready = threading.Event()
        self._hosts_ready.set()
        self._ids = itertools.count()
        self.samplers = Samplers(settings, self.states)

    # -- sessions ---------------------------------------------------------------------

    def create_session(self, tenant: str, beating: bool = False, name: str | None = None) -> str:
        """A new session; `beating` when its client will send heartbeats (the SDK's
        does, every 10 s, from the start). Idle ones are ended by the API's sweeper."""
        sid = f"sess-{uuid.uuid4().hex[:16]}"
        now = time.time()
        with self._lock:
            self.sessions[sid] = Session(sid, tenant, now, now, beating=beating, name=name)
        return sid

    def end_idle(self, now: float | None = None) -> list[str]:
        """End the sessions not heard from (a heartbeat or a request) in `session_idle_s`,
        or in `session_lost_s` once their client has sent heartbeats, freeing their
        models; the ids of those ended. The API's sweeper calls it every few seconds."""
        now = now or time.time()
        limits = self.settings.limits
        ended = []
        for s in list(self.sessions.values()):
            quiet = limits.session_lost_s if s.beating else limits.session_idle_s
            if s.last_seen >= now - quiet:
                continue
            log.info("session %s of %s silent since %.0f: ended", s.id, s.tenant, s.last_seen)
            how = "heartbeats" if s.beating else "a heartbeat or request"
            self.finish(s.tenant, s.id, how=f"ended after {quiet:.0f} s without {how}")
            ended.append(s.id)
        return ended

    def session(self, tenant: str, sid: str) -> Session:
        s = self.sessions.get(sid)
        if s is None or s.tenant != tenant:
            ended = self.ended.get(sid)
            if ended is not None and ended[0] == tenant:
                raise Gone(
                    f"Session '{sid}' has {ended[1]}: create a new session (its runs' saved "
                    "checkpoints remain).",
                    param="session_id",
                    code="session_ended",
                )
            raise NotFound("session", sid, param="session_id")
        s.last_seen = time.time()
        return s

    def finish(self, tenant: str, sid: str, how: str = "been finished by its client") -> None:
        """End a session and free its models; finishing one that has ended does nothing
        (the first reason stands, as in Tinker)."""
        before = self.ended.get(sid)
        if before is not None and before[0] == tenant:
            return
        s = self.sessions.get(sid)
        if s is None or s.tenant != tenant:
            raise NotFound("session", sid, param="session_id")
        with self._lock:
            self.sessions.pop(sid, None)
            self.ended[sid] = (tenant, how)
            while len(self.ended) > ENDED_KEPT:
                self.ended.popitem(last=False)
            self.samplers.end_session(sid)
            ended = [m for mid in s.models if (m := self.models.pop(mid, None)) is not None]
        for m in ended:  # outside the lock: a Ray engine takes seconds to stop
            for d in (self.states(tenant) / m.id / "sampler_weights").glob("ephemeral-*"):
                shutil.rmtree(d, ignore_errors=True)  # save_weights_and_get_sampling_client's
            self._close(m)

    def _close(self, m: TrainingModel) -> None:
        m.runner.close()
        try:
            m.host.close()
        except Exception as e:  # its engines are gone already: nothing left to free
            log.warning("closing %s: %s", m.id, e)

    def _drop(self, mid: str) -> None:
        """A model whose engine could not be built: out of its session, its slot and its
        engines freed (the create's future says why)."""
        with self._lock:
            m = self.models.pop(mid, None)
            s = self.sessions.get(mid.split(":", 1)[0])
            if s is not None and mid in s.models:
                s.models.remove(mid)
        if m is not None:
            self._close(m)

    def hosts_moving(self) -> None:
        """The cluster engines run on is being replaced (the embedded head died): new
        models wait for `hosts_moved` (a model made meanwhile would go to the dead one)."""
        self._hosts_ready.clear()

    def hosts_moved(self, hosts: Callable[[ModelSpec], tuple[Host, str]] | None) -> None:
        """Models go to `hosts` from now on (None: where they went), and may be made."""
        if hosts is not None:
            self.hosts = hosts
        self._hosts_ready.set()

    def lose_engines(self, why: str) -> list[str]:
        """The models whose engines ran on a Ray cluster that is gone (the embedded head
        died and another was started): their requests fail at once from now on, saying
        `why` and to start again from a saved state. Their ids."""
        with self._lock:
            models = list(self.models.values())
        lost = [m for m in models if hasattr(m.host, "lose")]
        for m in lost:
            m.host.lose(why)  # type: ignore[attr-defined]
        return [m.id for m in lost]

    def close(self) -> None:
        """End every session (the control plane is stopping): their engines are closed."""
        for session in list(self.sessions.values()):
            self.finish(session.tenant, session.id, how="ended when the server stopped")

    # -- models -----------------------------------------------------------------------

    def capabilities(self) -> list[dict[str, Any]]:
        return [
            {"model_name": m.id, "trainable": True, "sampleable": True}
            for m in base_models(self.settings)
        ]

    def create_model(
        self,
        tenant: str,
        sid: str,
        model_seq_id: int,
        base_model: str,
        lora: dict[str, Any] | None,
        start: Callable[[TrainingModel], dict[str, Any]] | None = None,
        workers: int = 1,
    ) -> str:
        """A new training model (its engine built as the future's work; `start` builds it
        another way: from a saved state)."""
        s = self.session(tenant, sid)
        mid = f"{sid}:train:{model_seq_id}"
        in_jobs = 0
        if mid not in self.models:  # a repeat gets its model
            in_jobs = self.job_workers(tenant)  # the store: read outside the lock
            self._check_room(tenant, workers, in_jobs)
        base = next((m for m in base_models(self.settings) if m.id == base_model), None)
        if base is None:
            known = ", ".join(m.id for m in base_models(self.settings)) or "none"
            raise InvalidRequest(
                f"base_model {base_model!r} is not a base model here; base models: {known}",
                param="base_model",
                code="model_not_found",
            )
        lora = lora or {}
        rank = int(lora.get("rank", 32))
        targets = (
            (ATTENTION if lora.get("train_attn", True) else ())
            + (MLP if lora.get("train_mlp", True) else ())
            + (UNEMBED if lora.get("train_unembed", True) else ())
        )
        if rank < 0 or (rank and not targets):
            raise InvalidRequest(
                "lora_config: rank must be >= 0 (0: every weight) with something to train"
            )
        if mid in self.models:
            return self._future_of(mid, 0)
        assert base.path is not None  # base_models() are directories
        budget = self.settings.default_resources.get("memory_per_worker")
        dtype = str(self.engine_defaults.get("dtype", "auto"))
        if workers > 1 and self.hosts is local_hosts:
            raise InvalidRequest(
                f"user_metadata pstar_workers={workers}: engines over several workers run "
                "in Ray actors; the operator sets PSTAR_SESSION_ENGINES=ray",
                param="user_metadata",
            )
        planned = fit.check(base.id, base.path, rank, targets, dtype, budget, workers)
        if not self._hosts_ready.wait(HOSTS_WAIT_S):
            raise Unavailable(
                f"no engine could be placed for {mid}: the Ray head engines run on is still "
                f"being started again after {HOSTS_WAIT_S:.0f} s; retry later"
            )
        try:  # Ray's client connects once, in seconds: not under the lock
            getattr(self.hosts, "connect", lambda: None)()
        except Exception as e:  # Ray not reachable: not the caller's
            log.error("no Ray for %s", mid, exc_info=e)
            raise Unavailable(f"no engine could be placed for {mid}: {e}") from None
        with self._lock:
            if mid in self.models:
                return self._future_of(mid, 0)
            if self.sessions.get(sid) is not s:  # it ended meanwhile: no model outlives it
                self.session(tenant, sid)
            self._check_room(tenant, workers, in_jobs)  # again: another may have come first
            cfg = dict(self.engine_defaults)
            seed = lora.get("seed")
            spec = ModelSpec(mid, base.id, base.path, rank, targets, cfg, workers, seed)
            try:
                host, where = self.hosts(spec)
            except Exception as e:  # Ray not reachable, a name taken: not the caller's
                log.error("no engine host for %s", mid, exc_info=e)
                raise Unavailable(f"no engine could be placed for {mid}: {e}") from None
            runner = Ordered(f"session-model-{mid}")
            model = TrainingModel(
                mid, tenant, base, rank, targets, host, runner, where,
                model_data_bytes=planned.chunk_bytes, workers=workers,
            )  # fmt: skip
            self.models[mid] = model
            s.models.append(mid)
        checkpoints.write_run(self.states(tenant), mid, base.id, rank)  # listed from now on

        def first() -> dict[str, Any]:
            try:
                return start(model) if start is not None else model.build()
            except BaseException:
                threading.Thread(target=self._drop, args=(mid,), daemon=True).start()
                raise

        return self._track(tenant, runner.submit(0, first), self._forget(runner, 0))

    def workers_held(self) -> dict[str, int]:
        """Engines each tenant's training models hold (workers, as jobs count them)."""
        out: dict[str, int] = {}
        for m in list(self.models.values()):
            out[m.tenant] = out.get(m.tenant, 0) + m.workers
        return out

    def _check_room(self, tenant: str, workers: int, in_jobs: int) -> None:
        """A 429 when the tenant holds its limit of training models, or when the new
        one's engines would take its running workers (jobs' and sessions') past its limit."""
        limits = self.settings.limits
        held = sum(1 for m in self.models.values() if m.tenant == tenant)
        if held >= limits.max_session_models_per_tenant:
            raise QuotaExceeded(
                f"tenant {tenant} holds {held} training models, its limit "
                f"({Limits.var('max_session_models_per_tenant')}="
                f"{limits.max_session_models_per_tenant}); end a session "
                "(ServiceClient.close(), or stop its heartbeats) to free one",
                code="too_many_session_models",
            )
        in_sessions = self.workers_held().get(tenant, 0)
        limit = limits.max_running_workers_per_tenant
        if in_jobs + in_sessions + workers > limit:
            raise QuotaExceeded(
                f"tenant {tenant} runs {in_jobs + in_sessions} workers ({in_jobs} in "
                f"fine-tuning jobs, {in_sessions} in training sessions), its limit "
                f"({Limits.var('max_running_workers_per_tenant')}={limit}); this model's "
                f"engines need {workers}: end a session or wait for a job to finish",
                code="too_many_workers",
            )

    def states(self, tenant: str) -> Path:
        """Where a tenant's saved states are (its own root: a path names no other's)."""
        return self.settings.sessions_dir(tenant)

    # -- runs and checkpoints (service.sessions.checkpoints) ---------------------------

    def runs(self, tenant: str) -> list[dict[str, Any]]:
        root = self.states(tenant)
        return [self.run(tenant, r) for r in checkpoints.run_ids(root)]

    def run(self, tenant: str, run: str) -> dict[str, Any]:
        live = self.sessions.get(run.split(":", 1)[0])
        seen = live.last_seen if live is not None and live.tenant == tenant else None
        return checkpoints.training_run(self.states(tenant), tenant, run, seen)

    def checkpoints(self, tenant: str, run: str | None = None) -> list[dict[str, Any]]:
        """A run's checkpoints (or all the tenant's), newest first."""
        root = self.states(tenant)
        if run is not None:
            self.run(tenant, run)  # a 404 for a run that is not the tenant's
            found = checkpoints.checkpoints(root, run)
        else:
            found = [c for r in checkpoints.run_ids(root) for c in checkpoints.checkpoints(root, r)]
            found.sort(key=lambda c: -c.created)
        return [c.wire() for c in found]

    def delete_checkpoint(self, tenant: str, run: str, checkpoint_id: str) -> None:
        checkpoints.delete(self.states(tenant), run, checkpoint_id)

    def load_model(
        self, tenant: str, sid: str, model_seq_id: int, path: str, optimizer: bool
    ) -> str:
        """A new training model of session `sid` continuing from a saved state (`save`):
        its weights and, with `optimizer`, Adam's moments and step, bitwise (without:
        Adam starts again from the weights)."""
        # save_state gives tinker://<model id>/weights/<name>, under the caller's root
        where = checkpoints.locate(self.states(tenant), path, "weights")
        if where is None:
            raise NotFound("saved state", path, param="path")
        meta = json.loads((where / checkpoints.META).read_text())
        lora = {"rank": meta["rank"]} | {
            k: any(t in meta["targets"] for t in names)
            for k, names in (
                ("train_attn", ATTENTION),
                ("train_mlp", MLP),
                ("train_unembed", UNEMBED),
            )
        }
        return self.create_model(
            tenant,
            sid,
            model_seq_id,
            meta["base_model"],
            lora,
            start=lambda m: m.load(where, optimizer),
            workers=int(meta.get("workers", 1)),
        )

    def model(self, tenant: str, mid: str) -> TrainingModel:
        m = self.models.get(mid)
        if m is None or m.tenant != tenant:
            sid = mid.split(":", 1)[0]
            if sid in self.ended and sid not in self.sessions:
                self.session(tenant, sid)  # its session ended: a 410 saying how (its own)
            raise NotFound("model", mid, param="model_id")
        owner = self.sessions.get(mid.split(":", 1)[0])
        if owner is not None:
            owner.last_seen = time.time()  # a request keeps its session alive
        return m

    def submit(
        self, tenant: str, mid: str, seq: int, op: str, fn: Callable[[TrainingModel], Any]
    ) -> str:
        """Run `fn` on the model in its `seq_id` order; `op` names it in the model's stats
        and the metrics (`observe`)."""
        m = self.model(tenant, mid)

        def timed() -> Any:
            t0, tokens = time.perf_counter(), m.tokens
            try:
                return fn(m)
            finally:
                m.last_op, m.last_op_at = op, time.time()
                self.observe(op, time.perf_counter() - t0, m.tokens - tokens)

        with self._lock:  # a retry arriving meanwhile finds the request id already there
            existing = m.runner.futures.get(seq)
            if existing is not None and existing in self._request_ids:
                return self._request_ids[existing]  # the SDK sent it again: the same future
            fut = m.runner.submit(seq, timed)
            return self._track(tenant, fut, self._forget(m.runner, seq))

    def overview(self, tenant: str) -> list[dict[str, Any]]:
        """The tenant's live sessions, their models and samplers (the dashboard)."""
        out = []
        for s in sorted(self.sessions.values(), key=lambda s: -s.created):
            if s.tenant != tenant:
                continue
            models = [self.models[m].overview() for m in s.models if m in self.models]
            samplers = [x.info() for x in self.samplers.samplers.values() if x.session_id == s.id]
            out.append(
                {
                    "id": s.id,
                    "name": s.name,
                    "created": s.created,
                    "last_seen": s.last_seen,
                    "models": models,
                    "samplers": samplers,
                }
            )
        return out

    # -- futures ----------------------------------------------------------------------

    def _forget(self, runner: Ordered, seq: int) -> Callable[[], None]:
        def forget() -> None:
            fut = runner.futures.pop(seq, None)
            if fut is not None:
                self._request_ids.pop(fut, None)

        return forget

    def _track(self, tenant: str, fut: Future, forget: Callable[[], None] = lambda: None) -> str:
        rid = f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        with self._lock:
            self._sweep()
            self.pending[rid] = Pending(tenant, fut, forget)
            self._request_ids[fut] = rid
        return rid

    def track(self, tenant: str, fut: Future) -> str:
        """A request id for a future not run by a model (a sample)."""

        def forget() -> None:
            self._request_ids.pop(fut, None)

        return self._track(tenant, fut, forget)

    # -- samplers ---------------------------------------------------------------------

    def create_sampler(
        self, tenant: str, sid: str, seq: int, base_model: str | None, path: str | None
    ) -> Sampler:
        self.session(tenant, sid)
        return self.samplers.create(tenant, sid, seq, base_model, path)

    def sampler(self, tenant: str, sampler_id: str) -> Sampler:
        sampler = self.samplers.get(tenant, sampler_id)
        owner = self.sessions.get(sampler.session_id)
        if owner is not None:
            owner.last_seen = time.time()  # a sample keeps its session alive
        return sampler

    def save_state(self, tenant: str, mid: str, seq: int, name: str, opts: SaveOptions) -> str:
        """Save a model's training state (save_state), within the tenant's storage (a full
        one is the future's user error: the SDK would retry a 429 for minutes)."""
        root = self.states(tenant)

        def save(m: TrainingModel) -> dict[str, Any]:
            self.check_quota(tenant)
            return m.save(root, name, opts)

        return self.submit(tenant, mid, seq, "save_weights", save)

    def save_for_sampler(
        self,
        tenant: str,
        mid: str,
        seq: int,
        name: str | None,
        sampler_seq: int | None,
        opts: SaveOptions,
    ) -> str:
        """Save a model's weights for sampling (`name`), or for a new sampler of its
        session (`sampler_seq`, no name: save_weights_and_get_sampling_client)."""
        root = self.states(tenant)
        sid = mid.split(":", 1)[0]

        def save(m: TrainingModel) -> dict[str, Any]:
            self.check_quota(tenant)
            label = name or f"ephemeral-{seq}"
            m.save_for_sampler(root, label, opts)
            path = f"tinker://{m.id}/sampler_weights/{label}"
            if name is not None:
                return {"path": path, "type": "save_weights_for_sampler"}
            sampler = self.samplers.create(tenant, sid, sampler_seq or 0, None, path)
            return {"sampling_session_id": sampler.id, "type": "save_weights_for_sampler"}

        return self.submit(tenant, mid, seq, "save_weights_for_sampler", save)

    def _sweep(self) -> None:
        """Drop results read more than `KEEP_READ_S` ago (the SDK polls a future again
        only on its retries, within seconds); holding them all would keep every
        forward_backward's log-probabilities for the session's life."""
        now = time.time()

        def stale(p: Pending) -> bool:
            if p.retrieved_at is not None:
                return p.retrieved_at < now - KEEP_READ_S
            return p.future.done() and p.created < now - KEEP_UNREAD_S  # abandoned

        for rid in [r for r, p in self.pending.items() if stale(p)]:
            self.pending.pop(rid).forget()

    def _future_of(self, mid: str, seq: int) -> str:
        """The request id of a model's `seq`, or, once its result was read and dropped, a
        new one already done (a create sent again long after)."""
        m = self.models[mid]
        fut = m.runner.futures.get(seq)
        if fut is not None:
            return self._request_ids[fut]
        done: Future = Future()
        done.set_result({"model_id": mid, "type": "create_model"})
        return self._track(m.tenant, done, self._forget(m.runner, seq))

    def future(self, tenant: str, rid: str) -> Pending:
        p = self.pending.get(rid)
        if p is None or p.tenant != tenant:
            raise NotFound("request", rid, param="request_id")
        return p

    def retrieved(self, rid: str) -> None:
        """The result of `rid` was handed out: it is kept `KEEP_READ_S` more."""
        p = self.pending.get(rid)
        if p is not None and p.retrieved_at is None:
            p.retrieved_at = time.time()


def error_of(e: BaseException) -> dict[str, Any]:
    """A failed request's result in the SDK's shape: the caller's mistake ("user") with
    what to change, or ours ("server")."""
    if isinstance(e, BadInput | Unsupported | InvalidRequest | QuotaExceeded):
        return {"error": str(e), "category": "user"}
    if isinstance(e, Unavailable):  # no room, or an engine's worker gone: said as it is
        log.warning("a session request failed: %s", e)
        return {"error": str(e), "category": "server"}
    log.error("a session request failed", exc_info=e)
    return {
        "error": f"internal error ({type(e).__name__}); see the server's log",
        "category": "server",
    }
