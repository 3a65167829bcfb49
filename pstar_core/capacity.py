"""Capacity planning for hardware that is not here: will a model fit, where does its model
data sit at start, and what moves each iteration, for N GPUs of a given memory on one
node with a given host memory (and disk). Nothing is allocated: the chunk plan is laid
out from the model's tensor sizes (built on `meta`).

Per rank (one GPU, its ZeRO share of the chunks, 1/N of the host and disk):
- model data per chunk list (param, param fp32, momentum, variance; frozen for a LoRA
  job's base), as `make_plan` lays it out with chunk ZeRO over N ranks;
- placement at start as `startup.enforce_budgets` does it (`lists_at_start`);
- one iteration forecast (`forecast.forecast`): the non-model peak from the activation
  model calibrated on the engine's tracer (`benchmarks/plan_check.py`), the GPU margin for optimizer
  states and how many of them it holds (device-aware placement), the GPU and host peaks,
  the least GPU memory the iteration runs in, and the bytes moved each way; collective
  bytes (all-gathers in forward and backward, a reduce-scatter of the gradients);
- whether it fits, and which tier overflows by how much. Two rules are reported:
  `engine` is this engine as built (its warm-up step updates every chunk on the host, so
  host + disk must hold all of a rank's model data, and the GPU must hold the least an
  iteration runs in); `paper` is the paper's capacity rule (model data fits host memory
  plus what the GPUs have left for chunks after the non-model peak);
- for a plan that does not fit, the smallest change that would (`smallest_change`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

from pstar_core.forecast import Arch, Forecast, Rates, forecast, moments
from pstar_core.mapping import BYTES_PARAM, make_plan
from pstar_core.startup import host_disk_shortfall

GiB = 1 << 30
DEVICE_SAFETY = 0.9  # as MemoryConfig.device_safety: the share of a GPU the engine plans with
WARMUP_RATIO = 0.2  # as MemoryConfig.warmup_ratio


@dataclass(frozen=True)
class Speed:
    """How fast a node's parts work, for the step time a plan forecasts. A GPU's figures
    are its vendor's (dense fp16/bf16 tensor peak, memory bandwidth) with what is usually
    reached of them; each may be overridden (`pstar plan --gpu ... --tflops ...`)."""

    name: str
    peak_tflops: float  # dense fp16/bf16 matmul peak of one GPU
    efficiency: float  # the share of that peak the model's matmuls reach
    link_gbps: float  # host <-> GPU, pinned, each way, reached (not the bus's nominal)
    collective_gbps: float  # one rank's all-gather / reduce-scatter bus bandwidth
    hbm_gbps: float  # the GPU's memory bandwidth (Adam on the GPU is bound by it)
    host_adam_gparams: float  # Adam on the host: the node's rate, shared by its ranks

    def rates(self, gpus: int) -> Rates:
        """One rank's `Rates`. Adam moves about 30 bytes a parameter (fp32 master,
        momentum, variance and gradient read, three written, the fp16 copy)."""
        link = self.link_gbps * 1e9
        return Rates(
            flops_per_s=self.peak_tflops * 1e12 * self.efficiency,
            host_to_device_bytes_per_s=link,
            device_to_host_bytes_per_s=link,
            host_adam_params_per_s=self.host_adam_gparams * 1e9 / gpus,
            device_adam_params_per_s=self.hbm_gbps * 1e9 / ADAM_BYTES_PER_PARAM,
            collective_bytes_per_s=self.collective_gbps * 1e9,
        )


ADAM_BYTES_PER_PARAM = 30
# The stated figures: peak from the vendors' data sheets (SXM parts); the link is PCIe
# 3/4/5 x16 pinned as measured copies reach it (about 75% of nominal); collectives at the
# bus bandwidth NCCL's tests report for NVLink 2/3/4; host Adam for a two-socket node at
# about 4 billion parameters a second (ZeRO-Offload's CPU Adam: ~0.2 s per billion on
# such hosts; `pstar bench adam` measures this machine's).
GPUS: dict[str, Speed] = {
    "v100": Speed("v100", 125, 0.6, 12, 130, 900, 4),
    "a100": Speed("a100", 312, 0.6, 25, 230, 1555, 4),
    "h100": Speed("h100", 989, 0.6, 50, 360, 3350, 4),
}
GPU_MEMORY_GIB = {"v100": 32, "a100": 40, "h100": 80}


@dataclass(frozen=True)
class Hardware:
    gpus: int
    gpu_bytes: int
    host_bytes: int  # the node's, shared by its ranks
    disk_bytes: int = 0
    accelerator: bool = True  # False: CPU budgets standing in for the tiers (as in tests)
    speed: Speed | None = None  # with it, plans forecast their step time


def node(
    gpus: int, gpu_gib: float, host_gib: float, disk_gib: float = 0.0, speed: Speed | None = None
) -> Hardware:
    """A node as its owner states it (its GPUs, RAM and spill disk) as the engine plans
    with it: of the host's memory, what `tiers.host_share` leaves (all less max(2 GiB,
    10%): the pinned pool never locks all of RAM)."""
    from pstar_core.tiers import HOST_MARGIN_BYTES, HOST_MARGIN_SHARE

    host = int(host_gib * GiB)
    host -= max(HOST_MARGIN_BYTES, int(HOST_MARGIN_SHARE * host))
    return Hardware(gpus, int(gpu_gib * GiB), max(0, host), int(disk_gib * GiB), speed=speed)


@dataclass(frozen=True)
class Workload:
    batch: int = 8  # sequences per rank per step
    seq: int | None = None  # tokens per sequence; None: the model's own
    activation_checkpointing: bool = True
    dtype: str = "fp16"
    chunk_size: int | str = "auto"


@dataclass(frozen=True)
class Tensors:
    """A model's parameters as the planner needs them, in init order, and its shape."""

    names: tuple[str, ...]
    numels: tuple[int, ...]
    trainable: tuple[bool, ...]
    arch: Arch
    seq_len: int  # the model's own context


