"""A fine-tuning job request: OpenAI's body plus our extensions, validated with the
messages a client needs, how its "auto" values are decided, and the limits one job may
ask for (`service.jobs.JobService` creates the job from it).

`method.type` is "supervised" (every weight trains) or ours, "lora": low-rank adapters
on a pretrained model whose own weights stay frozen. The LoRA settings (`method.lora`)
become the engine's `lora` section, which a client cannot set in `engine` itself; their
target modules are checked against the model built on meta (see `service.lora`).
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BeforeValidator,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    field_validator,
    model_validator,
)

from pstar_core.config import LORA_DEFAULT_TARGETS as ALL_LINEAR
from pstar_core.config import ConfigError, EngineConfig, LoraConfig
from service.errors import InvalidRequest, describe_invalid
from service.resources import WHOLE, Body, Resources
from service.settings import Limits

Auto = Literal["auto"]


# pretrained weights want a small step; a from-scratch zoo model a large one
BASE_LR = {"base": 1e-4, "fine-tuned": 1e-4, "zoo": 1e-3}
DEFAULT_BETA = 0.1  # DPO's "auto" beta: the paper's and OpenAI's default
# set by the service, never by a client: the device follows `resources.use_gpu`, spill
# files go to the job's directory
SERVICE_ENGINE_KEYS = {"device": "resources.use_gpu", "memory.disk_dir": "the job's directory"}
# the free-form `engine` section is stored as JSON and read by the driver: keep it to what
# every store and JSON parser holds (64-bit integers, finite floats, text without NUL)
MAX_ENGINE_DEPTH = 16
MAX_JSON_INT = 2**63 - 1


def text_problem(v: str) -> str | None:
    """Why `v` cannot be stored and sent back as UTF-8 text; None if it can. PostgreSQL's
    text cannot hold U+0000, and a lone surrogate (JSON's "\\ud800") has no UTF-8 form;
    no id, name or label we take contains either."""
    if "\x00" in v:
        return "must not contain the NUL character (U+0000)"
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        return "must be valid Unicode (it holds a lone surrogate)"
    return None


def _plain_text(v: str) -> str:
    if why := text_problem(v):
        raise ValueError(why)
    return v


# the length limits come before the text check, so a too-long value is reported as such
ModelName = Annotated[str, Field(min_length=1, max_length=255), AfterValidator(_plain_text)]
FileId = Annotated[str, Field(min_length=1, max_length=64), AfterValidator(_plain_text)]
MetadataKey = Annotated[str, Field(max_length=64), AfterValidator(_plain_text)]
MetadataValue = Annotated[str, Field(max_length=512), AfterValidator(_plain_text)]


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


class Supervised(Body):
    hyperparameters: Hyperparameters | None = None


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
        default=_ENGINE_LORA.target_modules,
        description="the linear layers that get adapters, by name or name suffix; 'all-linear': "
        "every linear layer but the output head",
    )

    def settings(self) -> dict[str, Any]:
        """The adapter settings the job runs with (its `engine.lora` section)."""
        return self.model_dump(mode="json", exclude={"hyperparameters"})


class Lora(LoraSettings):
    """LoRA fine-tuning (ours, beside OpenAI's methods): supervised, on the adapters."""

    hyperparameters: Hyperparameters | None = None


class DpoHyperparameters(Hyperparameters):
    beta: Auto | Annotated[float, Field(gt=0, le=100)] = Field(
        default="auto",
        description="how far the policy may move from the reference: the weight of the "
        "log-probability ratios in the DPO loss; auto: 0.1",
    )


class Dpo(Body):
    """Direct Preference Optimization on preference pairs (OpenAI's `dpo`); with `lora`
    (ours) only low-rank adapters train, and the reference is the base without them."""

    hyperparameters: DpoHyperparameters | None = None
    lora: LoraSettings | None = Field(
        default=None, description="train low-rank adapters instead of every weight"
    )


METHOD_TYPES = ("supervised", "lora", "dpo")


class Method(Body):
    # OpenAI's three are parsed (so reinforcement gets a message saying it is not
    # supported); the document lists the ones this service runs: supervised (every
    # weight), dpo (preference pairs) and ours, lora
    type: Literal["supervised", "lora", "dpo", "reinforcement"] = Field(
        json_schema_extra={"enum": list(METHOD_TYPES)}
    )
    supervised: Supervised | None = None
    lora: Lora | None = None
    dpo: Dpo | None = None
    reinforcement: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _one_supported_method(self) -> Method:
        if self.type not in METHOD_TYPES:
            raise ValueError(
                f"method.type '{self.type}' is not supported; use 'supervised' (every weight "
                "trains), 'dpo' (preference pairs) or 'lora' (low-rank adapters on a frozen "
                "model)"
            )
        # a section for a method not asked for would be stored and never read
        for name in ("supervised", "lora", "dpo", "reinforcement"):
            if name != self.type and getattr(self, name) is not None:
                raise ValueError(
                    f"method.{name} belongs with method.type '{name}', and method.type is "
                    f"'{self.type}'; remove method.{name}"
                    + (f" or set method.type to '{name}'" if name in METHOD_TYPES else "")
                )
        return self

    @property
    def section(self) -> Supervised | Lora | Dpo | None:
        return {"lora": self.lora, "dpo": self.dpo}.get(self.type, self.supervised)


class EarlyStoppingRequest(Body):
    """Stop when the validation loss stops improving (ours; Together's names)."""

    patience: Annotated[int, Field(strict=True, ge=1, le=1000), WHOLE] = Field(
        description="evaluations in a row without improvement that stop the job"
    )
    min_delta: Annotated[float, Field(ge=0, le=1e6)] = Field(
        default=0.0, description="an improvement is a validation loss lower by more than this"
    )
    warmup_evals: Annotated[int, Field(strict=True, ge=0, le=1000), WHOLE] = Field(
        default=0, description="evaluations at the start that never count toward patience"
    )


class JobRequest(Body):
    """`POST /v1/fine_tuning/jobs`: OpenAI's body, plus `engine`, `resources`,
    `checkpoint_every`, `max_attempts`, `early_stopping` and
    `hyperparameters.max_steps/seq_len/eval_every/packing`."""

    model: ModelName
    training_file: FileId
    validation_file: FileId | None = None
    suffix: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")] | None = None
    seed: Annotated[int, Field(strict=True, ge=0, le=2**31 - 1), WHOLE] | None = None
    metadata: dict[MetadataKey, MetadataValue] | None = None
    method: Method | None = None
    hyperparameters: Hyperparameters | None = None
    integrations: Annotated[list[Any], Field(json_schema_extra={"maxItems": 0})] | None = Field(
        default=None, description="not supported: null or empty"
    )
    engine: dict[str, Any] = Field(default_factory=dict, description="a pstar_core EngineConfig")
    resources: Resources = Field(default_factory=Resources)
    checkpoint_every: Annotated[int, Field(strict=True, ge=1, le=10_000_000), WHOLE] | None = None
    max_attempts: Annotated[int, Field(strict=True, ge=1, le=10), WHOLE] = 3
    early_stopping: EarlyStoppingRequest | None = Field(
        default=None,
        description="stop on the validation loss (needs a validation_file; evaluated every "
        "hyperparameters.eval_every steps); the best evaluation's model becomes the "
        "fine-tuned model",
    )

    @field_validator("metadata")
    @classmethod
    def _metadata_size(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        if v is not None and len(v) > 16:
            raise ValueError(f"at most 16 metadata keys, got {len(v)}")
        return v

    @field_validator("integrations")
    @classmethod
    def _no_integrations(cls, v: list[Any] | None) -> list[Any] | None:
        if v:
            raise ValueError("integrations are not supported; see GET .../metrics and /metrics")
        return v

    @model_validator(mode="after")
    def _one_hyperparameters(self) -> JobRequest:
        if self.method_hyperparameters is not None and self.hyperparameters is not None:
            raise ValueError(
                f"give hyperparameters either in method.{self.method_type}.hyperparameters or "
                "at the top level, not both"
            )
        return self

    @property
    def method_type(self) -> str:
        return self.method.type if self.method else "supervised"

    @property
    def method_hyperparameters(self) -> Hyperparameters | None:
        section = self.method.section if self.method else None
        return section.hyperparameters if section is not None else None

    @property
    def lora(self) -> LoraSettings | None:
        """The adapter settings of a LoRA job, or a DPO job on adapters (defaults filled
        in); None otherwise."""
        if self.method_type == "dpo" and self.method and self.method.dpo:
            return self.method.dpo.lora
        if self.method_type != "lora":
            return None
        return (self.method.lora if self.method else None) or Lora()

    @property
    def hp(self) -> Hyperparameters:
        given = self.method_hyperparameters or self.hyperparameters
        if self.method_type == "dpo":
            # top-level hyperparameters of a DPO job carry no beta: its default applies
            return (
                DpoHyperparameters(**given.model_dump(exclude_unset=True))
                if given
                else DpoHyperparameters()
            )
        return given or Hyperparameters()


def json_problem(v: Any, where: str, depth: int = 0) -> tuple[str, str] | None:
    """(where, what) of the first value under `where` that a store or the driver's JSON
    parser could not keep as sent; None if there is none."""
    if depth > MAX_ENGINE_DEPTH:
        return where, f"nested deeper than {MAX_ENGINE_DEPTH} levels"
    if isinstance(v, dict):
        for k, x in v.items():
            found = json_problem(k, where, depth + 1) or json_problem(x, f"{where}.{k}", depth + 1)
            if found:
                return found
    elif isinstance(v, list):
        for i, x in enumerate(v):
            if found := json_problem(x, f"{where}.{i}", depth + 1):
                return found
    elif isinstance(v, bool) or v is None:
        return None
    elif isinstance(v, int):
        if abs(v) > MAX_JSON_INT:
            return where, "integer out of range (at most 2**63 - 1)"
    elif isinstance(v, float):
        if not math.isfinite(v):
            return where, f"must be a finite number, got {v}"
    elif isinstance(v, str) and (why := text_problem(v)):
        return where, why
    return None


def invalid_from(e: ValidationError, prefix: str = "") -> InvalidRequest:
    loc, msg, others = describe_invalid(e.errors())
    param = f"{prefix}{'.'.join(loc)}" if loc else prefix.rstrip(".") or None
    more = f" (and {others} more)" if others else ""
    return InvalidRequest(f"{param or 'body'}: {msg}{more}", param=param, code="invalid_value")


# -- deciding the plan --------------------------------------------------------------------


def gpu_cpus_per_worker(nodes: list[dict[str, float]] | None) -> float | None:
    """CPUs for each GPU worker: the CPUs per GPU of the GPU node that has the fewest, so a
    worker fits on every GPU node (the host-side AdamW of the chunks that do not fit the
    GPU runs on them: one CPU for it was a single-threaded Adam). None when the cluster
    does not say (the default, 1, then stays)."""
    shares = [n.get("CPU", 0) / n["GPU"] for n in nodes or [] if n.get("GPU", 0) >= 1]
    if not shares:
        return None
    return float(max(1, int(min(shares))))


def auto_batch_size(examples: int, workers: int) -> int:
    b = max(1, min(8, examples))
    return -(-b // workers) * workers


def auto_epochs(examples: int) -> int:
    """OpenAI-like: 3 passes, more for very small files (about 100 examples seen)."""
    return max(3, min(10, math.ceil(100 / max(1, examples))))


def check_engine(eng: Any, method: str = "supervised") -> None:
    """Refuse an engine section that is not plain JSON or sets what the service owns."""
    if not isinstance(eng, dict):
        raise InvalidRequest("engine: must be an object", param="engine", code="invalid_value")
    if found := json_problem(eng, "engine"):
        raise InvalidRequest(f"{found[0]}: {found[1]}", param=found[0], code="invalid_value")
    if "lora" in eng:
        # one place says how a job trains adapters: the method
        how = (
            "the adapter settings go in method.lora (r, alpha, dropout, target_modules)"
            if method == "lora"
            else "to train low-rank adapters, set method.type 'lora' and give r, alpha, "
            "dropout and target_modules in method.lora"
        )
        raise InvalidRequest(
            f"engine.lora is set by the service from the method: {how}; remove engine.lora",
            param="engine.lora",
            code="invalid_value",
        )
    for key, who in SERVICE_ENGINE_KEYS.items():
        head, _, tail = key.partition(".")
        if head in eng and (not tail or (isinstance(eng[head], dict) and tail in eng[head])):
            raise InvalidRequest(
                f"engine.{key} is set by the service (from {who}); remove it",
                param=f"engine.{key}",
                code="invalid_value",
            )


def engine_config(req: JobRequest, lr: float) -> dict[str, Any]:
    """The engine section a job runs with: the client's, plus the learning rate, the
    device and (a LoRA job) the adapter settings of `method.lora`; the driver adds the
    spill directory (under the job's directory)."""
    eng = req.engine
    check_engine(eng, req.method_type)
    cfg = {k: v for k, v in eng.items()}
    if req.lora is not None:
        cfg["lora"] = req.lora.settings()
    opt = (
        dict(cfg.get("optimizer") or {})
        if isinstance(cfg.get("optimizer"), dict)
        else cfg.get("optimizer")
    )
    if opt is not None and not isinstance(opt, dict):
        raise InvalidRequest(
            "engine.optimizer: must be an object", param="engine.optimizer", code="invalid_value"
        )
    opt = opt or {}
    opt["lr"] = lr
    cfg["optimizer"] = opt
    cfg["device"] = "cuda" if req.resources.use_gpu else "cpu"
    try:
        EngineConfig.parse(cfg)
    except ConfigError as e:
        # "invalid engine config:\n  dtype: Input should be ...\n  ...": one "field: why"
        # line per wrong field; the first names the param
        wrong = [x.strip() for x in str(e).splitlines()[1:]] or [str(e)]
        field = wrong[0].split(":", 1)[0]
        raise InvalidRequest(
            "; ".join(f"engine.{x}" for x in wrong),
            param="engine" if field == "(top level)" else f"engine.{field}",
            code="invalid_value",
        ) from None
    return cfg


def _over(what: str, value: Any, limit: Any, name: str, param: str) -> InvalidRequest:
    return InvalidRequest(
        f"{param}: {value} is over this service's limit of {limit} {what} "
        f"({Limits.var(name)}); ask for at most {limit}",
        param=param,
        code="limit_exceeded",
    )


def check_job_limits(limits: Limits, req: JobRequest) -> None:
    """Refuse (400) a job that asks for more than one job may have."""
    res = req.resources
    if res.num_workers > limits.max_workers_per_job:
        raise _over(
            "workers per job",
            res.num_workers,
            limits.max_workers_per_job,
            "max_workers_per_job",
            "resources.num_workers",
        )
    for what, n, name in (
        ("running workers per tenant", res.num_workers, "max_running_workers_per_tenant"),
        ("GPUs per tenant", res.num_workers if res.use_gpu else 0, "max_running_gpus_per_tenant"),
    ):
        if n > getattr(limits, name):
            # it could never start: the tenant's whole share is smaller than the job
            raise _over(what, n, getattr(limits, name), name, "resources.num_workers")
    if res.cpus_per_worker > limits.max_cpus_per_worker:
        raise _over(
            "CPUs per worker",
            res.cpus_per_worker,
            limits.max_cpus_per_worker,
            "max_cpus_per_worker",
            "resources.cpus_per_worker",
        )
    if req.max_attempts > limits.max_attempts:
        raise _over(
            "attempts", req.max_attempts, limits.max_attempts, "max_attempts", "max_attempts"
        )
    memory = req.engine.get("memory") if isinstance(req.engine, dict) else None
    spill = memory.get("disk_budget") if isinstance(memory, dict) else None
    if isinstance(spill, float) and not spill.is_integer():
        raise InvalidRequest(
            f"engine.memory.disk_budget: a fraction ({spill}) of the shared volume's free "
            f"space is not allowed here; give bytes, at most {limits.max_spill_bytes_per_job} "
            f"({Limits.var('max_spill_bytes_per_job')})",
            param="engine.memory.disk_budget",
            code="limit_exceeded",
        )
    if isinstance(spill, (int, float)) and spill > limits.max_spill_bytes_per_job:
        raise _over(
            "bytes of spill per job",
            int(spill),
            limits.max_spill_bytes_per_job,
            "max_spill_bytes_per_job",
            "engine.memory.disk_budget",
        )
