"""`/v1/fine_tuning/jobs`: OpenAI's create, list, retrieve, cancel, pause, resume, events,
checkpoints; ours: validate (dry run), checkpoint content (a tar download), metrics
(series), memory (the tracer timeline), logs."""

from __future__ import annotations

import asyncio
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Header, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import PlainTextResponse, Response, StreamingResponse

from api.errors import responses
from api.routes import STREAM_HEADERS, V1_DEPENDENCIES, Ctx, OwnJob, Tenant, respond
from api.schemas import (
    CheckpointList,
    EventList,
    FineTuningJob,
    JobCheckpoint,
    JobEvent,
    JobList,
    MemoryResponse,
    MetricsResponse,
    Series,
    page_ends,
)
from service.control import exports
from service.errors import InvalidRequest
from service.registry import fine_tuned_name
from service.spec.job import spec_of
from service.spec.request import JobRequest
from service.store.status import TERMINAL

router = APIRouter(
    prefix="/fine_tuning/jobs",
    tags=["fine-tuning"],
    responses=responses(401),
    dependencies=V1_DEPENDENCIES,
)
JobId = Annotated[str, "fine_tuning_job_id"]
# enums in the schema, so a client (and the fuzzer) knows the values a filter takes
JobStatus = Literal[
    "validating_files", "queued", "running", "paused", "succeeded", "failed", "cancelled"
]
EventType = Literal["message", "metrics"]
EVENT_ID = r"^ftevent-[0-9]{1,18}$"
EventCursor = Annotated[
    str | None,
    Query(pattern=EVENT_ID, description="an event id such as 'ftevent-42': the events after it"),
]
MAX_STEP = 2**31 - 1  # the store keeps steps as 32-bit integers (PostgreSQL's `integer`)


@router.post("", response_model=FineTuningJob, responses=responses(400, 409))
def jobs_create(
    req: JobRequest,
    c: Ctx,
    tenant: Tenant,
    idempotency_key: Annotated[
        str | None,
        Header(
            min_length=1,
            max_length=255,
            description="a retried create with the same key returns the same job",
        ),
    ] = None,
) -> Response:
    """Create a fine-tuning job (OpenAI's body; extensions: engine, resources,
    checkpoint_every, max_attempts, hyperparameters.max_steps/seq_len/eval_every)."""
    job, _created = c.jobs.create(tenant, req, idempotency_key)
    return respond(FineTuningJob.of(job))


@router.post("/validate", responses=responses(400, 503))
def jobs_validate(req: JobRequest, c: Ctx, tenant: Tenant) -> dict[str, Any]:
    """Dry run, nothing stored: the data report (examples, tokens, truncation) and the
    estimate (steps, chunk plan, model data per tier per rank, whether it fits)."""
    from service.control.estimate import validate_job

    return c.jobs.heavy.run(validate_job, c.settings, c.store, c.jobs, tenant, req, tenant=tenant)


@router.get("", response_model=JobList, responses=responses(400, 404))
def jobs_list(
    request: Request,
    c: Ctx,
    tenant: Tenant,
    after: Annotated[str | None, Query(max_length=64)] = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    status: JobStatus | None = None,
) -> Response:
    metadata = {
        k[len("metadata[") : -1]: v
        for k, v in request.query_params.items()
        if k.startswith("metadata[") and k.endswith("]")
    }
    rows, more = c.jobs.page(tenant, after, limit, status, metadata or None)
    return respond(JobList(data=[FineTuningJob.of(j) for j in rows], has_more=more))


@router.get("/{fine_tuning_job_id}", response_model=FineTuningJob, responses=responses(404))
def jobs_get(fine_tuning_job_id: str, c: Ctx, tenant: Tenant) -> Response:
    return respond(FineTuningJob.of(c.jobs.view(tenant, fine_tuning_job_id)))


