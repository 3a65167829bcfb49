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

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

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


@dataclass(frozen=True)
class Workload:
    batch: int = 8  # sequences per rank per step
    seq: int | None = None  # tokens per sequence; None: the model's own
    activation_checkpointing: bool = True
    dtype: str = "fp16"


def activation_peak_bytes(
    hidden: int,
    layers: int,
    heads: int,
    vocab: int,
    batch: int,
    seq: int,
    checkpointing: bool,
    act_bytes: int = 2,
) -> int:
    """The peak non-model bytes of one training iteration of a GPT of this shape.

    Activations: a block keeps ~34·b·s·h + 5·b·a·s² bytes in 16 bits for its backward
    (Korthikanti et al., 2022, without sequence parallelism); with activation checkpointing
    only each block's input (2·b·s·h bytes) is kept and one block at a time is recomputed;
    the logits and their gradient add b·s·V in 16 bits plus fp32 for the loss. The
    embedding (tied to the output layer) adds one V·h gradient buffer on top of them, and
    sets a floor of three V·h buffers when the activations are small: calibrated on the
    engine's tracer (`CALIBRATION`, `calibration_error`)."""
    block = 34 * batch * seq * hidden + 5 * batch * heads * seq * seq
    block = block * act_bytes // 2
    kept = layers * batch * seq * hidden * act_bytes + block if checkpointing else layers * block
    logits = batch * seq * vocab * (act_bytes + 4)
    embedding = vocab * hidden * act_bytes
    return int(max(3 * embedding, kept + logits + embedding))


CALIBRATION = Path(__file__).with_name("data") / "activation_calibration.json"


def calibration_error(min_params: int = 1_000_000) -> dict[str, float]:
    """How far `activation_peak_bytes` is from the shipped tracer measurements: the largest
    and the median of |predicted / measured - 1|, over the models of at least `min_params`
    parameters (the tiny presets' peaks are dominated by what no formula of the shape
    sees)."""
    from statistics import median

    from pstar_core.models import get_config, num_params

    errors = []
    for r in json.loads(CALIBRATION.read_text())["rows"]:
        cfg = get_config(r["model"])
        if num_params(cfg) < min_params:
            continue
        got = activation_peak_bytes(
            cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.vocab_size, r["batch"],
            r["seq"], r["ckpt"], 4,
        )  # fmt: skip
        errors.append(abs(got / r["measured"] - 1))
    return {"max": max(errors), "median": median(errors), "points": len(errors)}


def measure_peak(model: str, batch: int, seq: int, checkpointing: bool) -> int:
    """The tracer's peak non-model bytes of one fp32 step of a zoo GPT on this engine."""
    import torch

    import pstar_core
    from pstar_core.models import GPT, get_config

    cfg = get_config(model)

    def build():
        m = GPT(cfg)
        if checkpointing:
            m.gradient_checkpointing_enable()
        return m

    config = {"dtype": "fp32", "chunk_size": "auto", "optimizer": {"lr": 1e-4}}
    engine = pstar_core.initialize(build, config)
    x = torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    engine.backward(engine(input_ids=x, labels=x).loss)
    engine.step()
    return int(engine.stats()["tracer"]["peak_non_model_bytes"])


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
    host_device_bytes_per_iter: int
    collective_bytes_per_iter: int

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def plan_capacity(model: str, hw: Hardware, work: Workload = Workload()) -> RankPlan:
    """One rank's plan for `model` (a zoo name) on `hw` (see the module docstring)."""
    shapes, cfg = _shapes(model)
    seq = work.seq or cfg.seq_len
    numels = [math.prod(s) for _, s in shapes]
    names = [n for n, _ in shapes]
    plan = make_plan(numels, [True] * len(numels), names, work.dtype, "auto", hw.gpus)
    n = hw.gpus
    p = BYTES_PARAM[work.dtype]
    chunk = plan.chunk_size
    groups = -(-plan.trainable.num_chunks // n)  # communication groups of each list
    local = groups  # every rank owns one chunk of each group (the last padded)
    lists = {
        "param": local * chunk * p,
        "param_fp32": local * chunk * 4,
        "momentum": local * chunk * 4,
        "variance": local * chunk * 4,
    }
    model_data = sum(lists.values())
    peak = activation_peak_bytes(
        cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.vocab_size, work.batch, seq,
        work.activation_checkpointing, p,
    )  # fmt: skip
    device = int(hw.gpu_bytes * DEVICE_SAFETY)
    host = hw.host_bytes // n
    disk = hw.disk_bytes // n
    at_start = _at_start(lists, host, int(WARMUP_RATIO * device), disk)

    full_fp16 = groups * n * chunk * p  # every param fp16 chunk passes through each GPU
    group_fp16 = n * chunk * p  # one gathered group: what an operator needs at least
    margin = device - peak - full_fp16
    os_chunk = chunk * 12
    os_on_gpu = max(0, min(local, margin // os_chunk)) if margin > 0 else 0

    overflow: dict[str, int] = {}
    if model_data > host + disk:
        overflow["host+disk"] = model_data - host - disk
    if peak + group_fp16 > device:
        overflow["device"] = peak + group_fp16 - device
    fits = not overflow
    paper_room = hw.host_bytes + n * max(0, device - peak)
    fits_paper = model_data * n <= paper_room and peak < device
    why = _why(overflow, model_data, host, disk, peak, group_fp16, device)

    resident = max(0, device - peak)  # what param fp16 chunks may keep on the device
    moved_fp16 = 0 if full_fp16 <= resident else 4 * (full_fp16 - resident)
    host_adam = (local - os_on_gpu) * chunk * p * 2  # grads out, updated params back in
    collective = 0 if n == 1 else 3 * (n - 1) * full_fp16 // n
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
        gpu_margin_bytes=margin,
        os_chunks_on_gpu=int(os_on_gpu),
        os_chunks=local,
        fits=fits,
        fits_paper_rule=fits_paper,
        overflow=overflow,
        why=why,
        host_device_bytes_per_iter=moved_fp16 + host_adam,
        collective_bytes_per_iter=collective,
    )


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


def _why(overflow, model_data, host, disk, peak, group, device) -> str:
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
            f"the non-model peak ({peak / GiB:.1f} GiB) and one gathered group of param fp16 "
            f"chunks ({group / GiB:.1f} GiB) exceed the GPU ({device / GiB:.1f} GiB planned "
            "with): a smaller batch or activation checkpointing"
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


GRID = [  # (model, checkpointing, batch, seq) of the shipped calibration
    (m, c, b, s)
    for m, seqs in (("gpt-tiny", (32, 64)), ("gpt-small", (32, 128)), ("gpt-45m", (32, 128)))
    for c in (False, True)
    for b in (2, 8)
    for s in seqs
]


def calibrate() -> dict[str, float]:
    """Measure every point of `GRID` on this machine, rewrite `CALIBRATION`, and return
    the fit's error on the new data (`pstar calibrate-activations`)."""
    import platform

    import torch

    rows = []
    for model, ckpt, batch, seq in GRID:
        peak = measure_peak(model, batch, seq, ckpt)
        rows.append({"model": model, "ckpt": ckpt, "batch": batch, "seq": seq, "measured": peak})
    doc = json.loads(CALIBRATION.read_text())
    doc["measured_on"] = (
        f"{platform.machine()}, torch {torch.__version__}, "
        f"{torch.backends.cpu.get_cpu_capability()}"
    )
    doc["rows"] = rows
    CALIBRATION.write_text(json.dumps(doc, indent=1) + "\n")
    return calibration_error()
