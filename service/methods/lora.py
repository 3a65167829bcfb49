"""LoRA fine-tuning (ours, beside OpenAI's methods): supervised, on low-rank adapters of a
pretrained model whose own weights stay frozen (`service.lora` checks the targets)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from service.methods.base import Method
from service.methods.sections import Hyperparameters, LoraSettings
from service.resources import Body

if TYPE_CHECKING:
    from service.run_plan import RunPlan


class LoraSection(LoraSettings):
    """LoRA fine-tuning: the adapter settings, and the hyperparameters."""

    hyperparameters: Hyperparameters | None = None


class LoraMethod(Method):
    name = "lora"
    summary = "low-rank adapters on a frozen model"
    section = LoraSection
    pretrained = "trains adapters on a pretrained model's frozen weights"
    adapter_settings_at = "method.lora"

    def adapters(self, section: Body | None) -> LoraSettings:
        assert section is None or isinstance(section, LoraSection)
        return section or LoraSection()

    def objective(self, run: RunPlan) -> Any:
        from service.objectives import Supervised

        return Supervised()


LORA = LoraMethod()
