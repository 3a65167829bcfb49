"""Tinker's training API under `/api/v1`, for the unmodified `tinker` SDK
(`ServiceClient(base_url=<this server>, api_key=<a tenant's tml- key>)`): client config,
sessions, capabilities, LoRA or full training models, `forward`/`forward_backward`,
`optim_step`, and the futures their results come through (docs/sessions.md). The key
comes in `X-API-Key` (the gate checks it before the body is read); every session, model
and request belongs to its tenant, and another tenant's is a 404."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import Future
from typing import Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from api.errors import responses
from api.routes import V1_DEPENDENCIES, Ctx, Tenant
from api.tinker_wire import Sampled, forward_backward_result, read_forward_backward, sample_result
from pstar_core import StepHyper
from service.errors import InvalidRequest, NotFound
from service.sessions.losses import BadInput, Unsupported
from service.sessions.model import SaveOptions, TrainingModel
from service.sessions.runtime import Sessions, error_of
from service.sessions.sampling import SampleCall, check_unsupported, collect, stops

router = APIRouter(
    prefix="/api/v1",
    tags=["training sessions (Tinker)"],
    responses=responses(400, 401, 404),
    dependencies=V1_DEPENDENCIES,
)

MAX_SAMPLES = 128  # per request: its rows join a model server's batch all at once
LONG_POLL_S = 25.0  # under the SDK's 45 s read timeout; it polls again at once on try_again
PROTOBUF = "application/x-protobuf"
# keep the SDK on plain httpx, uncompressed bodies, one poll per future, training
# requests sent in order (docs/sessions.md)
CLIENT_CONFIG = {
    "use_pyqwest_transport": False,
    "pjwt_auth_enabled": False,
    "proto_compress_fwdbwd": False,
    "sample_use_retrieve_futures": False,
    "parallel_fwdbwd_chunks": False,
}


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class SessionBody(_Body):
    session_id: str


class CreateSession(_Body):
    sdk_version: str | None = None  # the SDK sends it, and then beats every 10 s
    display_name: str | None = None  # shown (its first 200 characters) on the dashboard


class LoraBody(_Body):
    rank: int = Field(32, ge=0, le=4096, description="0: every weight (full fine-tuning)")
    seed: int | None = None
    train_mlp: bool = True
    train_attn: bool = True
    train_unembed: bool = True


class CreateModel(_Body):
    session_id: str
    model_seq_id: int = Field(ge=0)
    base_model: str
    lora_config: LoraBody | None = None
    user_metadata: dict[str, Any] | None = None

    def workers(self, limit: int) -> int:
        """`user_metadata`'s `pstar_workers`: engines with chunk ZeRO between them."""
        raw = (self.user_metadata or {}).get("pstar_workers", 1)
        try:
            n = int(raw)
        except (TypeError, ValueError):
            n = 0
        if not 1 <= n <= limit:
            raise InvalidRequest(
                f"user_metadata pstar_workers: a whole number from 1 to {limit} "
                f"(PSTAR_MAX_WORKERS_PER_JOB), got {raw!r}",
                param="user_metadata",
            )
        return n


class ModelBody(_Body):
    model_id: str


