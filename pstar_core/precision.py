"""The compute dtype: `dtype: auto` resolved from what the compute device does natively.

[Note: why not assume bf16] bf16 halves the param chunks and the bytes every move and
collective carries, but only hardware with native bf16 arithmetic computes it fast. On a
CPU without AVX-512 BF16 or AMX (most laptops and many cloud CPUs, `AVX2` in
`torch.backends.cpu.get_cpu_capability()`), a bf16 matmul is emulated and ran ~30x slower
than fp32 (measured: 0.3 against 9.3 GFLOP/s, one thread), so a bf16 default made the main
job 30x slower there. `auto` therefore picks:
- an accelerator with bf16 (CUDA compute capability >= 8, or whatever the device module's
  `is_bf16_supported` says): bf16;
- an accelerator without it (V100, T4): fp16 with dynamic loss scaling;
- a CPU whose ISA flags promise native bf16: bf16 if a few-millisecond matmul probe
  agrees (the flags are not enough: `ATEN_CPU_CAPABILITY` and `ONEDNN_MAX_CPU_ISA` can
  keep torch and oneDNN off the bf16 instructions the CPU has), else fp32;
- any other CPU: fp32, without a probe.
Under ZeRO every rank resolves, and the most conservative answer wins (fp32 over fp16
over bf16), so all ranks lay out the same chunks.

An explicit `bf16` or `fp16` on a CPU that computes it slowly still runs, with one
warning that gives the probe's figures and says what to set.
"""

from __future__ import annotations

import functools
import logging
import platform
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

log = logging.getLogger(__name__)

AUTO = "auto"
# most conservative last: ranks that disagree take the largest code
_CODE = {"bf16": 0, "fp16": 1, "fp32": 2}
_TORCH = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# the probe: one matmul of this shape per dtype, best of a few (about 0.2 ms in fp32 on one
# core, 7 ms where bf16 is emulated)
_PROBE_SHAPE = (128, 256, 256)
_PROBE_REPEATS = 5


@dataclass(frozen=True)
class Precision:
    """What the engine computes in, and why."""

    requested: str  # as configured: auto, fp32, bf16 or fp16
    dtype: str  # fp32, bf16 or fp16
    reason: str
    cpu_capability: str
    native_bf16: bool  # the compute device does bf16 arithmetic natively
    probe_gflops: dict[str, float] = field(default_factory=dict)  # matmul rate per dtype

    @property
    def torch_dtype(self) -> torch.dtype:
        return _TORCH[self.dtype]

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def cpu_capability() -> str:
    """The vector ISA torch's CPU kernels use here (AVX2, AVX512, ...)."""
    return torch.backends.cpu.get_cpu_capability()


def cpu_flags_promise_bf16() -> bool:
    """Whether the CPU's flags (and torch's chosen ISA) promise native bf16 arithmetic.
    False settles it on x86; True still needs the probe."""
    if platform.machine().lower() not in ("x86_64", "amd64", "i686", "x86"):
        return True  # ARM (bf16 in SVE/NEON on newer cores) and others: the probe decides
    if cpu_capability() not in ("AVX512", "AMX"):
        return False
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def _matmul_gflops(dtype: torch.dtype, device: torch.device) -> float:
    m, k, n = _PROBE_SHAPE
    g = torch.Generator().manual_seed(0)
    a = torch.randn(m, k, generator=g).to(device=device, dtype=dtype)
    b = torch.randn(k, n, generator=g).to(device=device, dtype=dtype)
    a @ b  # warm-up: oneDNN builds its kernel at the first call
    best = float("inf")
    for _ in range(_PROBE_REPEATS):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * m * k * n / max(best, 1e-9) / 1e9


@functools.lru_cache(maxsize=8)
def probe_cpu(threads: int, names: tuple[str, ...] = ("fp32", "bf16")) -> dict[str, float]:
    """Matmul GFLOP/s of the dtypes `names` on one CPU thread (cached: the answer does
    not change within a process; `threads` keys the cache only). About 1 ms a dtype where
    it is native, 30 ms where it is emulated.

    One thread: the question is what the ISA does with each dtype, and a team of threads
    on a busy machine waits for its slowest member (seen: fp32 at 1.5 GFLOP/s instead of
    90 with 2 threads while another process held a core), which a single thread does not.
    """
    cpu = torch.device("cpu")
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return {name: round(_matmul_gflops(_TORCH[name], cpu), 2) for name in names}
    finally:
        torch.set_num_threads(saved)


