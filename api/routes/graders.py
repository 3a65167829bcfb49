"""`/v1/fine_tuning/alpha/graders`: run a grader on one sample, or check one, as OpenAI
has them, so a user tries a grader before a reinforcement job pays for it
(service/methods/graders.py says what each grader computes)."""

from __future__ import annotations

import json
from typing import Any

import anyio
from fastapi import APIRouter
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, model_validator

from api.context import Context
from api.errors import responses
from api.generate import collect
from api.routes import V1_DEPENDENCIES, Ctx, Tenant, respond
from api.routes.completions import started
from service.methods.graders import Grader, Runners, check_item, checked, grade, prepared
from service.serving.deployments import target_of

router = APIRouter(
    prefix="/fine_tuning/alpha/graders",
    tags=["graders"],
    responses=responses(400, 401, 404, 429, 503),
    dependencies=V1_DEPENDENCIES,
)


class GraderValidateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    grader: Grader

    @model_validator(mode="before")
    @classmethod
    def _explained(cls, data: Any) -> Any:
        """A python or model grader is a 400 that says why it is not run, not "no such
        type" ([service/methods/graders.py] `prepared`)."""
        if isinstance(data, dict) and "grader" in data:
            return {**data, "grader": prepared(data["grader"])}
        return data


class GraderRunRequest(GraderValidateRequest):
    model_sample: str = Field(max_length=1_000_000)
    item: Any = None


class GraderErrors(BaseModel):
    """OpenAI's error flags of a run. Set here: `sample_parse_error` (the answer is not
    the JSON a template asks for), the python grader's runtime and server (sandbox) errors,
    `model_grader_parse_error` (a score_model's answer held no number, a label_model's no
    label) and `other_error` (a multi grader's formula had no value, e.g. a division by
    zero)."""

    formula_parse_error: bool = False
    invalid_variable_error: bool = False
    model_grader_parse_error: bool = False
    model_grader_refusal_error: bool = False
    model_grader_server_error: bool = False
    model_grader_server_error_details: str | None = None
    other_error: bool = False
    python_grader_runtime_error: bool = False
    python_grader_runtime_error_details: str | None = None
    python_grader_server_error: bool = False
    python_grader_server_error_type: str | None = None
    sample_parse_error: bool = False
    truncated_observation_error: bool = False
    unresponsive_reward_error: bool = False


class GraderRunMetadata(BaseModel):
    name: str
    type: str
    errors: GraderErrors
    execution_time: float
    scores: dict[str, float]
    token_usage: int | None = None
    sampled_model_name: str | None = None


class GraderRunResponse(BaseModel):
    reward: float
    sub_rewards: dict[str, float]
    metadata: GraderRunMetadata
    model_grader_token_usage_per_model: dict[str, Any] = {}


class GraderValidateResponse(BaseModel):
    grader: Grader


@router.post("/run", response_model=GraderRunResponse)
def graders_run(body: GraderRunRequest, c: Ctx, tenant: Tenant) -> Response:
    """The reward `grader` gives `model_sample` for the dataset line `item`."""
    grader = checked(
        body.grader, python=c.settings.python_graders, embeddings=c.embedder is not None
    )
    item = {} if body.item is None else body.item
    check_item(grader, item, "item")
    got = grade(grader, body.model_sample, item, Runners(ask=_asker(c, tenant), embed=_embed(c)))
    scores = got.sub_rewards or {grader.name: got.reward}
    meta = GraderRunMetadata(
        name=grader.name,
        type=grader.type,
        errors=GraderErrors(
            sample_parse_error=got.sample_parse_error,
            python_grader_runtime_error=got.python_error is not None
            and not got.python_server_error,
            python_grader_runtime_error_details=got.python_error,
            python_grader_server_error=got.python_server_error,
            python_grader_server_error_type="sandbox" if got.python_server_error else None,
            model_grader_parse_error=got.model_parse_error,
            other_error=got.formula_error,
        ),
        execution_time=got.seconds,
        scores=scores,
        token_usage=sum(got.model_tokens.values()) if got.model_tokens else None,
        sampled_model_name=next(iter(got.model_tokens), None),
    )
    return respond(
        GraderRunResponse(
            reward=got.reward,
            sub_rewards=got.sub_rewards,
            metadata=meta,
            model_grader_token_usage_per_model=got.model_tokens,
        )
    )


def _asker(c: Context, tenant: str):
    """A model grader's question answered as `/v1/chat/completions` answers: any
    model the tenant may call, within the per-request token limit and its share of
    concurrent generations. Called from the route's worker thread."""

    def ask(model: str, messages: list[dict[str, str]], sampling: dict[str, Any]):
        target = target_of(c.settings, c.store, tenant, model)
        limit = c.settings.limits.max_tokens_per_request
        asked = sampling.get("max_tokens")
        payload = {
            "messages": messages,
            "max_tokens": None if asked is None else min(asked, limit),
            "default_max_tokens": limit,
            "temperature": 1.0 if sampling.get("temperature") is None else sampling["temperature"],
            "top_p": 1.0 if sampling.get("top_p") is None else sampling["top_p"],
            "n": 1,
            "seed": sampling.get("seed"),
            "stop": None,
        }
        if (rf := sampling.get("response_format")) is not None:  # a label_model's labels
            payload["json_schema"] = json.dumps(rf["json_schema"]["schema"])
        return anyio.from_thread.run(_answer, c, tenant, target, payload)

    return ask


def _embed(c: Context):
    """The cosine metric's embeddings, by the configured model (None: none is), cut to its
    window as a job's are (service.methods.api_client.api_embedder)."""
    if c.embedder is None:
        return None
    return lambda texts: c.embedder.embed(texts, truncate=True).vectors


async def _answer(c: Context, tenant: str, target: Any, payload: dict) -> tuple[str, int]:
    first, events = await started(c, tenant, target, payload)
    try:
        ans = await collect(first, events, 1)
    finally:
        c.generations.give_back(tenant)
    return ans.texts[0], ans.usage.total_tokens


@router.post("/validate", response_model=GraderValidateResponse)
def graders_validate(body: GraderValidateRequest, c: Ctx, _tenant: Tenant) -> Response:
    """`grader` as this service will run it, or a 400 naming what it would refuse."""
    grader = checked(
        body.grader, python=c.settings.python_graders, embeddings=c.embedder is not None
    )
    return respond(GraderValidateResponse(grader=grader))
