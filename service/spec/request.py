"""A fine-tuning job request: OpenAI's body plus our extensions, validated with the
messages a client needs, how its "auto" values are decided, and the limits one job may
ask for (`service.control.jobs.JobService` creates the job from it).

`method` is built from the training methods' registry (`service.methods`): `method.type`
names one, `method.<type>` is its section. A method that trains adapters (ours: "lora",
or "dpo" with `method.dpo.lora`) gives the engine its `lora` section, which a client
cannot set in `engine` itself; the target modules are checked against the model built on
meta (see `service.adapters`).
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    Field,
    ValidationError,
    create_model,
    field_validator,
    model_validator,
)

from pstar_core.config import ConfigError, EngineConfig
from service import methods
from service.errors import InvalidRequest, describe_invalid
from service.methods.sections import Hyperparameters, LoraSettings
from service.settings import Limits
from service.spec.integrations import Integration
from service.spec.job import JobSpec
from service.spec.resources import WHOLE, Body, Resources

# pretrained weights want a small step; a from-scratch zoo model a large one
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


class _MethodBase(Body):
    """`method`: its `type`, and at most the section of that type (`method.<type>`)."""

    type: str

    @model_validator(mode="after")
    def _one_supported_method(self) -> _MethodBase:
        if self.type not in methods.METHODS:
            raise ValueError(
                f"method.type '{self.type}' is not supported; use "
                + ", ".join(f"'{m.name}' ({m.summary})" for m in methods.METHODS.values())
            )
        # a section for a method not asked for would be stored and never read
        for name in (*methods.METHODS, *methods.NOT_RUN):
            if name != self.type and getattr(self, name) is not None:
                raise ValueError(
                    f"method.{name} belongs with method.type '{name}', and method.type is "
                    f"'{self.type}'; remove method.{name}"
                    + (f" or set method.type to '{name}'" if name in methods.METHODS else "")
                )
        return self

    @property
    def section(self) -> Body | None:
        return getattr(self, self.type)


# built from the registry: a section per method, typed in the document; OpenAI's methods
# this service does not run are parsed (so a job asking for one gets a message saying
# so), and the document's enum lists the ones it runs
Method = create_model(  # type: ignore[call-overload]
    "Method",
    __base__=_MethodBase,
    type=(
        Literal[(*methods.METHODS, *methods.NOT_RUN)],
        Field(json_schema_extra={"enum": list(methods.METHODS)}),
    ),
    **{name: (m.section | None, None) for name, m in methods.METHODS.items()},
    **{name: (dict[str, Any] | None, None) for name in methods.NOT_RUN},
)


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
    method: Method | None = None  # type: ignore[valid-type]
    hyperparameters: Hyperparameters | None = None
    integrations: Annotated[list[Integration], Field(max_length=2)] | None = Field(
        default=None,
        description="experiment trackers the job's metrics and config go to: wandb "
        "(OpenAI's form) and mlflow, at most one of each; where they log is the operator's",
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
    def _one_of_each(cls, v: list[Any] | None) -> list[Any] | None:
        kinds = [i.type for i in v or []]
        if len(set(kinds)) != len(kinds):
            raise ValueError("at most one integration of each type")
        return v

    @model_validator(mode="after")
    def _one_hyperparameters(self) -> JobRequest:
        if self.method_hyperparameters is not None and self.hyperparameters is not None:
            raise ValueError(
                f"give hyperparameters either in method.{self.training_method.name}."
                "hyperparameters or "
                "at the top level, not both"
            )
        return self

    @property
    def training_method(self) -> methods.Method:
        """The method the job trains with (`service.methods`)."""
        return methods.get(self.method.type if self.method else methods.DEFAULT)

    @property
    def method_section(self) -> Body | None:
        return self.method.section if self.method else None

    @property
    def method_hyperparameters(self) -> Hyperparameters | None:
        section = self.method_section
        return getattr(section, "hyperparameters", None) if section is not None else None

    @property
    def lora(self) -> LoraSettings | None:
        """The adapters the job trains (defaults filled in), or None when every weight
        trains."""
        return self.training_method.adapters(self.method_section)

    @property
    def hp(self) -> Hyperparameters:
        """The hyperparameters, as the method's class: top-level ones carry none of the
        method's own (a DPO job's beta), so their defaults apply."""
        given = self.method_hyperparameters or self.hyperparameters
        kind = self.training_method.hyperparameters
        if given is None:
            return kind()
        if isinstance(given, kind):
            return given
        return kind(**given.model_dump(exclude_unset=True))


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


def check_engine(eng: Any, method: methods.Method | None = None) -> None:
    """Refuse an engine section that is not plain JSON or sets what the service owns."""
    if not isinstance(eng, dict):
        raise InvalidRequest("engine: must be an object", param="engine", code="invalid_value")
    if found := json_problem(eng, "engine"):
        raise InvalidRequest(f"{found[0]}: {found[1]}", param=found[0], code="invalid_value")
    if "lora" in eng:
        # one place says how a job trains adapters: the method
        at = method.adapter_settings_at if method is not None else None
        with_adapters = [m for m in methods.METHODS.values() if m.adapter_settings_at]
        how = (
            f"the adapter settings go in {at} (r, alpha, dropout, target_modules)"
            if at
            else "to train low-rank adapters, use "
            + " or ".join(
                f"method.type '{m.name}' with {m.adapter_settings_at}" for m in with_adapters
            )
            + " (r, alpha, dropout, target_modules)"
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


def checked_engine(req: JobRequest) -> dict[str, Any]:
    """The client's engine section, checked: plain JSON, nothing the service sets, an
    optimizer section that is an object (`JobSpec.engine_config` adds the rest)."""
    eng = req.engine
    check_engine(eng, req.training_method)
    opt = eng.get("optimizer")
    if opt is not None and not isinstance(opt, dict):
        raise InvalidRequest(
            "engine.optimizer: must be an object", param="engine.optimizer", code="invalid_value"
        )
    return dict(eng)


def check_engine_config(cfg: dict[str, Any]) -> None:
    """Refuse (400) an engine config `pstar_core` would not take, naming each wrong field."""
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


def check_reservation(spec: JobSpec) -> None:
    """Refuse (400) a host budget in bytes past what the worker's reservation leaves it
    (`resources.memory_per_worker` less the process's margin)."""
    from pstar_core.tiers import reserved_share

    reserved = spec.resources.memory_per_worker
    budget = (spec.engine.get("memory") or {}).get("host_budget")
    if reserved is None or not isinstance(budget, int) or isinstance(budget, bool):
        return
    room = reserved_share(reserved)
    if budget > room:
        raise InvalidRequest(
            f"engine.memory.host_budget ({budget:,} bytes) is more than a worker may plan "
            f"with in the {reserved:,} bytes Ray reserves for it (resources.memory_per_worker"
            f", less max(2 GiB, 10%) for the process): {room:,}; lower the budget, give it "
            "as a fraction of that, or reserve more",
            param="engine.memory.host_budget",
            code="invalid_value",
        )


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
    # the engine reads a float up to 1 as a share of the volume's free space (1.0: all of
    # it), and the budget is each rank's: the job spills up to workers x budget
    if isinstance(spill, float) and (spill <= 1 or not spill.is_integer()):
        raise InvalidRequest(
            f"engine.memory.disk_budget: a fraction ({spill}) of the spill volume's free "
            f"space is not allowed here; give bytes per worker, at most "
            f"{limits.max_spill_bytes_per_job} for the job's workers together "
            f"({Limits.var('max_spill_bytes_per_job')})",
            param="engine.memory.disk_budget",
            code="limit_exceeded",
        )
    workers = res.num_workers
    if isinstance(spill, (int, float)) and spill * workers > limits.max_spill_bytes_per_job:
        cap = limits.max_spill_bytes_per_job
        raise InvalidRequest(
            f"engine.memory.disk_budget: {workers} worker(s) x {int(spill)} bytes is over this "
            f"service's limit of {cap} bytes of spill per job "
            f"({Limits.var('max_spill_bytes_per_job')}); ask for at most {cap // workers} "
            "per worker",
            param="engine.memory.disk_budget",
            code="limit_exceeded",
        )
