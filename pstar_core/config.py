"""Engine configuration: one tree of small frozen models, the single source of defaults.

`EngineConfig.parse(obj)` accepts a dict, a YAML path, or an `EngineConfig`, and turns every
validation problem into a `ConfigError` whose message names the field, what was given and
what is allowed. The docs quote these classes; nothing else defines a default.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}


class ConfigError(ValueError):
    """A configuration value is wrong; the message says which field and what is allowed."""


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ParamGroupConfig(_Frozen):
    """Overrides for the parameters whose name matches `pattern` (a regex, `re.search`)."""

    pattern: str = Field(description="regex matched against the parameter's name")
    lr: float | None = Field(default=None, gt=0, description="learning rate for this group")
    weight_decay: float | None = Field(default=None, ge=0, description="decoupled weight decay")

    @field_validator("pattern")
    @classmethod
    def _valid_regex(cls, v: str) -> str:
        try:
            re.compile(v)
        except re.error as e:
            raise ValueError(f"not a valid regular expression ({e})") from None
        return v


class OptimizerConfig(_Frozen):
    """AdamW (decoupled weight decay), run chunk by chunk."""

    lr: float = Field(default=1e-3, gt=0, description="peak learning rate")
    betas: tuple[float, float] = Field(
        default=(0.9, 0.999), description="Adam betas, each in [0, 1)"
    )
    eps: float = Field(default=1e-8, gt=0)
    weight_decay: float = Field(default=0.0, ge=0)
    no_decay_1d: bool = Field(
        default=True,
        description="no weight decay for parameters with fewer than 2 dims (biases, norm weights)",
    )
    no_decay_patterns: tuple[str, ...] = Field(
        default=(), description="regexes of parameter names that get no weight decay"
    )
    param_groups: tuple[ParamGroupConfig, ...] = Field(
        default=(), description="per-name overrides; the first matching group wins"
    )

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, v: tuple[float, float]) -> tuple[float, float]:
        for b in v:
            if not 0.0 <= b < 1.0:
                raise ValueError(f"each beta must be in [0, 1), got {list(v)}")
        return v


class SchedulerConfig(_Frozen):
    """Learning-rate schedule applied by `engine.step()` (per optimizer step)."""

    kind: Literal["constant", "linear", "cosine"] = "constant"
    warmup_steps: int = Field(default=0, ge=0)
    total_steps: int | None = Field(
        default=None, gt=0, description="required for linear and cosine decay"
    )
    min_lr_ratio: float = Field(default=0.0, ge=0, le=1)


class LossScaleConfig(_Frozen):
    """Dynamic loss scaling; only used when dtype is fp16."""

    init_scale: float = Field(default=2.0**16, gt=0)
    growth_factor: float = Field(default=2.0, gt=1)
    backoff_factor: float = Field(default=0.5, gt=0, lt=1)
    growth_interval: int = Field(default=1000, gt=0, description="good steps before growing")
    min_scale: float = Field(default=1.0, gt=0)


Budget = int | float | None


class MemoryConfig(_Frozen):
    """Memory tiers and the chunk eviction policy (the paper's DMM).

    Budgets are bytes (an int) or a fraction of the tier (a float in (0, 1]); null means
    the whole tier. On a machine without a GPU the compute device is the CPU, and its
    budget is enforced by the engine the same way a GPU's memory limit would be.
    """

    device_budget: Budget = Field(
        default=None,
        description="bytes or fraction of the compute device for chunks + activations; on a "
        "GPU the whole is `device_safety` x the memory free once the CUDA context and NCCL "
        "are up",
    )
    device_safety: float = Field(
        default=0.9,
        gt=0,
        le=1,
        description="GPU only: share of the free device memory the engine plans with; the "
        "rest absorbs the caching allocator's fragmentation and cuBLAS/NCCL workspaces",
    )
    host_budget: Budget = Field(
        default=None,
        description="bytes or fraction of host memory (default, and the whole a fraction is "
        "of: the memory available when the engine starts, less max(2 GiB, 10%), shared "
        "between the ranks of this host; see `tiers.host_share`)",
    )
    host_reserved: int | None = Field(
        default=None,
        ge=0,
        description="bytes of host memory a scheduler reserved for this rank (Ray's "
        "`memory` per worker): the host whole becomes the least of it (less the same "
        "margin, `tiers.reserved_share`) and the rank's share of what the host has free",
    )
    disk_budget: Budget = Field(
        default=0, description="bytes (or fraction of free space) of spill files; 0 disables"
    )
    disk_dir: Path | None = Field(
        default=None,
        description="directory of the spill file (default $PSTAR_SPILL_DIR or /tmp/pstar-spill); "
        "the file is unlinked as soon as it is open, so nothing is left behind by any exit",
    )
    policy: Literal["opt", "lru", "static"] = Field(
        default="opt", description="eviction: opt (paper), lru, or static partition"
    )
    warmup_ratio: float = Field(
        default=0.2, gt=0, le=1, description="share of the device model data may use in warm-up"
    )
    static_model_share: float = Field(
        default=0.5, gt=0, le=1, description="policy 'static': share of the device for chunks"
    )
    prefetch_chunks: int = Field(
        default=2,
        ge=0,
        description="while an iteration follows the trace, look past prefetch_moments "
        "until this many chunks not yet where they are read are on their way",
    )
    prefetch_evicts: bool = Field(
        default=True,
        description="a chunk prefetched to the device with no room sends chunks needed "
        "later than it to the host ahead (OPT's choice), on the copy stream",
    )
    adam_beside_backward: bool = Field(
        default=True,
        description="in Engine.backward_and_step, Adam on the host updates each chunk "
        "backward is done with while backward goes on (where that is exact: no fp16 "
        "loss scale, no gradient clipping); off: all Adam after backward, as step()",
    )
    keep_host_copies: bool = Field(
        default=True,
        description="a chunk moved to the device keeps its host buffer while the host "
        "budget has room; evicted before anything wrote it, it copies nothing back",
    )
    prefetch_moments: int = Field(
        default=2,
        ge=0,
        description="while an iteration follows the trace, start moving the chunks the "
        "next this-many operators use: spilled ones back to host memory on a reader "
        "thread, and on a GPU host ones to the device on a copy stream; 0 disables",
    )
    audit: bool = Field(
        default=False,
        description="measure non-model memory in every iteration, not only when tracing "
        "(stats()['tracer']['measured_peak_device_bytes']); on the CPU this runs the "
        "profiler every iteration, so it is slow: for tests and investigations",
    )

    @field_validator("device_budget", "host_budget", "disk_budget")
    @classmethod
    def _budget(cls, v: Budget) -> Budget:
        if isinstance(v, float) and not 0.0 < v <= 1.0:
            raise ValueError(f"a fractional budget must be in (0, 1], got {v}")
        if isinstance(v, int) and v < 0:
            raise ValueError(f"a budget in bytes must be >= 0, got {v}")
        return v


class ZeroConfig(_Frozen):
    """Chunk ZeRO-DP across the ranks of the process group (when torch.distributed is up)."""

    variant: Literal["collective", "serial"] = Field(
        default="collective",
        description="collective: all-gather / reduce-scatter per group; serial: nproc "
        "broadcasts / reductions (the paper's memory-saving variant)",
    )
    overlap_reductions: Literal["auto", "on", "off"] = Field(
        default="auto",
        description="issue each group's gradient reduce-scatter asynchronously, so backward "
        "goes on while it runs; 'auto' = on for GPUs (NCCL reduces in place) and off on "
        "CPU (gloo copies the whole group into a temporary while the reduction is in "
        "flight, memory the 2-core overlap does not pay for)",
    )
    gather_ahead: Literal["auto", "on", "off"] = Field(
        default="auto",
        description="while an iteration follows the trace, issue the next group's "
        "all-gather asynchronously while the current operator computes (FSDP2's pattern), "
        "where every rank has room for it without evicting; 'auto' = on for GPUs, off on "
        "CPU (gloo's copies compete with the compute for the same cores)",
    )
    agree_per_collective: bool = Field(
        default=False,
        description="exchange the ranks' failure flag before every collective; by default "
        "a training forward or backward that follows the trace, once its collectives were "
        "agreed on, checks each against them locally and exchanges one flag at its start "
        "and end (a failing rank issues the rest with stand-in buffers)",
    )


LORA_DEFAULT_TARGETS: Literal["all-linear"] = "all-linear"


class LoraConfig(_Frozen):
    """Low-rank adapters (LoRA, written by `peft`): the model's own weights freeze into the
    frozen chunk list (compute dtype only, about 2 bytes per parameter in bf16) and only
    the adapters carry gradients, fp32 masters and Adam state.

    With `adapter_dir` the adapters start from a PEFT adapter directory
    (`adapter_config.json` + `adapter_model.safetensors`); its own r, alpha, dropout and
    target modules then apply, and any of those fields given here must agree with it.
    """

    r: int = Field(default=16, ge=1, le=4096, description="rank of each adapter")
    alpha: float = Field(
        default=32.0, gt=0, description="scaling numerator: the update is (alpha / r) B A x"
    )
    dropout: float = Field(default=0.0, ge=0, lt=1, description="dropout on the adapter input")
    target_modules: tuple[str, ...] | Literal["all-linear"] = Field(
        default=LORA_DEFAULT_TARGETS,
        description="module names (or name suffixes) that get adapters; 'all-linear' = every "
        "linear layer except the output head",
    )
    adapter_dir: Path | None = Field(
        default=None, description="a PEFT adapter directory to continue training from"
    )

    @field_validator("target_modules")
    @classmethod
    def _some_targets(cls, v: tuple[str, ...] | str) -> tuple[str, ...] | str:
        if isinstance(v, tuple) and (not v or any(not t.strip() for t in v)):
            raise ValueError("name at least one module, or use 'all-linear'")
        return v


class EngineConfig(_Frozen):
    """Everything `pstar_core.initialize` needs besides the model."""

    dtype: Literal["auto", "fp32", "bf16", "fp16"] = Field(
        default="auto",
        description="compute dtype of the param chunks (master weights are fp32); 'auto': bf16 "
        "where the compute device does bf16 natively (Ampere+ GPUs, CPUs with AVX-512 BF16 or "
        "AMX), fp16 with loss scaling on GPUs without bf16, fp32 elsewhere "
        "(`pstar_core.precision`)",
    )
    chunk_size: int | Literal["auto"] = Field(
        default="auto", description="elements per chunk, or 'auto' to search for least waste"
    )
    device: str = Field(default="cpu", description="compute device: 'cpu' or 'cuda[:N]'")
    optimizer: OptimizerConfig = OptimizerConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    loss_scale: LossScaleConfig = LossScaleConfig()
    gradient_clipping: float | None = Field(
        default=None, gt=0, description="max global grad norm; null disables clipping"
    )
    activation_checkpointing: bool = Field(
        default=False, description="recompute each block's forward in backward"
    )
    memory: MemoryConfig = MemoryConfig()
    zero: ZeroConfig = ZeroConfig()
    lora: LoraConfig | None = Field(
        default=None,
        description="train low-rank adapters instead of every weight (see LoraConfig); "
        "null trains the whole model",
    )
    exclude_from_chunks: tuple[str, ...] = Field(
        default=(),
        description="regexes of parameter names kept as ordinary tensors outside the chunks",
    )

    @field_validator("chunk_size")
    @classmethod
    def _chunk_size_positive(cls, v: int | str) -> int | str:
        if isinstance(v, int) and v < 1024:
            raise ValueError(f"must be 'auto' or an integer >= 1024 elements, got {v}")
        return v

    @field_validator("device")
    @classmethod
    def _device_known(cls, v: str) -> str:
        if not re.fullmatch(r"cpu|cuda(:\d+)?", v) and not _loaded_backend(v):
            raise ValueError(f"must be 'cpu', 'cuda' or 'cuda:N', got {v!r}")
        return v

    @property
    def torch_dtype(self) -> torch.dtype:
        """The compute dtype; only once 'auto' is resolved (`Engine.config` always is)."""
        if self.dtype not in DTYPES:
            raise ValueError("dtype 'auto' is resolved by the engine (pstar_core.precision)")
        return DTYPES[self.dtype]

    @classmethod
    def parse(cls, obj: EngineConfig | dict[str, Any] | str | Path | None) -> EngineConfig:
        """Build a config from a dict, a YAML file path, or pass one through."""
        if isinstance(obj, EngineConfig):
            return obj
        if obj is None:
            obj = {}
        if isinstance(obj, (str, Path)):
            obj = _load_yaml(Path(obj))
        if not isinstance(obj, dict):
            raise ConfigError(f"engine config must be a mapping, got {type(obj).__name__}")
        try:
            return cls.model_validate(obj)
        except ValidationError as e:
            raise ConfigError(_explain(e)) from None


def _load_yaml(path: Path) -> dict[str, Any]:
    import yaml

    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping at the top level")
    return data


def _explain(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        where = ".".join(str(p) for p in e["loc"]) or "(top level)"
        if e["type"] == "extra_forbidden":
            allowed = ", ".join(_fields_at(e["loc"][:-1]))
            lines.append(f"{where}: unknown field; allowed here: {allowed}")
            continue
        given = e.get("input")
        lines.append(f"{where}: {e['msg']} (got {given!r})")
    return "invalid engine config:\n  " + "\n  ".join(lines)


def missing_unexpected(missing: list[str], unexpected: list[str], most: int) -> str:
    """'missing [...], unexpected [...]' with at most `most` names each, for the errors
    of weights or state that do not match a model."""

    def listed(names: list[str]) -> str:
        return f"{names[:most]}{' ...' if len(names) > most else ''}"

    return f"missing {listed(missing)}, unexpected {listed(unexpected)}"


def _fields_at(loc: tuple[Any, ...]) -> list[str]:
    """Field names of the config model at `loc`, to suggest in an unknown-field error."""
    model: Any = EngineConfig
    for part in loc:
        if isinstance(part, int):
            continue
        ann = model.model_fields[part].annotation
        args = getattr(ann, "__args__", ())
        model = next(
            (a for a in (ann, *args) if isinstance(a, type) and issubclass(a, BaseModel)), None
        )
        if model is None:
            return []
    return sorted(model.model_fields)


def _loaded_backend(spec: str) -> bool:
    """Another torch backend with a device module loaded in this process (the test
    suite's second device, `tests/fakedevice`)."""
    import torch

    m = re.fullmatch(r"([a-z_]+)(:\d+)?", spec)
    if m is None or m.group(1) in ("meta", "cpu", "cuda"):
        return False
    module = getattr(torch, m.group(1), None)
    return bool(getattr(module, "is_available", lambda: False)())