def module_tensors(module: Any, arch: Arch, seq_len: int) -> Tensors:
    """The tensors of a module (on `meta`: a zoo GPT, a transformers model, either wrapped
    by `peft`), each shared parameter once."""
    seen: dict[int, tuple[str, int, bool]] = {}
    for name, p in module.named_parameters():
        seen.setdefault(id(p), (name, p.numel(), p.requires_grad))
    names, numels, trainable = zip(*seen.values(), strict=True)
    gated = any("gate_proj" in n for n in names)
    return Tensors(names, numels, trainable, replace(arch, gated=gated), seq_len)


def arch_of(config: Any) -> Arch:
    """The `Arch` of a zoo `GPTConfig` or a transformers config."""
    hidden = config.hidden_size
    layers = getattr(config, "num_layers", None) or config.num_hidden_layers
    inner = getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None)
    tied = getattr(config, "tie_word_embeddings", True)
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None)
    kv = hidden * kv_heads // heads if heads and kv_heads else None
    return Arch(hidden, layers, config.vocab_size, inner or 4 * hidden, bool(tied), kv_hidden=kv)


_ZOO: dict[tuple[str, Any], Tensors] = {}


def zoo_tensors(model: str, lora: Any = None) -> Tensors:
    """A zoo GPT's tensors (built on `meta` once per process: a second or so for
    gpt-68b); with `lora` (a `LoraConfig`), as `peft` wraps it: the base frozen."""
    key = (model, lora)
    if key not in _ZOO:
        import torch

        from pstar_core.models import GPT, get_config

        cfg = get_config(model)
        with torch.device("meta"):
            module = GPT(cfg)
        if lora is not None:
            from pstar_core.lora import wrap

            module = wrap(module, lora)
        _ZOO[key] = module_tensors(module, arch_of(cfg), cfg.seq_len)
    return _ZOO[key]


