"""Fine-tuning jobs: the request (OpenAI's body plus our extensions), how "auto" values
are decided, and the lifecycle operations the API calls (create, cancel).

A job is stored only when everything a client can get wrong has been checked: the model
exists for this tenant, the files are this tenant's processed fine-tuning files, the
hyperparameters are in range, the engine section is a valid `pstar_core` config. The
stored `plan` is what the Ray job driver runs, with every "auto" decided.

`method.type` is "supervised" (every weight trains) or ours, "lora": low-rank adapters
on a pretrained model whose own weights stay frozen. The LoRA settings (`method.lora`)
become the engine's `lora` section, which a client cannot set in `engine` itself; their
target modules are checked against the model built on meta (see `service.lora`).

Status: validating_files -> queued -> running -> succeeded | failed | cancelled.
"""

from __future__ import annotations

import math
import random
import time
from typing import Annotated, Any, Literal, TypeVar

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
from service.errors import Conflict, InvalidRequest, NotFound, QuotaExceeded, describe_invalid
from service.registry import ModelRef, resolve_model
from service.resources import WHOLE, Body, Resources
from service.settings import Limits, Settings
from service.store import (
    IdempotencyConflict,
    Job,
    Store,
    TooManyUnfinished,
    new_id,
    request_hash,
)
from service.store.statements import View

Auto = Literal["auto"]
_J = TypeVar("_J")


# pretrained weights want a small step; a from-scratch zoo model a large one
BASE_LR = {"base": 1e-4, "fine-tuned": 1e-4, "zoo": 1e-3}
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


class Lora(Body):
    """Low-rank adapters on a pretrained model (ours, beside OpenAI's methods): its
    weights stay frozen, only the adapters train."""

    hyperparameters: Hyperparameters | None = None
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


METHOD_TYPES = ("supervised", "lora")


