"""A job's spec: what it runs, decided once at creation and stored as the job's plan.

`JobService.resolve` builds it from the request with every "auto" it can decide there
(batch size, epochs, learning rate, the method's own hyperparameters such as DPO's beta);
two are decided when the driver has tokenized the data, because they depend on it:
`seq_len` ("auto": fits the longest example) and `packing` ("auto": packs when one
example per row would waste a third of the rows). The driver's run plan and the job's
data report carry those. Every rule is `service.spec.auto`'s.

Each setting is stored once: the learning rate in `hyperparameters`, the adapter
settings in `method.lora`, the device in `resources.use_gpu`; the client's `engine`
section is kept as sent (checked), and `engine_config` composes the engine's config from
all of them. It is frozen, and read back typed (`Job.spec`); plans stored before it
existed are brought to its shape by migration 0007.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from service import methods
from service.spec.resources import Resources

VERSION: Literal[1] = 1


class Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ModelSpec(Frozen):
    """The model a job starts from, resolved for its tenant."""

    id: str
    kind: Literal["zoo", "base", "fine-tuned"]
    path: str | None = None  # a Hugging Face directory; None for a zoo model


class FileSpec(Frozen):
    id: str
    format: str
    examples: int


class AdapterSpec(Frozen):
    """LoRA adapter settings as decided (the request's `method.<name>...lora`, defaults
    filled in): the engine's `lora` section (`pstar_core.config.LoraConfig`)."""

    r: int
    alpha: float
    dropout: float
    target_modules: Literal["all-linear"] | list[str]

    def settings(self) -> dict[str, Any]:
        """As the engine's config, `peft` and the job object take them."""
        return self.model_dump(mode="json")


class MethodSpec(Frozen):
    type: str = methods.DEFAULT
    lora: AdapterSpec | None = None  # the adapter settings, when the method trains them


class HyperparametersSpec(BaseModel):
    """The hyperparameters with "auto" decided, but `seq_len` and `packing` (the driver
    decides them on the tokenized data); a method's own (DPO's `beta`) come after."""

    model_config = ConfigDict(frozen=True, extra="allow")

    n_epochs: int
    batch_size: int
    learning_rate_multiplier: float
    learning_rate: float
    max_steps: int | None = None
    seq_len: int | Literal["auto"] = "auto"
    eval_every: int | None = None
    # plans stored before packing existed ran one example per row
    packing: bool | Literal["auto"] = False


class EarlyStoppingSpec(Frozen):
    patience: int
    min_delta: float = 0.0
    warmup_evals: int = 0


class JobSpec(Frozen):
    """What a job runs (see the module's docstring)."""

    version: Literal[1] = VERSION
    base_model: str  # the model its fine-tuned model is named after
    method: MethodSpec = Field(default_factory=MethodSpec)
    model: ModelSpec
    training_file: FileSpec
    validation_file: FileSpec | None = None
    hyperparameters: HyperparametersSpec
    engine: dict[str, Any] = Field(default_factory=dict)  # the client's section, checked
    resources: Resources = Field(default_factory=Resources)
    checkpoint_every: int | None = None
    suffix: str | None = None
    early_stopping: EarlyStoppingSpec | None = None
    # experiment trackers, as the request gave them (`service.spec.integrations`)
    integrations: list[dict[str, Any]] = Field(default_factory=list)

    @property
    def training_method(self) -> methods.Method:
        return methods.get(self.method.type)

    @property
    def trains_adapters(self) -> bool:
        """Whether it trains LoRA adapters (its method holds their settings then)."""
        return self.method.lora is not None

    def engine_config(self) -> dict[str, Any]:
        """The engine's config: the client's section with the learning rate, the device,
        the host memory Ray reserves per worker and the adapter settings (the driver adds
        the spill directory)."""
        cfg = dict(self.engine)
        optimizer = dict(cfg.get("optimizer") or {})
        optimizer["lr"] = self.hyperparameters.learning_rate
        cfg["optimizer"] = optimizer
        cfg["device"] = "cuda" if self.resources.use_gpu else "cpu"
        if self.resources.memory_per_worker is not None:  # what Ray reserves per worker
            cfg["memory"] = {
                **(cfg.get("memory") or {}),
                "host_reserved": self.resources.memory_per_worker,
            }
        if self.method.lora is not None:
            cfg["lora"] = self.method.lora.settings()
        return cfg

    def stored(self) -> dict[str, Any]:
        """The form the store keeps (the job's `plan` column)."""
        return self.model_dump(mode="json")


def spec_of(job: Any) -> JobSpec:
    """A stored job's spec (its `plan` column), typed."""
    return JobSpec.model_validate(job.plan)
