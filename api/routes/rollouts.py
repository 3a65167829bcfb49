"""`POST /v1/internal/jobs/{job_id}/rollouts`: a reinforcement job's answers sampled by the
model server, by the adapters its workers exported for the step (`sampler: server`;
service.methods.rollouts is the client). Only that job's own key, the one its attempt was
granted (service.control.grader_access), is answered; every prompt's answers come from
the base model's application with the adapters loaded beside every other tenant's, as
`/v1/chat/completions` answers, taking one of the tenant's generation slots.
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Literal

from fastapi import APIRouter, Path, Request
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from api.auth import bearer_secret
from api.errors import responses
from api.routes import V1_DEPENDENCIES, Ctx, Tenant, respond
from api.routes.completions import open_all
from service.control.grader_access import job_of_key
from service.errors import Forbidden
from service.serving.deployments import rollout_target
from service.sessions.sampling import SampleCall, collect
from service.store.keys import GRADER

router = APIRouter(
    tags=["internal"],
    responses=responses(400, 401, 403, 404, 409, 429, 503),
    dependencies=V1_DEPENDENCIES,
)

Token = Annotated[int, Field(ge=0, lt=1 << 31)]


class RolloutRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    attempt: Annotated[int, Field(ge=1)] = Field(description="the attempt that exported them")
    step: Annotated[int, Field(ge=0)] = Field(description="the step whose adapters sample")
    prompts: Annotated[list[Annotated[list[Token], Field(min_length=1)]], Field(min_length=1)] = (
        Field(max_length=1024, description="token ids of each prompt")
    )
    n: Annotated[int, Field(ge=1, le=64)] = Field(description="answers a prompt")
    max_tokens: Annotated[int, Field(ge=1, le=4096)]
    temperature: Annotated[float, Field(gt=0, le=2)] = 1.0
    seed: Annotated[int, Field(ge=0, lt=1 << 31)] = Field(
        description="prompt i's answers are seeded by seed + i"
    )
    stop_token_ids: list[Token] = Field(default=[], max_length=64)


class Rollout(BaseModel):
    tokens: list[int]  # the sampled tokens, an ending one included
    logprobs: list[float]  # the sampler's log-probability of each
    finish_reason: Literal["stop", "length"]


class Rollouts(BaseModel):
    samples: list[Rollout]  # prompt 0's n answers, then prompt 1's, ...


@router.post("/internal/jobs/{job_id}/rollouts", response_model=Rollouts)
async def rollouts(
    body: RolloutRequest,
    request: Request,
    c: Ctx,
    tenant: Tenant,
    job_id: Annotated[str, Path(max_length=64)],
):
    """The answers to each prompt by the job's adapters of `step`."""
    secret = bearer_secret(request.headers.get("authorization")) or ""
    key = await run_in_threadpool(c.store.keys.find, secret)
    if key is None or key.role != GRADER or job_of_key(key.name) != job_id:
        raise Forbidden(
            f"the rollouts of job {job_id} are sampled for that job's own workers, with the "
            "key its attempt was given",
            code="permission_denied",
        )
    target = await run_in_threadpool(
        rollout_target, c.settings, c.store, tenant, job_id, body.attempt, body.step
    )
    calls = [
        SampleCall(
            prompt=p,
            num_samples=body.n,
            max_tokens=body.max_tokens,
            temperature=body.temperature,
            top_p=1.0,
            top_k=0,
            seed=body.seed + i,
            stop_tokens=tuple(body.stop_token_ids),
        )
        for i, p in enumerate(body.prompts)
    ]
    opened, _firsts = await open_all(c, tenant, target, [x.payload() for x in calls])
    try:
        got = await asyncio.gather(*(collect(e, x) for e, x in zip(opened, calls, strict=True)))
    finally:
        for e in opened:
            await e.aclose()  # type: ignore[attr-defined]
        c.generations.give_back(tenant)
    samples = [
        Rollout(tokens=t, logprobs=lp, finish_reason="stop" if why == "stop" else "length")
        for r in got
        for t, lp, why in r.sequences
    ]
    return respond(Rollouts(samples=samples))