class Method(Body):
    # OpenAI's three are parsed (so dpo gets a message saying it is not supported); the
    # document lists the ones this service runs: supervised (every weight) and ours, lora
    type: Literal["supervised", "lora", "dpo", "reinforcement"] = Field(
        json_schema_extra={"enum": list(METHOD_TYPES)}
    )
    supervised: Supervised | None = None
    lora: Lora | None = None
    dpo: dict[str, Any] | None = None
    reinforcement: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _one_supported_method(self) -> Method:
        if self.type not in METHOD_TYPES:
            raise ValueError(
                f"method.type '{self.type}' is not supported; use 'supervised' (every weight "
                "trains) or 'lora' (low-rank adapters on a frozen model)"
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
    def section(self) -> Supervised | Lora | None:
        return self.lora if self.type == "lora" else self.supervised


class JobRequest(Body):
    """`POST /v1/fine_tuning/jobs`: OpenAI's body, plus `engine`, `resources`,
    `checkpoint_every`, `max_attempts` and `hyperparameters.max_steps/seq_len/eval_every`."""

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
    def lora(self) -> Lora | None:
        """The adapter settings of a LoRA job (defaults filled in); None otherwise."""
        if self.method_type != "lora":
            return None
        return (self.method.lora if self.method else None) or Lora()

    @property
    def hp(self) -> Hyperparameters:
        return self.method_hyperparameters or self.hyperparameters or Hyperparameters()


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


class JobService:
    """Create and cancel jobs; the reconciler and the driver run them."""

    def __init__(self, settings: Settings, store: Store, launcher: Any) -> None:
        from service.heavy import HeavyWork

        self.settings, self.store, self.launcher = settings, store, launcher
        self.heavy = HeavyWork()

    def resolve(self, tenant: str, req: JobRequest) -> tuple[ModelRef, dict[str, Any]]:
        """Check everything a client can get wrong; the plan the driver will run."""
        req = self._with_default_resources(req)
        check_job_limits(self.settings.limits, req)
        model = resolve_model(self.settings, self.store, tenant, req.model)
        if model is None:
            raise InvalidRequest(
                f"model '{req.model}' does not exist; GET /v1/models lists the models you can "
                "fine-tune",
                param="model",
                code="model_not_found",
            )
        if req.lora is not None and model.kind == "zoo":
            raise InvalidRequest(
                f"method.type 'lora' trains adapters on a pretrained model's frozen weights, "
                f"and '{req.model}' is a zoo model trained from scratch (its weights start "
                "random); use method.type 'supervised', or a pretrained model (GET /v1/models: "
                "kind 'base' or 'fine-tuned')",
                param="model",
                code="model_not_available",
            )
        files = {}
        for param, fid in (
            ("training_file", req.training_file),
            ("validation_file", req.validation_file),
        ):
            if fid is None:
                continue
            f = self.store.files.get(tenant, fid)
            if f is None:
                raise InvalidRequest(
                    f"{param} '{fid}' does not exist; upload it with POST /v1/files "
                    "(purpose 'fine-tune')",
                    param=param,
                    code="file_not_found",
                )
            if f.purpose != "fine-tune" or f.status != "processed":
                raise InvalidRequest(
                    f"{param} '{fid}' is not a processed fine-tuning file (purpose "
                    f"'{f.purpose}', status '{f.status}')",
                    param=param,
                    code="invalid_file",
                )
            files[param] = f
        train = files["training_file"]
        hp = req.hp
        workers = req.resources.num_workers
        batch = (
            auto_batch_size(train.examples, workers) if hp.batch_size == "auto" else hp.batch_size
        )
        if batch % workers:
            raise InvalidRequest(
                f"hyperparameters.batch_size {batch} must be a multiple of "
                f"resources.num_workers {workers} (each worker takes an equal share)",
                param="hyperparameters.batch_size",
                code="invalid_value",
            )
        epochs = auto_epochs(train.examples) if hp.n_epochs == "auto" else hp.n_epochs
        mult = 1.0 if hp.learning_rate_multiplier == "auto" else float(hp.learning_rate_multiplier)
        check_engine(req.engine, req.method_type)  # before reading engine.optimizer.lr
        user_lr = (
            (req.engine.get("optimizer") or {}).get("lr")
            if isinstance(req.engine.get("optimizer"), dict)
            else None
        )
        base_lr = (
            float(user_lr)
            if isinstance(user_lr, (int, float)) and not isinstance(user_lr, bool) and user_lr > 0
            else BASE_LR[model.kind]
        )
        lr = base_lr * mult
        if not (math.isfinite(lr) and lr > 0):
            raise InvalidRequest(
                f"the learning rate engine.optimizer.lr ({base_lr:g}) times "
                f"hyperparameters.learning_rate_multiplier ({mult:g}) is not a positive "
                f"finite number ({lr:g})",
                param="hyperparameters.learning_rate_multiplier",
                code="invalid_value",
            )
        method: dict[str, Any] = {"type": req.method_type}
        if req.lora is not None:
            from service.lora import wrap_meta
            from service.planning import build_meta

            # the targets must name linear layers of this model: refused now, not when a
            # worker builds the engine
            assert model.path is not None  # every model but a zoo one is a HF directory
            path, lora = str(model.path), req.lora.settings()
            self.heavy.run(lambda: wrap_meta(build_meta(path), lora))
            method["lora"] = req.lora.settings()
        plan = {
            "base_model": model.base,
            "method": method,
            "model": {
                "id": model.id,
                "kind": model.kind,
                "path": str(model.path) if model.path else None,
            },
            "training_file": {"id": train.id, "format": train.format, "examples": train.examples},
            "validation_file": (
                {"id": v.id, "format": v.format, "examples": v.examples}
                if (v := files.get("validation_file"))
                else None
            ),
            "hyperparameters": {
                "n_epochs": epochs,
                "batch_size": batch,
                "learning_rate_multiplier": mult,
                "learning_rate": lr,
                "max_steps": hp.max_steps,
                "seq_len": hp.seq_len,
                "eval_every": hp.eval_every,
            },
            "engine": engine_config(req, lr),
            "resources": req.resources.model_dump(),
            "checkpoint_every": req.checkpoint_every,
            "suffix": req.suffix,
        }
        return model, plan

    def _with_default_resources(self, req: JobRequest) -> JobRequest:
        """The deployment's default resources (PSTAR_DEFAULT_RESOURCES) under the fields
        the request gives; a GPU job that says nothing about CPUs gets its share of a GPU
        node's (`gpu_cpus_per_worker`), for the host Adam and the loading threads."""
        defaults = self.settings.default_resources or {}
        given = req.resources.model_fields_set if "resources" in req.model_fields_set else set()
        merged = {**defaults, **req.resources.model_dump(include=given)}
        if merged.get("use_gpu") and "cpus_per_worker" not in merged:
            share = gpu_cpus_per_worker(getattr(self.launcher, "cluster_nodes", lambda: None)())
            if share is not None:
                merged["cpus_per_worker"] = share
        if not merged:
            return req
        return req.model_copy(update={"resources": Resources(**merged)})

    def create(self, tenant: str, req: JobRequest, idempotency_key: str | None) -> tuple[Job, bool]:
        if idempotency_key is not None and not 1 <= len(idempotency_key) <= 255:
            raise InvalidRequest(
                "Idempotency-Key must be 1 to 255 characters",
                param="Idempotency-Key",
                code="invalid_value",
            )
        body = req.model_dump(mode="json", exclude_none=True)
        h = request_hash(body)
        if idempotency_key:
            existing = self.store.jobs.by_idempotency_key(tenant, idempotency_key)
            if existing is not None:
                return self._same(existing, h, idempotency_key), False
        _model, plan = self.resolve(tenant, req)
        now = int(time.time())
        job = Job(
            id=new_id("ftjob"),
            tenant=tenant,
            model=req.model,
            training_file=req.training_file,
            validation_file=req.validation_file,
            suffix=req.suffix,
            seed=req.seed if req.seed is not None else random.randrange(2**31),
            metadata_=req.metadata,
            request=body,
            request_hash=h,
            idempotency_key=idempotency_key,
            plan=plan,
            status="validating_files",
            status_detail=None,
            progress_step=0,
            progress_total=0,
            result_files=[],
            attempt=0,
            max_attempts=req.max_attempts,
            cancel_requested=False,
            created_at=now,
            workers=plan["resources"]["num_workers"],
            gpus=plan["resources"]["num_workers"] if plan["resources"]["use_gpu"] else 0,
        )
        limit = self.settings.limits.max_unfinished_jobs_per_tenant
        try:
            return self.store.jobs.create(job, f"Created fine-tuning job: {job.id}", limit)
        except IdempotencyConflict as e:
            raise self._conflict(e.job, idempotency_key or "") from None
        except TooManyUnfinished as e:
            raise QuotaExceeded(
                f"tenant {tenant} has {e.n} unfinished jobs, its limit "
                f"({Limits.var('max_unfinished_jobs_per_tenant')}={limit}); wait for some to "
                "finish or cancel some",
                code="quota_exceeded",
            ) from None

    def _same(self, existing: Job, h: str, key: str) -> Job:
        if existing.request_hash != h:
            raise self._conflict(existing, key)
        return existing

    @staticmethod
    def _conflict(job: Job, key: str) -> Conflict:
        return Conflict(
            f"Idempotency-Key '{key}' was already used for job {job.id} with a different "
            "request body; send the same body to get that job, or use a new key",
            param="Idempotency-Key",
            code="idempotency_key_reused",
        )

    def get(self, tenant: str, job_id: str) -> Job:
        return _found(self.store.jobs.get(job_id, tenant), job_id)

    def view(self, tenant: str, job_id: str) -> View:
        """What `GET .../jobs/{id}` shows (`store.jobs.view`); 404 for another tenant's."""
        return _found(self.store.jobs.view(job_id, tenant), job_id)

    def cancel(self, tenant: str, job_id: str) -> Job:
        job = self.get(tenant, job_id)
        if not self.store.jobs.update(
            job_id, event="Job cancelled", status="cancelled", cancel_requested=True
        ):
            job = self.get(tenant, job_id)
            raise Conflict(
                f"Job {job_id} has already ended (status '{job.status}') and cannot be cancelled",
                param="fine_tuning_job_id",
                code="job_not_cancellable",
            )
        if job.attempt:
            self.launcher.stop_quietly(f"{job_id}-a{job.attempt}")
        return self.get(tenant, job_id)


def _found(job: _J | None, job_id: str) -> _J:
    if job is None:
        raise NotFound("fine_tuning_job", job_id, param="fine_tuning_job_id")
    return job