@router.post(
    "/{fine_tuning_job_id}/cancel", response_model=FineTuningJob, responses=responses(404, 409)
)
def jobs_cancel(fine_tuning_job_id: str, c: Ctx, tenant: Tenant) -> Response:
    """Stop the job's Ray job (and its workers); the job ends `cancelled`. 409 if it has
    already ended."""
    return respond(FineTuningJob.of(c.jobs.cancel(tenant, fine_tuning_job_id)))


@router.post(
    "/{fine_tuning_job_id}/pause", response_model=FineTuningJob, responses=responses(400, 404)
)
def jobs_pause(fine_tuning_job_id: str, c: Ctx, tenant: Tenant) -> Response:
    """Pause the job: a queued one leaves the queue at once; a running one writes a
    checkpoint at its next step boundary, frees its workers and becomes `paused`
    (`pause_requested` until then). 400 in any other status."""
    return respond(FineTuningJob.of(c.jobs.pause(tenant, fine_tuning_job_id)))


@router.post(
    "/{fine_tuning_job_id}/resume", response_model=FineTuningJob, responses=responses(400, 404)
)
def jobs_resume(fine_tuning_job_id: str, c: Ctx, tenant: Tenant) -> Response:
    """Resume a paused job: queued again, it continues from the pause's checkpoint with
    the losses an uninterrupted run has. 400 if it is not paused."""
    return respond(FineTuningJob.of(c.jobs.resume(tenant, fine_tuning_job_id)))


def _event_cursor(after: str | None) -> int | None:
    # the pattern in the query's schema has checked the shape: "ftevent-<seq>"
    return None if after is None else int(after.removeprefix("ftevent-"))


@router.get("/{fine_tuning_job_id}/events", response_model=EventList, responses=responses(400, 404))
def jobs_events(
    job: OwnJob,
    c: Ctx,
    after: EventCursor = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 20,
    type: EventType | None = None,
) -> Response:
    """Events newest first (as OpenAI); `after` pages to older ones."""
    rows, more = c.jobs.events(job, _event_cursor(after), limit, type)
    return respond(EventList(data=[JobEvent.of(e) for e in rows], has_more=more))


STREAM_POLL_S = 0.5  # how often the stream looks for new events in the store
STREAM_KEEPALIVE_S = 15.0  # a comment line this often, so proxies keep the stream open


@router.get(
    "/{fine_tuning_job_id}/events/stream",
    response_class=StreamingResponse,
    responses={
        200: {
            "content": {"text/event-stream": {}},
            "description": "Server-Sent Events: one `id: ftevent-N`, `event: message|metrics`, "
            "`data: <the event object, as in /events>` block per event, oldest first; an "
            "`event: end` block (data: the job object) once the job has ended and every "
            "event was sent; `: keep-alive` comments in between.",
        },
        **responses(400, 404, 429),
    },
)
async def jobs_events_stream(
    job: OwnJob,
    c: Ctx,
    request: Request,
    tenant: Tenant,
    after: EventCursor = None,
    # typed str with a None default, not `str | None`: the schema then says the header is
    # a string when present (a header has no null)
    last_event_id: Annotated[
        str,  # noqa: RUF013
        Header(
            alias="Last-Event-ID",
            pattern=EVENT_ID,
            description="sent by a reconnecting EventSource: resume after this event",
        ),
    ] = None,
) -> StreamingResponse:
    """The job's events as they happen (Server-Sent Events), from the first one or after
    `Last-Event-ID` / `after`; the stream ends after the job does. A chart fed by it
    grows as metrics arrive, without polling."""
    start = _event_cursor(last_event_id or after)

    async def stream():
        seq = start
        quiet = 0.0
        ended = None
        while not await request.is_disconnected() and not c.streams.closing:
            rows, more = await run_in_threadpool(c.jobs.events, job, seq, 500, None, "asc")
            for e in rows:
                ev = JobEvent.of(e)
                yield f"id: {ev.id}\nevent: {ev.type}\ndata: {ev.model_dump_json()}\n\n"
                seq = e.seq
            if more:
                continue
            if ended is not None:  # every event up to and after the end has been sent
                yield f"event: end\ndata: {FineTuningJob.of(ended).model_dump_json()}\n\n"
                return
            now = await run_in_threadpool(c.jobs.get, tenant, job.id)
            if now.status in TERMINAL:
                ended = now  # one more read: events written with the status change
                continue
            if rows:
                quiet = 0.0
                continue
            await asyncio.sleep(STREAM_POLL_S)
            quiet += STREAM_POLL_S
            if quiet >= STREAM_KEEPALIVE_S:
                quiet = 0.0
                yield ": keep-alive\n\n"

    c.streams.take(tenant)
    body = c.streams.guard(tenant, stream())
    return StreamingResponse(body, media_type="text/event-stream", headers=STREAM_HEADERS)


