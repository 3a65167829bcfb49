"""Reinforcement fine-tuning (OpenAI's `reinforcement`): the model answers the training
file's prompts, a grader (`service.methods.graders`) scores each answer, and a GRPO-style
step makes the better answers of each prompt's group more likely. The objective is
`service.methods.rft_objective.Reinforcement`; its loss is the training primitives' own
(`service.sessions.losses`, what the `tinker` SDK's `forward_backward` runs).

The request is OpenAI's: `method.reinforcement.grader` and `.hyperparameters`
(`n_epochs`, `batch_size` prompts a step, `learning_rate_multiplier`, `eval_interval`,
`eval_samples`, `compute_multiplier`), plus ours: `group_size` (answers a prompt),
`max_completion_tokens`, `temperature`, `loss`, `sampler`, `max_steps`, `seq_len`, and
`lora` for adapters instead of every weight.

`sampler` says what samples the answers: `server`, the model server that answers chat
completions, with the job's adapters synced to it each step (`service.methods.rollouts`;
LoRA jobs only), or `engine`, the training engine itself (what a full fine-tune does: a
model larger than the GPU has no second home). `auto`: `server` for a LoRA job whose
workers reach this API, else `engine`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import Field, model_validator

from service.errors import InvalidRequest, NotFound
from service.methods.base import Method
from service.methods.sections import Auto, Hyperparameters, LoraSettings
from service.spec.resources import WHOLE, Body

if TYPE_CHECKING:
    from service.spec.run_plan import RunPlan

GROUP = 4  # answers a prompt at compute_multiplier 1
MAX_COMPLETION_TOKENS = 64
GRADER = "method.reinforcement.grader"
WATCHED = ("valid_reward_mean", -1.0)  # early stopping: a higher reward is better


class RftHyperparameters(Hyperparameters):
    compute_multiplier: Auto | Annotated[float, Field(ge=0.5, le=16)] = Field(
        default="auto",
        description="scales the answers sampled per prompt (group_size auto: 4 times this, "
        "rounded); auto: 1",
    )
    eval_interval: Annotated[int, Field(strict=True, ge=1, le=10_000_000), WHOLE] | None = Field(
        default=None, description="steps between validation rewards (OpenAI's name of eval_every)"
    )
    eval_samples: Auto | Annotated[int, Field(strict=True, ge=1, le=16), WHOLE] = Field(
        default="auto", description="answers sampled per validation prompt; auto: 1"
    )
    # ours
    group_size: Auto | Annotated[int, Field(strict=True, ge=2, le=64), WHOLE] = Field(
        default="auto",
        description="answers sampled per prompt, whose rewards are compared with each other "
        "(the group's mean is the baseline); auto: 4 times compute_multiplier",
    )
    max_completion_tokens: Auto | Annotated[int, Field(strict=True, ge=1, le=4096), WHOLE] = Field(
        default="auto", description="the longest answer, in tokens; auto: 64"
    )
    temperature: Annotated[float, Field(gt=0, le=2)] = Field(
        default=1.0, description="the sampling temperature of the answers trained on"
    )
    kl_coef: Annotated[float, Field(ge=0, le=10)] = Field(
        default=0.0,
        description="the weight of a KL penalty to the reference (the base model: LoRA jobs "
        "only), taken from each answer token's advantage",
    )
    sampler: Literal["auto", "server", "engine"] = Field(
        default="auto",
        description="what samples the answers: server (the model server that answers chat "
        "completions, the job's adapters synced to it each step; LoRA jobs) or engine (the "
        "training engine itself); auto: server for a LoRA job, else engine",
    )
    loss: Literal["importance_sampling", "ppo"] = Field(
        default="importance_sampling",
        description="the policy loss, as the training primitives define it (ppo: clipped at "
        "0.8 and 1.2)",
    )

    @model_validator(mode="after")
    def _eval_interval_is_eval_every(self) -> RftHyperparameters:
        if self.eval_interval is not None:
            if self.eval_every is not None and self.eval_every != self.eval_interval:
                raise ValueError("give eval_interval or eval_every, not both")
            object.__setattr__(self, "eval_every", self.eval_interval)
        return self


class ReinforcementSection(Body):
    """Reinforcement fine-tuning: the grader that scores each answer, the hyperparameters,
    and (ours) `lora` to train low-rank adapters instead of every weight."""

    grader: dict[str, Any] = Field(
        description="the grader of each sampled answer, as OpenAI's graders (string_check, "
        "text_similarity, score_model, multi, python); POST /v1/fine_tuning/alpha/graders/"
        "validate checks one"
    )
    hyperparameters: RftHyperparameters | None = None
    lora: LoraSettings | None = Field(
        default=None, description="train low-rank adapters instead of every weight"
    )


class ReinforcementMethod(Method):
    name = "reinforcement"
    summary = "graded answers to prompts"
    section = ReinforcementSection
    hyperparameters = RftHyperparameters
    data = "prompts"
    pretrained = "learns from the answers a pretrained model already writes"
    adapter_settings_at = "method.reinforcement.lora"
    watched = WATCHED

    def adapters(self, section: Body | None) -> LoraSettings | None:
        assert section is None or isinstance(section, ReinforcementSection)
        return section.lora if section is not None else None

    def decided(self, hp: Hyperparameters) -> dict[str, Any]:
        assert isinstance(hp, RftHyperparameters)
        mult = 1.0 if hp.compute_multiplier == "auto" else float(hp.compute_multiplier)
        group = max(2, round(GROUP * mult)) if hp.group_size == "auto" else hp.group_size
        tokens = hp.max_completion_tokens
        return {
            "eval_interval": hp.eval_every,  # OpenAI's name of it, echoed as decided
            "group_size": group,
            "compute_multiplier": mult,
            "eval_samples": 1 if hp.eval_samples == "auto" else hp.eval_samples,
            "max_completion_tokens": MAX_COMPLETION_TOKENS if tokens == "auto" else tokens,
            "temperature": hp.temperature,
            "kl_coef": hp.kl_coef,
            "loss": hp.loss,
        }

    def check(
        self,
        section: Body | None,
        first_lines: Callable[[], list[dict[str, Any]]],
        python_graders: bool,
        servable: Callable[[str, int | None, bool], None] = lambda model, tokens, grammar: None,
        embeddings: bool = False,
        unreachable: str | None = None,
    ) -> dict[str, Any]:
        """The grader as the graders' own endpoints check it, its score_model graders'
        models as chat completions would take them, and its templates against the training
        file's first lines (a key they name that a line lacks is a 400 now, not a zero
        reward for every answer later); the sampler decided (`unreachable`: why the
        workers could not reach this API, when they could not)."""
        from service.data.datasets import prompt_item
        from service.methods.graders import (
            LabelModel,
            ScoreModel,
            check_item,
            leaves,
            parse_grader,
        )

        if section is None:
            raise InvalidRequest(
                f"method.type 'reinforcement' needs {GRADER}: the grader that scores each "
                "answer (string_check, text_similarity, score_model, label_model, multi or "
                "python)",
                param=GRADER,
            )
        assert isinstance(section, ReinforcementSection)
        hp = section.hyperparameters
        if hp is not None and hp.kl_coef > 0 and section.lora is None:
            raise InvalidRequest(
                "method.reinforcement.hyperparameters.kl_coef: a KL penalty needs "
                "method.reinforcement.lora (the reference is the base model, the same engine "
                "with its adapters off; a full fine-tune keeps no second copy of the model)",
                param="method.reinforcement.hyperparameters.kl_coef",
            )
        grader = parse_grader(section.grader, GRADER, python=python_graders, embeddings=embeddings)
        for name, leaf in leaves(grader):
            if isinstance(leaf, ScoreModel | LabelModel):
                where = f"{GRADER}.graders.{name}" if name else GRADER
                sp = leaf.sampling_params if isinstance(leaf, ScoreModel) else None
                try:
                    tokens = sp.max_completions_tokens if sp else None
                    servable(leaf.model, tokens, isinstance(leaf, LabelModel))
                except (InvalidRequest, NotFound) as e:
                    field = (
                        "sampling_params.max_completions_tokens"
                        if e.param == "max_tokens"
                        else "model"
                    )
                    raise InvalidRequest(
                        f"{where}.{field}: {e.message} (a {leaf.type} grader asks a model "
                        "this service serves to its tenant, through its chat completions)",
                        param=f"{where}.{field}",
                    ) from None
        for n, line in enumerate(first_lines(), start=1):
            try:
                check_item(grader, prompt_item(line), GRADER)
            except InvalidRequest as e:
                raise InvalidRequest(
                    f"{e.message} (training_file line {n})", param=GRADER
                ) from None
        sampler, fallback = _sampler(section, unreachable)
        marked = {"sampler_fallback": True} if fallback else {}
        return {"grader": section.grader, "sampler": sampler, **marked}

    def echo(self, hp: dict[str, Any], lora: dict[str, Any] | None) -> dict[str, Any]:
        out = super().echo(hp, lora)
        if "grader" in hp:
            out["grader"] = hp["grader"]
        return out

    def objective(self, run: RunPlan) -> Any:
        from service.methods.rft_objective import Reinforcement

        return Reinforcement.of(run)


REINFORCEMENT = ReinforcementMethod()


def _sampler(section: ReinforcementSection, unreachable: str | None) -> tuple[str, bool]:
    """The stored plan's `sampler`, `server` or `engine`, as the request asks or `auto`
    decides (see the module docstring), and whether it may fall back (`auto` chose the
    server: it gives way to the engine if it cannot answer, rft_objective); a 400 for a
    server the job cannot sample on."""
    asked = section.hyperparameters.sampler if section.hyperparameters else "auto"
    param = "method.reinforcement.hyperparameters.sampler"
    if asked == "server" and section.lora is None:
        raise InvalidRequest(
            f"{param}: 'server' samples by the model server with the job's adapters synced to "
            "it each step, so it needs method.reinforcement.lora; a full fine-tune samples on "
            "its engine ('engine', or leave it 'auto')",
            param=param,
        )
    if asked == "server" and unreachable is not None:
        raise InvalidRequest(f"{param}: 'server': {unreachable}", param=param)
    if asked != "auto":
        return asked, False
    if section.lora is not None and unreachable is None:
        return "server", True
    return "engine", False