def activation_peak_bytes(
    hidden: int,
    layers: int,
    vocab: int,
    batch: int,
    seq: int,
    checkpointing: bool,
    act_bytes: int = 2,
) -> int:
    """The peak non-model bytes of one training iteration of a GPT of this shape: the
    most at any moment of `forecast.moments`, calibrated on the engine's tracer
    (`benchmarks/plan_check.py`: `calibration_error`)."""
    arch = Arch(hidden, layers, vocab, 4 * hidden)
    return max(m.non_model for m in moments([], arch, batch, seq, checkpointing, act_bytes))


@dataclass
class RankPlan:
    model: str
    params: int
    trainable_params: int
    chunk_size: int
    utilization: float
    lists: dict[str, int]  # bytes of the rank's chunks per list
    model_data_bytes: int  # the rank's chunks, all lists
    non_model_peak_bytes: int
    device_bytes: int  # what the engine plans with on one GPU
    host_bytes: int  # the rank's share of the node's host memory
    disk_bytes: int
    at_start: dict[str, dict[str, int]]  # list -> tier -> bytes ("over": no room)
    gpu_margin_bytes: int
    os_chunks_on_gpu: int
    os_chunks: int
    fits: bool  # this engine as built
    fits_paper_rule: bool
    overflow: dict[str, int]  # tier -> bytes missing (empty when it fits)
    why: str
    least_device_bytes: int  # the smallest device memory one iteration runs in
    device_peak_bytes: int  # chunks and non-model data at the busiest moment (forecast)
    host_peak_bytes: int  # chunks on the host at the busiest moment (forecast)
    host_to_device_bytes_per_iter: int
    device_to_host_bytes_per_iter: int
    host_device_bytes_per_iter: int
    collective_bytes_per_iter: int
    # with the node's `Speed` (else 0): one step's time, its compute and Adam alone,
    # and the model TFLOPS a GPU reaches (recompute counted, as the paper does)
    step_seconds: float = 0.0
    compute_seconds: float = 0.0
    tflops_per_gpu: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def plan_capacity(
    model: str, hw: Hardware, work: Workload = Workload(), lora: Any = None
) -> RankPlan:
    """One rank's plan for `model` (a zoo name; with `lora`, its adapters) on `hw`."""
    return plan_tensors(model, zoo_tensors(model, lora), hw, work)


def plan_tensors(label: str, t: Tensors, hw: Hardware, work: Workload) -> RankPlan:
    """One rank's plan for a model's tensors on `hw` (see the module docstring)."""
    n = hw.gpus
    plan = make_plan(t.numels, t.trainable, t.names, work.dtype, work.chunk_size, n)
    p = BYTES_PARAM[work.dtype]
    chunk = plan.chunk_size
    local, frozen = plan.rank_chunks(n)  # a rank owns one chunk of each group
    lists = plan.list_bytes(n)
    model_data = sum(lists.values())
    device = int(hw.gpu_bytes * (DEVICE_SAFETY if hw.accelerator else 1.0))
    rates = hw.speed.rates(n) if hw.speed is not None else None
    f = tensors_forecast(t, device, n, work, chunk, hw.accelerator, rates)
    peak = f.non_model_peak_bytes
    host = hw.host_bytes // n
    disk = hw.disk_bytes // n
    at_start = lists_at_start(lists, host, int(WARMUP_RATIO * device), disk)

    overflow: dict[str, int] = {}
    if short := host_disk_shortfall(model_data, host, disk):
        overflow["host+disk"] = short
    if f.least_device_bytes > device:
        overflow["device"] = f.least_device_bytes - device
    paper_room = hw.host_bytes + n * max(0, device - peak)
    gathered = (local + frozen) * n * chunk * p  # every param chunk passes through each GPU
    reduced = local * n * chunk * p  # the trainable gradients
    return RankPlan(
        model=label,
        params=sum(t.numels),
        trainable_params=sum(x for x, tr in zip(t.numels, t.trainable, strict=True) if tr),
        chunk_size=chunk,
        utilization=plan.utilization,
        lists=lists,
        model_data_bytes=model_data,
        non_model_peak_bytes=peak,
        device_bytes=device,
        host_bytes=host,
        disk_bytes=disk,
        at_start=at_start,
        gpu_margin_bytes=f.margin_bytes,
        os_chunks_on_gpu=f.device_adam_chunks,
        os_chunks=local,
        fits=not overflow,
        fits_paper_rule=model_data * n <= paper_room and peak < device,
        overflow=overflow,
        why=_why(overflow, model_data, host, disk, peak, f.least_device_bytes, device),
        least_device_bytes=f.least_device_bytes,
        device_peak_bytes=f.device_peak_bytes,
        host_peak_bytes=f.host_peak_bytes,
        host_to_device_bytes_per_iter=f.host_to_device_bytes,
        device_to_host_bytes_per_iter=f.device_to_host_bytes,
        host_device_bytes_per_iter=f.host_to_device_bytes + f.device_to_host_bytes,
        # all-gathers in forward and backward, a reduce-scatter of the trainable gradients
        collective_bytes_per_iter=(n - 1) * (2 * gathered + reduced) // n,
        step_seconds=f.step_seconds,
        compute_seconds=f.compute_seconds,
        tflops_per_gpu=f.flops / f.step_seconds / 1e12 if f.step_seconds else 0.0,
    )


