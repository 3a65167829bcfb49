"""Direct Preference Optimization (OpenAI's `dpo`) on preference pairs, against the model
before training as the reference; with `method.dpo.lora` (ours) only low-rank adapters
train, and the reference is the base without them. The objective is
`service.methods.dpo_objective.DPO`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

from pydantic import Field

from service.methods.base import Method
from service.methods.dpo_objective import DEFAULT_BETA, DPO
from service.methods.sections import Auto, Hyperparameters, LoraSettings
from service.spec.resources import Body

if TYPE_CHECKING:
    from service.spec.run_plan import RunPlan


class DpoHyperparameters(Hyperparameters):
    beta: Auto | Annotated[float, Field(gt=0, le=100)] = Field(
        default="auto",
        description="how far the policy may move from the reference: the weight of the "
        "log-probability ratios in the DPO loss; auto: 0.1",
    )


class DpoSection(Body):
    """Direct Preference Optimization on preference pairs (OpenAI's `dpo`); with `lora`
    (ours) only low-rank adapters train, and the reference is the base without them."""

    hyperparameters: DpoHyperparameters | None = None
    lora: LoraSettings | None = Field(
        default=None, description="train low-rank adapters instead of every weight"
    )


class DpoMethod(Method):
    name = "dpo"
    summary = "preference pairs"
    section = DpoSection
    hyperparameters = DpoHyperparameters
    data = "preference"
    pretrained = "teaches a pretrained model preferences"
    adapter_settings_at = "method.dpo.lora"

    def adapters(self, section: Body | None) -> LoraSettings | None:
        assert section is None or isinstance(section, DpoSection)
        return section.lora if section is not None else None

    def decided(self, hp: Hyperparameters) -> dict[str, Any]:
        beta = getattr(hp, "beta", "auto")
        return {"beta": DEFAULT_BETA if beta == "auto" else float(beta)}

    def objective(self, run: RunPlan) -> Any:
        return DPO.of(run)


DPO_METHOD = DpoMethod()