def _accelerator_has_bf16(device: torch.device) -> bool:
    module = getattr(torch, device.type)
    check = getattr(module, "is_bf16_supported", None)
    if check is None:
        return False
    try:
        return bool(check(including_emulation=False))
    except TypeError:  # a device module whose check takes no argument
        return bool(check())


def decide(requested: str, device: torch.device) -> Precision:
    """This process's answer (ranks are reconciled by `resolve`)."""
    capability = cpu_capability()
    if device.type != "cpu":
        native = _accelerator_has_bf16(device)
        if requested != AUTO:
            return Precision(requested, requested, "configured", capability, native)
        if native:
            return Precision(requested, "bf16", f"{device.type} computes bf16", capability, True)
        return Precision(
            requested,
            "fp16",
            f"{device.type} has no bf16: fp16 with loss scaling",
            capability,
            False,
        )
    promise = cpu_flags_promise_bf16()
    if requested == "fp32" or (requested == AUTO and not promise):
        reason = "configured" if requested == "fp32" else f"CPU {capability} has no native bf16"
        return Precision(requested, "fp32", reason, capability, False)
    names = ("fp32", "bf16", "fp16") if requested == "fp16" else ("fp32", "bf16")
    rates = probe_cpu(torch.get_num_threads(), names)
    native = promise and rates["bf16"] >= rates["fp32"]
    if requested != AUTO:
        return Precision(requested, requested, "configured", capability, native, rates)
    if native:
        reason = (
            f"CPU {capability} computes bf16 natively ({rates['bf16']:.0f} GFLOP/s against "
            f"{rates['fp32']:.0f} in fp32)"
        )
        return Precision(requested, "bf16", reason, capability, True, rates)
    reason = (
        f"bf16 is slow on this CPU ({capability}: {rates['bf16']:.1f} GFLOP/s against "
        f"{rates['fp32']:.1f} in fp32)"
    )
    return Precision(requested, "fp32", reason, capability, False, rates)


def resolve(requested: str, device: torch.device, agree: Any = None) -> Precision:
    """The compute dtype of an engine; `agree(code) -> code` takes the maximum over ranks
    (ZeRO), so every rank ends with the same dtype. It is called whatever was requested:
    it is also the engine's first collective (see `Engine.__init__`)."""
    mine = decide(requested, device)
    if agree is not None:
        code = int(agree(_CODE[mine.dtype]))
        if code != _CODE[mine.dtype] and requested != AUTO:
            raise ValueError(
                f"dtype {requested!r} here, another rank was configured differently: every "
                "rank must run the same engine config"
            )
        if code != _CODE[mine.dtype]:
            chosen = next(name for name, c in _CODE.items() if c == code)
            mine = Precision(
                requested,
                chosen,
                f"{chosen}: another rank cannot compute {mine.dtype} fast ({mine.reason} here)",
                mine.cpu_capability,
                mine.native_bf16,
                mine.probe_gflops,
            )
    if device.type == "cpu" and mine.dtype in ("bf16", "fp16") and not _fast_on_cpu(mine):
        rates = mine.probe_gflops
        slower = rates["fp32"] / max(rates[mine.dtype], 1e-9)
        log.warning(
            "dtype %s on this CPU (%s) runs matmuls %.0fx slower than fp32 (%.1f against "
            "%.1f GFLOP/s): set dtype 'auto' (or 'fp32') to train %.0fx faster",
            mine.dtype,
            mine.cpu_capability,
            slower,
            rates[mine.dtype],
            rates["fp32"],
            slower,
        )
    return mine


def _fast_on_cpu(p: Precision) -> bool:
    rates = p.probe_gflops
    if not rates:
        return True
    return rates[p.dtype] >= 0.5 * rates["fp32"]


def planned_dtype(requested: str, accelerator: bool) -> str:
    """The dtype to size a plan with before any worker exists: as given, or for 'auto'
    bf16 on GPUs (fp16 has the same size) and this machine's answer on a CPU (in the
    embedded install the workers run here; on a cluster whose CPU workers differ, the
    engine's own resolution is what runs, reported in its stats)."""
    if requested != AUTO:
        return requested
    if accelerator:
        return "bf16"
    return decide(AUTO, torch.device("cpu")).dtype
