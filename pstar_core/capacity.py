"""Capacity planning for hardware that is not here: will a model fit, where does its model
data sit at start, and what moves each iteration, for N GPUs of a given memory on one
node with a given host memory (and disk). Nothing is allocated: the chunk plan is laid
out from the model's tensor sizes (the zoo's configs are built on `meta`).

Per rank (one GPU, its ZeRO share of the chunks, 1/N of the host and disk):
- model data per chunk list (param fp16, param fp32, momentum, variance), as `make_plan`
  lays it out with chunk ZeRO over N ranks;
- the non-model peak of one iteration, from an activation model of a GPT block
  calibrated on the engine's tracer (`activation_peak_bytes`; the measurements ship in
  `data/activation_calibration.json`, `calibration_error` states the fit);
- placement at start as `initialize` does it: host first, then the device up to its
  warm-up share (param lists only), then disk;
- whether it fits, and which tier overflows by how much. Two rules are reported:
  `engine` is this engine as built (its warm-up step updates every chunk on the host, so
  host + disk must hold all of a rank's model data, and the device must hold the peak
  non-model data plus one gathered group of param fp16 chunks); `paper` is the paper's
  capacity rule (model data fits host memory plus what the GPUs have left for chunks
  after the non-model peak);
- the GPU margin for optimizer states (device-aware placement): device memory minus the
  peak non-model data minus the param fp16 list, and how many of the rank's optimizer-
  state chunks it holds;
- expected bytes per iteration: host<->device (param fp16 chunks that do not stay on the
  device, the grads and updated params of chunks whose Adam runs on the host) and
  collective (all-gathers in forward and backward, a reduce-scatter of the grads).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from pstar_core.forecast import Forecast, forecast, moments
from pstar_core.mapping import BYTES_PARAM, make_plan

GiB = 1 << 30
DEVICE_SAFETY = 0.9  # as MemoryConfig.device_safety: the share of a GPU the engine plans with
WARMUP_RATIO = 0.2  # as MemoryConfig.warmup_ratio


@dataclass(frozen=True)
class Hardware:
    gpus: int
    gpu_bytes: int
    host_bytes: int  # the node's, shared by its ranks
    disk_bytes: int = 0
    accelerator: bool = True  # False: CPU budgets standing in for the tiers (as in tests)


@dataclass(frozen=True)
class Workload:
    batch: int = 8  # sequences per rank per step
    seq: int | None = None  # tokens per sequence; None: the model's own
    activation_checkpointing: bool = True
    dtype: str = "fp16"
    chunk_size: int | str = "auto"


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
    most at any moment of `forecast.moments` (activations kept block by block, the
    logits at the output layer, the tied embedding's gradient in backward and three
    embedding-sized buffers at its own backward), calibrated on the engine's tracer
    (`CALIBRATION`, `calibration_error`)."""
    steps = moments([], hidden, layers, vocab, batch, seq, checkpointing, act_bytes)
    return max(m.non_model for m in steps)


