"""A job's `integrations`: experiment trackers its metrics and config go to (OpenAI's
`wandb`, and `mlflow`), as the request gives them. Where they log is the operator's
(`service.settings`: W&B's key and server, MLflow's tracking URI), never the request's: a
client names a project and a run, not a host or a path on the server. The driver logs
(`service.control.tracking`)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator

from service.spec.resources import Body

Name = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9 ._/-]{0,127}$")]
Tag = Annotated[str, Field(min_length=1, max_length=64)]
Tags = Annotated[dict[Tag, Annotated[str, Field(max_length=256)]], Field(max_length=50)]


class WandbSettings(Body):
    project: Name = Field(description="the W&B project the run goes to")
    name: Name | None = Field(default=None, description="the run's name; default: the job id")
    entity: Name | None = Field(
        default=None, description="the W&B team or user; default: the key's default entity"
    )
    tags: Annotated[list[Tag], Field(max_length=50)] | None = Field(
        default=None, description="the run's tags"
    )


class Wandb(Body):
    """Weights & Biases, through its `wandb` client: online with the operator's key
    (`WANDB_API_KEY`), else offline run files in the job's directory."""

    type: Literal["wandb"]
    wandb: WandbSettings


class MlflowSettings(Body):
    experiment: Name | None = Field(
        default=None,
        description="the MLflow experiment, under the tenant's name (<tenant>/<experiment>); "
        "default: 'pstar-fine-tuning'",
    )
    run_name: Name | None = Field(default=None, description="the run's name; default: the job id")
    tags: Tags | None = Field(
        default=None, description="the run's tags (not MLflow's own `mlflow.*`, nor `pstar.*`)"
    )

    @field_validator("tags")
    @classmethod
    def _not_ours(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        taken = sorted(k for k in v or {} if k.startswith(("mlflow.", "pstar.")))
        if taken:
            raise ValueError(f"tags {taken}: mlflow.* and pstar.* are MLflow's and the service's")
        return v


class Mlflow(Body):
    """MLflow, through its client: the operator's tracking URI (`PSTAR_MLFLOW_TRACKING_URI`),
    else a SQLite store in the job's directory."""

    type: Literal["mlflow"]
    mlflow: MlflowSettings = Field(default_factory=MlflowSettings)


Integration = Annotated[Wandb | Mlflow, Field(discriminator="type")]


def settings_of(integration: dict[str, Any]) -> dict[str, Any]:
    """An integration's own settings (`wandb` or `mlflow`) from its stored form."""
    return dict(integration.get(integration["type"]) or {})