@router.get(
    "/{fine_tuning_job_id}/checkpoints",
    response_model=CheckpointList,
    responses=responses(400, 404),
)
def jobs_checkpoints(
    job: OwnJob,
    c: Ctx,
    after: Annotated[str | None, Query(max_length=64)] = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 10,
) -> Response:
    """The job's newest checkpoints (as many as Ray Train keeps) and the final one."""
    name = job.fine_tuned_model or fine_tuned_name(spec_of(job).base_model, job.suffix, job.id)
    rows, more = c.jobs.checkpoints(job, after, limit)
    data = [JobCheckpoint.of(ck, name, exports.available(c.settings, job, ck)) for ck in rows]
    return respond(CheckpointList(data=data, has_more=more, **page_ends(data)))


@router.get(
    "/{fine_tuning_job_id}/checkpoints/{checkpoint_id}/content",
    response_class=StreamingResponse,
    responses={
        200: {
            "content": {"application/x-tar": {"schema": {"type": "string", "format": "binary"}}},
            "description": "A tar archive (pax) of the checkpoint's model as `variant` says, "
            "its files at the archive's root: 'adapter' a PEFT adapter directory "
            "(adapter_config.json, adapter_model.safetensors, the tokenizer) for "
            "`PeftModel.from_pretrained`; 'merged' and 'full' a transformers model directory "
            "(config.json, safetensors, the tokenizer) for `from_pretrained`.",
        },
        **responses(400, 404),
    },
)
def jobs_checkpoint_content(
    job: OwnJob,
    c: Ctx,
    checkpoint_id: str,
    variant: Annotated[
        Literal["adapter", "merged", "full"] | None,
        Query(
            description="adapter (a LoRA job's every checkpoint), merged (a LoRA job's final "
            "checkpoint: the adapters merged into the model), full (a full fine-tuning job's "
            "final checkpoint); default: adapter for LoRA jobs, full otherwise"
        ),
    ] = None,
) -> StreamingResponse:
    """Download a checkpoint's model as a tar archive, streamed. The checkpoint's
    `variants` list the forms it has; one it does not have (or the job's method never
    writes) is a 404 saying which it has."""
    ck = c.jobs.checkpoint(job, checkpoint_id)
    chosen = variant or exports.default_variant(job)
    files = exports.members(exports.content_dir(c.settings, job, ck, chosen))
    name = f"{job.id}-step{ck.step}-{chosen}.tar"
    headers = {
        "Content-Disposition": f'attachment; filename="{name}"',
        "Content-Length": str(exports.tar_size(files)),
    }
    return StreamingResponse(
        exports.tar_stream(files), media_type="application/x-tar", headers=headers
    )


