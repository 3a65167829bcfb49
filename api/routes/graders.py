"""`/v1/fine_tuning/alpha/graders`: run a grader on one sample, or check one, as OpenAI
has them, so a user tries a grader before a reinforcement job pays for it
(service/methods/graders.py says what each grader computes)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, model_validator

from api.errors import responses
from api.routes import V1_DEPENDENCIES, Ctx, Tenant, respond
from service.methods.graders import Grader, check_item, checked, grade, prepared

router = APIRouter(
    prefix="/fine_tuning/alpha/graders",
    tags=["graders"],
    responses=responses(400, 401),
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
    """OpenAI's error flags of a run; `sample_parse_error` and the python grader's runtime
    error can be set here (the others belong to model graders, not run here)."""

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
def graders_run(body: GraderRunRequest, c: Ctx, _tenant: Tenant) -> Response:
    """The reward `grader` gives `model_sample` for the dataset line `item`."""
    grader = checked(body.grader, python=c.settings.python_graders)
    item = {} if body.item is None else body.item
    check_item(grader, item, "item")
    got = grade(grader, body.model_sample, item)
    scores = got.sub_rewards or {grader.name: got.reward}
    meta = GraderRunMetadata(
        name=grader.name,
        type=grader.type,
        errors=GraderErrors(
            sample_parse_error=got.sample_parse_error,
            python_grader_runtime_error=got.python_error is not None,
            python_grader_runtime_error_details=got.python_error,
        ),
        execution_time=got.seconds,
        scores=scores,
    )
    return respond(GraderRunResponse(reward=got.reward, sub_rewards=got.sub_rewards, metadata=meta))


@router.post("/validate", response_model=GraderValidateResponse)
def graders_validate(body: GraderValidateRequest, c: Ctx, _tenant: Tenant) -> Response:
    """`grader` as this service will run it, or a 400 naming what it would refuse."""
    grader = checked(body.grader, python=c.settings.python_graders)
    return respond(GraderValidateResponse(grader=grader))