class AdamBody(_Body):
    learning_rate: float = Field(1e-4, ge=0)
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.95, ge=0, lt=1)
    eps: float = Field(1e-12, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    grad_clip_norm: float = Field(0.0, ge=0)


class OptimStep(_Body):
    model_id: str
    seq_id: int = Field(ge=0)
    adam_params: AdamBody = AdamBody()


class SaveWeights(_Body):
    model_id: str
    seq_id: int = Field(ge=0)
    path: str
    ttl_seconds: int | None = None
    overwrite: bool = False
    user_metadata: dict[str, str] | None = None


class LoadWeights(_Body):
    session_id: str
    model_seq_id: int = Field(ge=0)
    path: str
    optimizer: bool = False


class RetrieveFuture(_Body):
    request_id: str


class SaveForSampler(_Body):
    model_id: str
    seq_id: int = Field(ge=0)
    path: str | None = None
    sampling_session_seq_id: int | None = None
    ttl_seconds: int | None = None
    user_metadata: dict[str, str] | None = None


class CreateSampler(_Body):
    session_id: str
    sampling_session_seq_id: int = Field(ge=0)
    base_model: str | None = None
    model_path: str | None = None


class Chunk(_Body):
    type: str = "encoded_text"
    tokens: list[int] = []


class Prompt(_Body):
    chunks: list[Chunk]


class SamplingBody(_Body):
    max_tokens: int | None = Field(None, ge=1)
    seed: int | None = None
    stop: str | list[str] | list[int] | None = None
    temperature: float = Field(1.0, ge=0)
    top_k: int = -1
    top_p: float = Field(1.0, gt=0, le=1)


class SampleBody(_Body):
    num_samples: int = Field(1, ge=1, le=MAX_SAMPLES)
    prompt: Prompt
    sampling_params: SamplingBody
    base_model: str | None = None
    model_path: str | None = None
    sampling_session_id: str | None = None
    seq_id: int | None = None
    prompt_logprobs: bool | None = None
    topk_prompt_logprobs: int = 0
    topk_sample_logprobs: int = 0
    target_prompt_logprobs: dict[str, Any] | None = None
    prompt_alt_tokens_k: int = 0
    prompt_logprobs_last_n: int | None = Field(None, ge=1)
    record_stability_info: bool | None = None


def sessions(c: Any) -> Sessions:
    return c.sessions  # type: ignore[no-any-return]


def _future(request_id: str, model_id: str | None = None) -> dict[str, Any]:
    return {"request_id": request_id, **({"model_id": model_id} if model_id else {})}


@router.post("/client/config")
def client_config(_tenant: Tenant) -> dict[str, Any]:
    return CLIENT_CONFIG


@router.post("/client/dynamic_config")
def dynamic_config(_tenant: Tenant) -> dict[str, Any]:
    return {"refresh_interval_sec": 300, "sample_cancel_enabled": False}


@router.get("/get_server_capabilities")
def capabilities(c: Ctx, _tenant: Tenant) -> dict[str, Any]:
    return {"supported_models": sessions(c).capabilities()}


@router.post("/telemetry")
def telemetry(_tenant: Tenant) -> dict[str, str]:
    return {"status": "accepted"}  # the SDK's own usage events: not kept


@router.post("/create_session")
def create_session(c: Ctx, tenant: Tenant, body: CreateSession | None = None) -> dict[str, Any]:
    body = body or CreateSession()
    name = body.display_name[:200] if body.display_name else None
    sid = sessions(c).create_session(tenant, beating=body.sdk_version is not None, name=name)
    return {"type": "create_session", "session_id": sid}


@router.post("/session_heartbeat", responses=responses(410))
def heartbeat(body: SessionBody, c: Ctx, tenant: Tenant) -> dict[str, str]:
    sessions(c).session(tenant, body.session_id)
    return {"type": "session_heartbeat"}


@router.post("/sessions/{session_id}/finish")
def finish(session_id: str, c: Ctx, tenant: Tenant) -> dict[str, Any]:
    sessions(c).finish(tenant, session_id)
    return {}


@router.post("/create_model", responses=responses(429))
def create_model(body: CreateModel, c: Ctx, tenant: Tenant) -> dict[str, Any]:
    rid = sessions(c).create_model(
        tenant,
        body.session_id,
        body.model_seq_id,
        body.base_model,
        body.lora_config.model_dump() if body.lora_config else None,
        workers=body.workers(c.settings.limits.max_workers_per_job),
    )
    return _future(rid, f"{body.session_id}:train:{body.model_seq_id}")


@router.post("/get_info")
def get_info(body: ModelBody, c: Ctx, tenant: Tenant) -> dict[str, Any]:
    return sessions(c).model(tenant, body.model_id).info()


@router.post("/forward_backward")
async def forward_backward(request: Request, c: Ctx, tenant: Tenant) -> dict[str, Any]:
    try:
        call = read_forward_backward(await request.body())
    except (BadInput, Unsupported) as e:
        raise InvalidRequest(str(e)) from e
    s = sessions(c)

    def step(m: TrainingModel) -> bytes:
        out = m.forward_backward(call.data, call.loss_fn, call.config, not call.forward_only)
        return forward_backward_result(out)

    op = "forward" if call.forward_only else "forward_backward"
    return _future(s.submit(tenant, call.model_id, call.seq_id, op, step), call.model_id)


@router.post("/optim_step")
def optim_step(body: OptimStep, c: Ctx, tenant: Tenant) -> dict[str, Any]:
    a = body.adam_params
    clip = a.grad_clip_norm or None  # 0: no clipping
    hyper = StepHyper(a.learning_rate, (a.beta1, a.beta2), a.eps, a.weight_decay, clip)
    rid = sessions(c).submit(
        tenant, body.model_id, body.seq_id, "optim_step", lambda m: m.optim_step(hyper)
    )
    return _future(rid, body.model_id)


@router.post("/save_weights")
def save_weights(body: SaveWeights, c: Ctx, tenant: Tenant) -> dict[str, Any]:
    try:
        opts = SaveOptions(body.ttl_seconds, body.user_metadata, body.overwrite)
    except InvalidRequest as e:
        return _refused(c, tenant, body.model_id, body.seq_id, "save_weights", e)
    rid = sessions(c).save_state(tenant, body.model_id, body.seq_id, body.path, opts)
    return _future(rid, body.model_id)


def _refused(c: Any, tenant: str, model_id: str, seq: int, op: str, e: Exception):
    """A sequenced request refused before it runs: its `seq_id` is still taken (as a
    future that fails with the caller's error), or the model's later requests would wait
    for it forever."""

    def fail(_m: TrainingModel) -> None:
        raise e

    return _future(sessions(c).submit(tenant, model_id, seq, op, fail), model_id)


@router.post("/load_weights", responses=responses(429))
def load_weights(body: LoadWeights, c: Ctx, tenant: Tenant) -> dict[str, Any]:
    rid = sessions(c).load_model(
        tenant, body.session_id, body.model_seq_id, body.path, body.optimizer
    )
    return _future(rid, f"{body.session_id}:train:{body.model_seq_id}")


@router.post("/retrieve_future")
async def retrieve_future(body: RetrieveFuture, c: Ctx, tenant: Tenant) -> Response:
    pending = sessions(c).future(tenant, body.request_id)
    try:
        result = await asyncio.wait_for(
            asyncio.shield(asyncio.wrap_future(pending.future)), LONG_POLL_S
        )
    except TimeoutError:
        return JSONResponse(
            {"type": "try_again", "request_id": body.request_id, "queue_state": "active"}
        )
    except Exception as e:  # the request's own failure: the SDK raises it to the caller
        sessions(c).retrieved(body.request_id)
        return JSONResponse(error_of(e))
    sessions(c).retrieved(body.request_id)
    if isinstance(result, bytes):
        return Response(result, media_type=PROTOBUF)
    return JSONResponse(result)


@router.post("/save_weights_for_sampler")
def save_weights_for_sampler(body: SaveForSampler, c: Ctx, tenant: Tenant) -> dict[str, Any]:
    op = "save_weights_for_sampler"
    if body.path is None and body.sampling_session_seq_id is None:
        e = InvalidRequest("give path (a name) or sampling_session_seq_id", param="path")
        return _refused(c, tenant, body.model_id, body.seq_id, op, e)
    try:
        opts = SaveOptions(body.ttl_seconds, body.user_metadata)
    except InvalidRequest as e:
        return _refused(c, tenant, body.model_id, body.seq_id, op, e)
    rid = sessions(c).save_for_sampler(
        tenant, body.model_id, body.seq_id, body.path, body.sampling_session_seq_id, opts
    )
    return _future(rid, body.model_id)


@router.post("/create_sampling_session")
def create_sampling_session(body: CreateSampler, c: Ctx, tenant: Tenant) -> dict[str, Any]:
    sampler = sessions(c).create_sampler(
        tenant, body.session_id, body.sampling_session_seq_id, body.base_model, body.model_path
    )
    return {"type": "create_sampling_session", "sampling_session_id": sampler.id}


@router.get("/samplers/{sampler_id}")
def get_sampler(sampler_id: str, c: Ctx, tenant: Tenant) -> dict[str, Any]:
    return sessions(c).sampler(tenant, sampler_id).info()


@router.post("/asample")
async def asample(body: SampleBody, c: Ctx, tenant: Tenant) -> dict[str, Any]:
    """Samples from a sampler (or a model path or base model given directly): a future
    whose result is a `SampleResponse` (protobuf), with one sequence id per sample."""
    s = sessions(c)
    try:
        call = _sample_call(body)
    except (BadInput, Unsupported) as e:
        raise InvalidRequest(str(e)) from e
    if body.sampling_session_id:
        target = s.sampler(tenant, body.sampling_session_id).target
    elif body.model_path:
        target = s.samplers.resolve(tenant, body.model_path)[1]
    else:
        target = s.samplers.base_target(body.base_model or "")
    backend = c.backend
    done: Future = Future()

    async def run() -> None:
        t0 = time.perf_counter()
        try:
            got = await collect(await backend.open(target, call.payload(), tenant), call)
            seqs = [Sampled(t, lp, reason) for t, lp, reason in got.sequences]
            done.set_result(sample_result(seqs, got.prompt_logprobs))
            s.observe("sample", time.perf_counter() - t0, sum(len(q.tokens) for q in seqs))
        except BaseException as e:  # handed to whoever polls the future
            done.set_exception(e)

    rid = s.track(tenant, done)
    task = asyncio.get_running_loop().create_task(run())
    _SAMPLES.add(task)
    task.add_done_callback(_SAMPLES.discard)
    ids = [f"{rid}:{i}" for i in range(call.num_samples)]
    return {"request_id": rid, "sample_sequence_ids": ids}


_SAMPLES: set[asyncio.Task] = set()  # running samples (the loop keeps weak references only)


def _sample_call(body: SampleBody) -> SampleCall:
    check_unsupported(body)
    prompt: list[int] = []
    for k, chunk in enumerate(body.prompt.chunks):
        if chunk.type != "encoded_text":
            raise Unsupported(
                f"prompt.chunks[{k}] is {chunk.type!r}; the samplers here take text tokens only"
            )
        prompt += chunk.tokens
    if not prompt:
        raise BadInput("prompt: no tokens")
    if body.prompt_logprobs_last_n is not None and not body.prompt_logprobs:
        raise BadInput("prompt_logprobs_last_n needs prompt_logprobs")
    p = body.sampling_params
    return SampleCall(
        prompt=prompt,
        num_samples=body.num_samples,
        max_tokens=p.max_tokens,
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=max(p.top_k, 0),
        seed=p.seed,
        prompt_logprobs=bool(body.prompt_logprobs),
        prompt_logprobs_last_n=body.prompt_logprobs_last_n,
        **stops(p.stop),
    )


def _page(items: list[dict[str, Any]], limit: int, offset: int) -> dict[str, Any]:
    return {"offset": offset, "limit": limit, "total_count": len(items)}


@router.get("/training_runs")
def training_runs(
    c: Ctx,
    tenant: Tenant,
    limit: int = Query(20, ge=1, le=1000),
    offset: int = Query(0, ge=0),
) -> dict[str, Any]:
    """The tenant's training runs (its training models, live or ended, with saves)."""
    runs = sessions(c).runs(tenant)
    runs.sort(key=lambda r: r["last_request_time"], reverse=True)
    return {"training_runs": runs[offset : offset + limit], "cursor": _page(runs, limit, offset)}


@router.get("/training_runs/{training_run_id}")
def training_run(training_run_id: str, c: Ctx, tenant: Tenant) -> dict[str, Any]:
    return sessions(c).run(tenant, training_run_id)


@router.get("/training_runs/{training_run_id}/checkpoints")
def run_checkpoints(training_run_id: str, c: Ctx, tenant: Tenant) -> dict[str, Any]:
    return {"checkpoints": sessions(c).checkpoints(tenant, training_run_id), "cursor": None}


@router.delete("/training_runs/{training_run_id}/checkpoints/{checkpoint_id:path}")
def delete_checkpoint(training_run_id: str, checkpoint_id: str, c: Ctx, tenant: Tenant) -> Response:
    sessions(c).delete_checkpoint(tenant, training_run_id, checkpoint_id)
    return Response(status_code=204)


@router.get("/checkpoints")
def user_checkpoints(
    c: Ctx,
    tenant: Tenant,
    limit: int = Query(100, ge=1, le=1000),
    offset: int = Query(0, ge=0),
) -> dict[str, Any]:
    """Every checkpoint of the tenant's runs, newest first."""
    found = sessions(c).checkpoints(tenant)
    return {"checkpoints": found[offset : offset + limit], "cursor": _page(found, limit, offset)}


@router.get("/sessions")
def list_sessions(
    c: Ctx,
    tenant: Tenant,
    limit: int = Query(20, ge=1, le=1000),
    offset: int = Query(0, ge=0),
) -> dict[str, Any]:
    """The tenant's live sessions, newest first (RestClient.list_sessions)."""
    ids = [s["id"] for s in sessions(c).overview(tenant)]
    return {"sessions": ids[offset : offset + limit]}


@router.get("/sessions/{session_id}")
def get_session(session_id: str, c: Ctx, tenant: Tenant) -> dict[str, Any]:
    s = next((x for x in sessions(c).overview(tenant) if x["id"] == session_id), None)
    if s is None:
        raise NotFound("session", session_id, param="session_id")
    return {
        "training_run_ids": [m["id"] for m in s["models"]],
        "sampler_ids": [x["sampler_id"] for x in s["samplers"]],
    }


overview_router = APIRouter(tags=["training sessions (Tinker)"], responses=responses(401))


@overview_router.get("/training_sessions")
def training_sessions(c: Ctx, tenant: Tenant) -> dict[str, Any]:
    """The caller's live training sessions with their models' progress (steps, tokens,
    last loss, last operation) and samplers: what the dashboard lists."""
    return {"object": "list", "data": sessions(c).overview(tenant)}