@router.get(
    "/{fine_tuning_job_id}/metrics", response_model=MetricsResponse, responses=responses(400, 404)
)
def jobs_metrics(
    job: OwnJob,
    c: Ctx,
    names: Annotated[
        str | None,
        Query(max_length=2000, description="comma-separated series names; all if absent"),
    ] = None,
    step_from: Annotated[int | None, Query(ge=0, le=MAX_STEP)] = None,
    step_to: Annotated[int | None, Query(ge=0, le=MAX_STEP)] = None,
    max_points: Annotated[
        int,
        Query(ge=2, le=100_000, description="steps at most; a range with more is thinned"),
    ] = 5000,
) -> Response:
    """Series by name over steps: train_loss, valid_loss, lr, tokens_per_second,
    step_time_s, tflops, model_data_bytes_<tier>, bytes_moved_<a>_to_<b>,
    peak_non_model_bytes, comm_bytes_sent, ... A range of more than `max_points` steps
    comes back thinned to every k-th step (the least k that fits) and its last step."""
    wanted = {n.strip() for n in names.split(",") if n.strip()} if names else None
    series: dict[str, Series] = {}
    for p in c.jobs.metric_points(job, step_from, step_to, max_points):
        for k, v in p.values.items():
            if (wanted is not None and k not in wanted) or not isinstance(v, (int, float)):
                continue
            s = series.setdefault(k, Series(name=k, steps=[], values=[]))
            s.steps.append(p.step)
            s.values.append(float(v))
    return respond(
        MetricsResponse(job_id=job.id, step_from=step_from, step_to=step_to, series=series)
    )


@router.get("/{fine_tuning_job_id}/memory", response_model=MemoryResponse, responses=responses(404))
def jobs_memory(job: OwnJob, c: Ctx) -> Response:
    """The warm-up tracer's timeline (rank 0): per moment the operator, non-model bytes
    N_i, chunk bytes on the device, the device budget and A_j; tier budgets and peaks."""
    st = c.jobs.stats(job)
    trace = (st.trace if st else None) or {}
    tiers = (st.tiers if st else None) or {}
    nm = [int(x) for x in trace.get("non_model_bytes", [])]
    budget = (tiers.get("device") or {}).get("budget")
    allowance = (
        [max(0, int(budget) - max(nm[j], nm[min(j + 1, len(nm) - 1)])) for j in range(len(nm))]
        if budget is not None
        else []
    )
    return respond(
        MemoryResponse(
            job_id=job.id,
            available=bool(nm),
            moments=len(nm),
            names=list(trace.get("names", [])),
            non_model_bytes=nm,
            chunk_bytes=[int(x) for x in trace.get("chunk_bytes", [])],
            chunk_peak_bytes=[int(x) for x in trace.get("chunk_peak_bytes", [])],
            peak_device_bytes=int(trace.get("peak_device_bytes", 0)),
            device_budget_bytes=int(budget) if budget is not None else None,
            chunk_allowance_bytes=allowance,
            peak_non_model_bytes=int(trace.get("peak_non_model_bytes", 0)),
            tiers=tiers,
        )
    )


@router.get(
    "/{fine_tuning_job_id}/logs",
    response_class=PlainTextResponse,
    responses={200: {"content": {"text/plain": {}}}, **responses(400, 404, 429, 503)},
)
async def jobs_logs(
    job: OwnJob,
    c: Ctx,
    tenant: Tenant,
    follow: bool = False,
    attempt: Annotated[int | None, Query(ge=1, le=1000)] = None,
):
    """Driver and worker logs of each attempt (Ray's job logs, kept in the job's directory
    once an attempt ends); `follow=true` streams the current attempt until the job ends."""
    from service.control.logs import attempt_logs, follow_logs

    if attempt is not None and attempt > max(job.attempt, 0):
        raise InvalidRequest(
            f"attempt {attempt} does not exist; the job has had {job.attempt}",
            param="attempt",
            code="invalid_value",
        )
    if not follow:
        text = await run_in_threadpool(attempt_logs, c.settings, c.store, c.launcher, job, attempt)
        return PlainTextResponse(text)
    c.streams.take(tenant)
    stream = c.streams.guard(
        tenant, follow_logs(c.settings, c.store, c.launcher, job, asyncio.sleep)
    )
    return StreamingResponse(stream, media_type="text/plain")
