"""The request sections every training method builds on: the common hyperparameters
(OpenAI's, plus ours) and the LoRA adapter settings. A method's own section
(`method.<name>`) is declared in its module (`service.methods.supervised`, ...).

Its own module so that the methods and the job request (`service.spec.request`, which
builds `method` from the registry) import it without importing each other.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BeforeValidator, Discriminator, Field, Tag

from pstar_core.config import LORA_DEFAULT_TARGETS as ALL_LINEAR
from pstar_core.config import LoraConfig
from service.spec.resources import WHOLE, Body

Auto = Literal["auto"]


class Hyperparameters(Body):
    n_epochs: Auto | Annotated[int, Field(strict=True, ge=1, le=50), WHOLE] = Field(
        default="auto", description="passes over the training file"
    )
    batch_size: Auto | Annotated[int, Field(strict=True, ge=1, le=4096), WHOLE] = Field(
        default="auto", description="examples per optimizer step, over all workers"
    )
    learning_rate_multiplier: Auto | Annotated[float, Field(gt=0, le=1000)] = Field(
        default="auto", description="multiplies the base learning rate"
    )
    # ours
    max_steps: Annotated[int, Field(strict=True, ge=1, le=10_000_000), WHOLE] | None = Field(
        default=None, description="stop after this many optimizer steps (at most n_epochs)"
    )
    seq_len: Auto | Annotated[int, Field(strict=True, ge=16, le=32768), WHOLE] = Field(
        default="auto", description="tokens per example row; auto: fits the longest, up to 512"
    )
    eval_every: Annotated[int, Field(strict=True, ge=1, le=10_000_000), WHOLE] | None = Field(
        default=None, description="steps between validation losses (default: 10 per run)"
    )
    packing: Auto | Annotated[bool, Field(strict=True)] = Field(
        default="auto",
        description="several short examples per row of seq_len tokens, attention kept inside "
        "each (a batch is then batch_size rows); auto: packs when one example per row would "
        "leave more than a third of the row slots padding",
    )


# the engine's LoRA defaults are the API's: one source of defaults
_ENGINE_LORA = LoraConfig()
ModuleName = Annotated[
    str,
    Field(
        pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$",
        description="a module name or name suffix, e.g. 'q_proj' or 'self_attn.q_proj'",
    ),
]


def _no_all_linear_in_list(v: list[str]) -> list[str]:
    if ALL_LINEAR in v:
        raise ValueError(f"give '{ALL_LINEAR}' as the whole value, not inside a list")
    return v


def _one_name_is_not_a_list(v: Any) -> Any:
    if isinstance(v, str) and v != ALL_LINEAR:
        raise ValueError(f"give a list of module names (['{v}']) or '{ALL_LINEAR}'")
    return v


# a string is 'all-linear', anything else a list of names: the discriminator validates the
# one member that applies, so an error is about it alone (not "or" the other member). The
# tags read as pydantic's own union tags, which error locations leave out
TargetModules = Annotated[
    Annotated[Literal["all-linear"], Tag("str")]
    | Annotated[
        list[ModuleName],
        Field(min_length=1, max_length=64),
        AfterValidator(_no_all_linear_in_list),
        Tag("list[str]"),
    ],
    Discriminator(lambda v: "str" if isinstance(v, str) else "list[str]"),
    BeforeValidator(_one_name_is_not_a_list),
]


class LoraSettings(Body):
    """Low-rank adapters on a pretrained model: its weights stay frozen, only the
    adapters train."""

    r: Annotated[int, Field(strict=True, ge=1, le=4096), WHOLE] = Field(
        default=_ENGINE_LORA.r, description="rank of each adapter"
    )
    alpha: Annotated[float, Field(strict=True, gt=0)] = Field(
        default=_ENGINE_LORA.alpha, description="scaling numerator: the update is (alpha / r) B A x"
    )
    dropout: Annotated[float, Field(strict=True, ge=0, lt=1)] = Field(
        default=_ENGINE_LORA.dropout, description="dropout on the adapter input"
    )
    target_modules: TargetModules = Field(
        default=ALL_LINEAR,  # the engine's default (LORA_DEFAULT_TARGETS)
        description="the linear layers that get adapters, by name or name suffix; 'all-linear': "
        "every linear layer but the output head",
    )

    def settings(self) -> dict[str, Any]:
        """The adapter settings the job runs with (its `engine.lora` section)."""
        return self.model_dump(mode="json", exclude={"hyperparameters"})