@dataclass
class RankPlan:
    model: str
    params: int
    chunk_size: int
    utilization: float
    lists: dict[str, int]  # bytes of the rank's chunks per list
    model_data_bytes: int  # the rank's chunks, all lists
    non_model_peak_bytes: int
    device_bytes: int  # what the engine plans with on one GPU
    host_bytes: int  # the rank's share of the node's host memory
    disk_bytes: int
    at_start: dict[str, dict[str, int]]  # list -> tier -> bytes
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

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def plan_capacity(model: str, hw: Hardware, work: Workload = Workload()) -> RankPlan:
    """One rank's plan for `model` (a zoo name) on `hw` (see the module docstring)."""
    shapes, _ = _shapes(model)
    numels = [math.prod(s) for _, s in shapes]
    names = [n for n, _ in shapes]
    n = hw.gpus
    plan = make_plan(numels, [True] * len(numels), names, work.dtype, work.chunk_size, n)
    p = BYTES_PARAM[work.dtype]
    chunk = plan.chunk_size
    local = -(-plan.trainable.num_chunks // n)  # a rank owns one chunk of each group
    lists = {
        "param": local * chunk * p,
        "param_fp32": local * chunk * 4,
        "momentum": local * chunk * 4,
        "variance": local * chunk * 4,
    }
    model_data = sum(lists.values())
    device = int(hw.gpu_bytes * (DEVICE_SAFETY if hw.accelerator else 1.0))
    f = rank_forecast(model, device, n, work, chunk, hw.accelerator)
    peak = f.non_model_peak_bytes
    host = hw.host_bytes // n
    disk = hw.disk_bytes // n
    at_start = _at_start(lists, host, int(WARMUP_RATIO * device), disk)

    overflow: dict[str, int] = {}
    if model_data > host + disk:
        overflow["host+disk"] = model_data - host - disk
    if f.least_device_bytes > device:
        overflow["device"] = f.least_device_bytes - device
    fits = not overflow
    paper_room = hw.host_bytes + n * max(0, device - peak)
    fits_paper = model_data * n <= paper_room and peak < device
    why = _why(overflow, model_data, host, disk, peak, f.least_device_bytes, device)
    full = local * n * chunk * p  # every param chunk passes through each GPU
    return RankPlan(
        model=model,
        params=sum(numels),
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
        fits=fits,
        fits_paper_rule=fits_paper,
        overflow=overflow,
        why=why,
        least_device_bytes=f.least_device_bytes,
        device_peak_bytes=f.device_peak_bytes,
        host_peak_bytes=f.host_peak_bytes,
        host_to_device_bytes_per_iter=f.host_to_device_bytes,
        device_to_host_bytes_per_iter=f.device_to_host_bytes,
        host_device_bytes_per_iter=f.host_to_device_bytes + f.device_to_host_bytes,
        # all-gathers in forward and backward, a reduce-scatter of the gradients
        collective_bytes_per_iter=0 if n == 1 else 3 * (n - 1) * full // n,
    )


def rank_forecast(
    model: str,
    device_bytes: int,
    nproc: int,
    work: Workload,
    chunk_size: int,
    accelerator: bool = True,
) -> Forecast:
    """`forecast.forecast` of one rank of `model` (a zoo name) with `device_bytes` to plan
    with: the moments of its activation model, its tensors in chunks of `chunk_size`."""
    shapes, cfg = _shapes(model)
    p = BYTES_PARAM[work.dtype]
    steps = moments(
        [n for n, _ in shapes], cfg.hidden_size, cfg.num_layers, cfg.vocab_size, work.batch,
        work.seq or cfg.seq_len, work.activation_checkpointing, p,
    )  # fmt: skip
    # on an accelerator the fused Adam's fp32 gradients of one chunk (kernels.adam)
    temporary = 4 * chunk_size + 4096 if accelerator else 0
    numels = [math.prod(s) for _, s in shapes]
    return forecast(numels, steps, chunk_size, p, device_bytes, nproc, temporary)


_SHAPES: dict[str, tuple[list[tuple[str, tuple[int, ...]]], Any]] = {}


def _shapes(model: str):
    """(name, shape) of every parameter of a zoo model in init order, built on `meta`
    once per process (a second or so for gpt-68b), and its config."""
    if model not in _SHAPES:
        import torch

        from pstar_core.models import GPT, get_config

        cfg = get_config(model)
        with torch.device("meta"):
            m = GPT(cfg)
        seen: dict[int, tuple[str, tuple[int, ...]]] = {}
        for name, prm in m.named_parameters():
            seen.setdefault(id(prm), (name, tuple(prm.shape)))
        _SHAPES[model] = (list(seen.values()), cfg)
    return _SHAPES[model]


def _at_start(lists: dict[str, int], host: int, warmup_device: int, disk: int):
    """Each list's bytes per tier at start: host first, then the device up to its warm-up
    share (param lists only), then disk; what is left is counted as `over`."""
    room = {"host": host, "device": warmup_device, "disk": disk}
    out: dict[str, dict[str, int]] = {}
    for name, size in lists.items():
        left, row = size, {}
        for tier in ("host", "device", "disk"):
            if tier == "device" and name not in ("param", "param_fp32"):
                continue
            take = min(left, room[tier])
            if take:
                row[tier] = take
                room[tier] -= take
                left -= take
        if left:
            row["over"] = left
        out[name] = row
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


PAPER_FAMILY = (
    "gpt-1b", "gpt-2b", "gpt-4b", "gpt-6b", "gpt-8b", "gpt-10b", "gpt-12b", "gpt-15b",
    "gpt-18b", "gpt-20b", "gpt-30b", "gpt-40b", "gpt-50b", "gpt-60b", "gpt-68b",
)  # fmt: skip


def largest(hw: Hardware, work: Workload = Workload(), rule: str = "engine") -> dict[str, Any]:
    """The largest model of the paper's family that fits `hw` (by `rule`: "engine" or
    "paper"), and why the next one does not."""
    best, nxt = None, None
    for name in PAPER_FAMILY:
        plan = plan_capacity(name, hw, work)
        ok = plan.fits if rule == "engine" else plan.fits_paper_rule
        if ok:
            best = plan
        else:
            nxt = plan
            break
    return {
        "largest_model": best.model if best else None,
        "params": best.params if best else 0,
        "rule": rule,
        "next_model": nxt.model if nxt else None,
        "next_why": nxt.why if nxt else None,
        "plan": best.to_json() if best else None,
    }
