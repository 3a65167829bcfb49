"""LoRA fine-tuning (ours, beside OpenAI's methods): supervised, on low-rank adapters of a
pretrained model whose own weights stay frozen (`service.adapters` checks the targets)."""

from __future__ import annotations

from service.methods.base import ADAPTERS_NEED_PRETRAINED
from service.methods.sections import Hyperparameters, LoraSettings
from service.methods.supervised import SupervisedMethod
from service.spec.resources import Body


class LoraSection(LoraSettings):
    """LoRA fine-tuning: the adapter settings, and the hyperparameters."""

    hyperparameters: Hyperparameters | None = None


class LoraMethod(SupervisedMethod):
    """Supervised's objective, on the adapters."""

    name = "lora"
    summary = "low-rank adapters on a frozen model"
    section = LoraSection
    pretrained = ADAPTERS_NEED_PRETRAINED
    adapter_settings_at = "method.lora"

    def adapters(self, section: Body | None) -> LoraSettings:
        assert section is None or isinstance(section, LoraSection)
        return section or LoraSection()


LORA = LoraMethod()