def tensors_forecast(
    t: Tensors,
    device_bytes: int,
    nproc: int,
    work: Workload,
    chunk_size: int,
    accelerator: bool = True,
    rates: Rates | None = None,
) -> Forecast:
    """`forecast.forecast` of one rank with `device_bytes` to plan with: the moments of
    the model's activation model, its tensors in chunks of `chunk_size`."""
    import torch

    from pstar_core.kernels import adam_temporary_bytes

    plan = make_plan(t.numels, t.trainable, t.names, work.dtype, chunk_size)
    seq = work.seq or t.seq_len
    act = BYTES_PARAM[work.dtype]
    steps = moments(t.names, t.arch, work.batch, seq, work.activation_checkpointing, act)
    # what Adam allocates on an accelerator beyond what a trace sees (its fp32 gradients)
    temporary = adam_temporary_bytes(chunk_size, torch.device("cuda" if accelerator else "cpu"))
    return forecast(plan, t.trainable, steps, device_bytes, nproc, temporary, rates)


# Where `startup.enforce_budgets` puts a rank's chunks at start, by list: all on the
# host; while the host is over its budget, chunks of the param lists move to the device
# (up to its warm-up share), then chunks spill to disk in this order
TO_DEVICE_FIRST = ("param", "frozen")
TO_DISK_FIRST = ("param", "frozen", "param_fp32", "momentum", "variance")


def lists_at_start(
    list_bytes: dict[str, int], host: int, device_share: int, disk: int
) -> dict[str, dict[str, int]]:
    """Each chunk list's bytes per tier at start (one rank), as `enforce_budgets` places
    them; what no tier holds is `over`."""
    out = {k: {"device": 0, "host": b, "disk": 0, "over": 0} for k, b in list_bytes.items()}
    excess = sum(list_bytes.values()) - host
    for tier, room, order in (
        ("device", device_share, TO_DEVICE_FIRST),
        ("disk", disk, TO_DISK_FIRST),
        ("over", math.inf, TO_DISK_FIRST),
    ):
        left = min(max(0, excess), room)
        excess -= left
        for k in order:
            if k not in out:
                continue
            take = min(out[k]["host"], left)
            out[k]["host"] -= take
            out[k][tier] += int(take)
            left -= take
    return out


def _why(overflow, model_data, host, disk, peak, least, device) -> str:
    if not overflow:
        return "fits"
    parts = []
    if "host+disk" in overflow:
        parts.append(
            f"a rank's model data ({model_data / GiB:.1f} GiB) is more than its host and disk "
            f"share ({(host + disk) / GiB:.1f} GiB): the warm-up step updates every chunk on "
            "the host; give disk (--disk) or more host memory"
        )
    if "device" in overflow:
        parts.append(
            f"an iteration needs at least {least / GiB:.1f} GiB on the GPU (the non-model "
            f"peak is {peak / GiB:.1f} GiB, with the chunks its operators use), more than "
            f"the {device / GiB:.1f} GiB planned with: a smaller batch or activation "
            "checkpointing"
        )
    return "; ".join(parts)


@dataclass(frozen=True)
class Options:
    """The knobs `smallest_change` may turn."""

    workers: int
    batch: int
    checkpointing: bool
    lora: bool


def smallest_change(
    plan_for: Callable[[Options], RankPlan],
    now: Options,
    max_workers: int | None = None,
) -> dict[str, Any] | None:
    """For a plan that does not fit, the smallest single change that makes it fit, and
    every one that does, in this order of preference: activation checkpointing (the
    model and batch unchanged, about a third more compute), a smaller batch (the largest
    that fits), more workers (the fewest that fit, up to `max_workers` when the cluster
    says), LoRA (trains adapters instead of every weight). None if none fits."""
    tried: list[tuple[str, Any, Options]] = []
    if not now.checkpointing:
        tried.append(("activation_checkpointing", True, replace(now, checkpointing=True)))
    batch = now.batch // 2
    while batch >= 1:
        tried.append(("batch", batch, replace(now, batch=batch)))
        batch //= 2
    workers = now.workers * 2
    while workers <= (max_workers or 64):
        tried.append(("workers", workers, replace(now, workers=workers)))
        workers *= 2
    if not now.lora:
        tried.append(("lora", True, replace(now, lora=True)))
    fits: list[dict[str, Any]] = []
    for knob, value, options in tried:
        if any(f["change"] == knob for f in fits):
            continue  # the first that fits is the smallest change of this knob
        plan = plan_for(options)
        if plan.fits:
            fits.append({"change": knob, "value": value, "text": _change_text(knob, value)})
    if not fits:
        return None
    return {**fits[0], "alternatives": fits[1:]}


def _change_text(knob: str, value: Any) -> str:
    return {
        "activation_checkpointing": "turn on activation checkpointing",
        "batch": f"a batch of {value} per step",
        "workers": f"{value} workers",
        "lora": "train LoRA adapters instead of every weight",
    }[knob]


PAPER_FAMILY = (
    "gpt-1b", "gpt-2b", "gpt-4b", "gpt-6b", "gpt-8b", "gpt-10b", "gpt-12b", "gpt-15b",
    "gpt-18b", "gpt-20b", "gpt-30b", "gpt-40b", "gpt-50b", "gpt-60b", "gpt-68b",
)  # fmt: skip


def largest(
    hw: Hardware,
    work: Workload = Workload(),
    rule: str = "engine",
    lora: Any = None,
    min_tflops: float | None = None,
) -> dict[str, Any]:
    """The largest model of the paper's family that fits `hw` (by `rule`: "engine" or
    "paper") and, with `min_tflops` (and `hw.speed`), whose forecast step reaches that
    many model TFLOPS per GPU; and why the next one does not. Models are tried up to the
    first that does not fit: a smaller one may miss the bar where a larger one meets it
    (device-aware placement favors some shapes)."""
    if min_tflops is not None and hw.speed is None:
        raise ValueError("a TFLOPS bar needs the node's speed (Hardware.speed)")
    best: RankPlan | None = None
    nxt: tuple[RankPlan, str] | None = None
    for name in PAPER_FAMILY:
        plan = plan_capacity(name, hw, work, lora)
        fits = plan.fits if rule == "engine" else plan.fits_paper_rule
        fast = min_tflops is None or plan.tflops_per_gpu >= min_tflops
        if fits and fast:
            best, nxt = plan, None
            continue
        why = plan.why if not fits else (
            f"its step is forecast at {plan.step_seconds:.1f} s, "
            f"{plan.tflops_per_gpu:.0f} TFLOPS per GPU, under the bar of {min_tflops:g}"
        )  # fmt: skip
        if nxt is None:
            nxt = (plan, why)
        if not fits:
            break
    return {
        "largest_model": best.model if best else None,
        "params": best.params if best else 0,
        "rule": rule,
        "min_tflops": min_tflops,
        "next_model": nxt[0].model if nxt else None,
        "next_why": nxt[1] if nxt else None,
        "plan": best.to_json() if best else None,
    }
