"""Chunk AdamW kernel: the fused optimizer step over the segments of a flat chunk.

Owns ``adamw_`` (one memory pass of torch.optim.AdamW math over every listed segment of a
chunk: bf16/fp16/fp32 grads in, fp32 master/exp_avg/exp_avg_sq updated in place, the new
master cast into ``param_out``), ``grad_sq_norm`` (fp64 sum of squares over the segments,
for global-norm clipping and overflow detection), the lazy JIT build of the C++ extension
(``adam.cpp``) and the pure-torch fallback used when the build is impossible, when tensors
are not on the CPU, or when ``PSTAR_ADAM_BACKEND=torch``.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import platform
import sys
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import NamedTuple

import torch

logger = logging.getLogger(__name__)

__all__ = [
    "AdamSegment",
    "adam_temporary_bytes",
    "adamw_",
    "grad_sq_norm",
    "grad_sq_norm_device",
    "kernel_backend",
]

_SOURCE_PATH = Path(__file__).with_name("adam.cpp")
# -ffp-contract=off: the fp16 rounding trick in adam.cpp needs its addition unfused, and
# keeping torch's per-op rounding makes us track torch.optim.AdamW more closely.
# -fno-math-errno: otherwise sqrt keeps a libm call for negative inputs and nothing vectorizes.
# -march=native is safe because the cache key includes the CPU's feature flags.
_CFLAGS = [
    "-O3",
    "-march=native",
    "-mprefer-vector-width=512",
    "-fno-math-errno",
    "-ffp-contract=off",
    "-fopenmp",
]
_LDFLAGS = ["-fopenmp"]
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class AdamSegment(NamedTuple):
    """A tensor's region of a chunk and the optimizer state that applies to it.

    ``step`` is the already-incremented step count of that tensor.
    """

    offset: int
    numel: int
    step: int
    lr: float
    weight_decay: float


# ---------------------------------------------------------------------------------------
# Extension build / backend selection
# ---------------------------------------------------------------------------------------

_ext_lock = threading.Lock()
_ext_module: ModuleType | None = None
_ext_failed = False


def _ext_root() -> Path:
    env = os.environ.get("PSTAR_EXT_DIR")
    return Path(env) if env else Path.home() / ".cache" / "pstar" / "ext"


def _cpu_signature() -> str:
    """CPU feature flags: a -march=native binary must not be reused on a different CPU."""
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8") as fh:
        for line in fh:
            if line.startswith(("flags", "Features")):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _ext_name(source: str) -> str:
    key = "\n".join(
        [
            source,
            " ".join(_CFLAGS + _LDFLAGS),
            torch.__version__,
            sys.version,
            _cpu_signature(),
        ]
    )
    return "pstar_adam_" + hashlib.sha256(key.encode()).hexdigest()[:16]


@contextlib.contextmanager
def _build_lock(path: Path) -> Iterator[None]:
    """Inter-process lock held across the whole build + import.

    torch.utils.cpp_extension's own FileBaton (``<build_dir>/lock``) already serializes
    concurrent builders, but it is an O_EXCL file: a builder killed mid-compile leaves it
    behind and every later process waits on it forever. An flock dies with its process, so
    under it any leftover baton is known to be stale and can be removed.
    """
    with open(path, "a+b") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _load_ext() -> ModuleType | None:
    global _ext_module, _ext_failed
    if _ext_module is not None or _ext_failed:
        return _ext_module
    with _ext_lock:
        if _ext_module is not None or _ext_failed:
            return _ext_module
        try:
            from torch.utils import cpp_extension

            source = _SOURCE_PATH.read_text(encoding="utf-8")
            name = _ext_name(source)
            # One directory per extension version: load_inline writes main.cpp and the
            # baton file at fixed names inside build_directory, so versions must not share.
            build_dir = _ext_root() / name
            build_dir.mkdir(parents=True, exist_ok=True)
            with _build_lock(_ext_root() / f"{name}.flock"):
                (build_dir / "lock").unlink(missing_ok=True)
                _ext_module = cpp_extension.load_inline(
                    name=name,
                    cpp_sources=[source],
                    extra_cflags=list(_CFLAGS),
                    extra_ldflags=list(_LDFLAGS),
                    build_directory=str(build_dir),
                    verbose=False,
                    no_implicit_headers=True,
                )
        except Exception as exc:  # any build problem means: use the fallback
            _ext_failed = True
            logger.debug("pstar AdamW C++ kernel build failed", exc_info=True)
            logger.warning(
                "pstar AdamW C++ kernel unavailable (%s: %s); using the slower torch fallback",
                type(exc).__name__,
                str(exc).strip().splitlines()[-1] if str(exc).strip() else "",
            )
    return _ext_module


def _requested_backend() -> str:
    choice = os.environ.get("PSTAR_ADAM_BACKEND", "auto").strip().lower()
    if choice not in ("auto", "cpp", "torch", "fused"):
        raise ValueError(f"PSTAR_ADAM_BACKEND must be auto, cpp, torch or fused, got {choice!r}")
    return choice


def kernel_backend() -> str:
    """Where CPU calls go: ``"cpp"`` (the compiled kernel, built lazily), ``"torch"`` (the
    reference in torch ops) or ``"fused"`` (torch's fused AdamW, as on a GPU; for tests).
    Tensors on a device always take the fused path."""
    choice = _requested_backend()
    if choice in ("torch", "fused"):
        return choice
    if _load_ext() is None:
        if choice == "cpp":
            raise RuntimeError("PSTAR_ADAM_BACKEND=cpp but the C++ kernel failed to build")
        return "torch"
    return "cpp"


# ---------------------------------------------------------------------------------------
# Argument checks
# ---------------------------------------------------------------------------------------


def _byte_range(t: torch.Tensor) -> tuple[int, int]:
    start = t.data_ptr()
    return start, start + t.numel() * t.element_size()


def _check_buffers(
    master: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    grad: torch.Tensor,
    param_out: torch.Tensor,
) -> bool:
    """Validate the five buffers; return whether grad and param_out are the same memory."""
    n = master.numel()
    named = {
        "master": master,
        "exp_avg": exp_avg,
        "exp_avg_sq": exp_avg_sq,
        "grad": grad,
        "param_out": param_out,
    }
    for name, t in named.items():
        if t.dim() != 1 or not t.is_contiguous() or t.numel() != n:
            raise ValueError(f"{name} must be 1-D contiguous with {n} elements")
        if t.device != master.device:
            raise ValueError(f"{name} is on {t.device}, master on {master.device}")
    for name in ("master", "exp_avg", "exp_avg_sq"):
        if named[name].dtype != torch.float32:
            raise ValueError(f"{name} must be float32, got {named[name].dtype}")
    for name in ("grad", "param_out"):
        if named[name].dtype not in _FLOAT_DTYPES:
            raise ValueError(f"{name} must be float32/bfloat16/float16, got {named[name].dtype}")
    aliased = grad.data_ptr() == param_out.data_ptr()
    if aliased and grad.dtype != param_out.dtype:
        raise ValueError("grad and param_out alias but have different dtypes")
    # The kernel assumes no other overlap (restrict pointers); catch it here, not as garbage.
    items = list(named.items())
    for i, (name_a, a) in enumerate(items):
        lo_a, hi_a = _byte_range(a)
        for name_b, b in items[i + 1 :]:
            if {name_a, name_b} == {"grad", "param_out"} and aliased:
                continue
            lo_b, hi_b = _byte_range(b)
            if lo_a < hi_b and lo_b < hi_a and n > 0:
                raise ValueError(f"{name_a} and {name_b} overlap in memory")
    return aliased


def _validated_segments(
    segments: Sequence[AdamSegment], numel: int, *, check_step: bool = True
) -> list[AdamSegment]:
    """Segments as AdamSegment tuples, empty ones dropped; raise on out-of-range/overlap."""
    segs = [s if type(s) is AdamSegment else AdamSegment(*s) for s in segments]
    prev_end = 0
    for s in sorted(segs):  # by offset
        if s.offset < 0 or s.numel < 0 or s.offset + s.numel > numel:
            raise ValueError(f"segment ({s.offset}, {s.numel}) outside a chunk of {numel} elements")
        if s.numel == 0:
            continue
        if s.offset < prev_end:
            raise ValueError(f"segment at offset {s.offset} overlaps the previous one")
        if check_step and s.step < 1:
            raise ValueError(f"segment at offset {s.offset} has step {s.step}; must be >= 1")
        prev_end = s.offset + s.numel
    return [s for s in segs if s.numel > 0]


def _seg_constants(s: AdamSegment, beta1: float, beta2: float) -> tuple[float, float, float]:
    """(decay, step_size, bc2_sqrt) computed in double exactly as torch.optim.AdamW does.

    adam.cpp computes the same constants with the same C pow(), so both backends agree.
    """
    bias_correction1 = 1 - beta1**s.step
    bias_correction2 = 1 - beta2**s.step
    return 1 - s.lr * s.weight_decay, s.lr / bias_correction1, bias_correction2**0.5


# ---------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------


def adamw_(
    master: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    grad: torch.Tensor,
    param_out: torch.Tensor,
    segments: Sequence[AdamSegment],
    *,
    beta1: float,
    beta2: float,
    eps: float,
    grad_scale: float = 1.0,
) -> None:
    """One AdamW step (torch.optim.AdamW math, fp32) over ``segments`` of a chunk.

    ``master``/``exp_avg``/``exp_avg_sq`` (fp32) are updated in place; ``param_out``
    receives the new master cast to its dtype (round-to-nearest-even). The gradient used is
    ``grad[i] * grad_scale`` in fp32. ``grad`` and ``param_out`` may be the same tensor.
    Elements outside the segments are neither read nor written.
    """
    _check_buffers(master, exp_avg, exp_avg_sq, grad, param_out)
    segments = _validated_segments(segments, master.numel())
    if not segments:
        return
    if master.device.type == "cpu" and kernel_backend() == "cpp":
        ext = _load_ext()
        assert ext is not None  # kernel_backend() said cpp
        ext.adamw(
            master,
            exp_avg,
            exp_avg_sq,
            grad,
            param_out,
            segments,
            float(beta1),
            float(beta2),
            float(eps),
            float(grad_scale),
        )
        return
    if master.device.type != "cpu" or kernel_backend() == "fused":
        _adamw_fused(
            master, exp_avg, exp_avg_sq, grad, param_out, segments, beta1, beta2, eps, grad_scale
        )
        return
    _adamw_torch(
        master, exp_avg, exp_avg_sq, grad, param_out, segments, beta1, beta2, eps, grad_scale
    )


def adam_temporary_bytes(capacity: int) -> int:
    """The most device memory one `adamw_` call allocates on a chunk of `capacity`
    elements: the fp32 gradients of its segments (fused path), plus the steps."""
    return 4 * capacity + 4096


def _adamw_fused(
    master: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    grad: torch.Tensor,
    param_out: torch.Tensor,
    segments: Sequence[AdamSegment],
    beta1: float,
    beta2: float,
    eps: float,
    grad_scale: float,
) -> None:
    """torch's fused AdamW (`torch._fused_adamw_`, one kernel over many tensors) on the
    segments, one launch per (lr, weight decay); the GPU path.

    The gradients are read once into one fp32 buffer spanning the segments and scaled in
    place (the kernel takes fp32 grads for fp32 masters); that buffer, at most 4 bytes per
    chunk element (`adam_temporary_bytes`), is the only temporary. Step counts go to the
    device in one copy. The new masters are cast into `param_out` by one `_foreach_copy_`.
    No host synchronisation.
    """
    lo = min(s.offset for s in segments)
    hi = max(s.offset + s.numel for s in segments)
    g32 = grad[lo:hi].to(torch.float32, copy=True)  # a copy: grad may alias param_out
    if grad_scale != 1.0:
        g32.mul_(grad_scale)
    steps = torch.tensor([float(s.step) for s in segments], dtype=torch.float32)
    steps = steps.to(master.device, non_blocking=True)
    groups: dict[tuple[float, float], list[int]] = {}
    for i, s in enumerate(segments):
        groups.setdefault((s.lr, s.weight_decay), []).append(i)
    for (lr, wd), members in groups.items():
        segs = [segments[i] for i in members]
        torch._fused_adamw_(
            [master[s.offset : s.offset + s.numel] for s in segs],
            [g32[s.offset - lo : s.offset - lo + s.numel] for s in segs],
            [exp_avg[s.offset : s.offset + s.numel] for s in segs],
            [exp_avg_sq[s.offset : s.offset + s.numel] for s in segs],
            [],
            [steps[i] for i in members],
            lr=lr,
            beta1=beta1,
            beta2=beta2,
            weight_decay=wd,
            eps=eps,
            amsgrad=False,
            maximize=False,
        )
    torch._foreach_copy_(
        [param_out[s.offset : s.offset + s.numel] for s in segments],
        [master[s.offset : s.offset + s.numel] for s in segments],
    )


def _adamw_torch(
    master: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    grad: torch.Tensor,
    param_out: torch.Tensor,
    segments: Sequence[AdamSegment],
    beta1: float,
    beta2: float,
    eps: float,
    grad_scale: float,
) -> None:
    """Reference semantics in torch ops, mirroring torch.optim.adam._single_tensor_adam."""
    for s in segments:
        sl = slice(s.offset, s.offset + s.numel)
        # A fresh fp32 tensor (the multiply always allocates), so a param_out aliasing grad
        # can be overwritten at the end without corrupting the gradient we use.
        g = grad[sl].float() * grad_scale
        p, m, v = master[sl], exp_avg[sl], exp_avg_sq[sl]
        decay, step_size, bc2_sqrt = _seg_constants(s, beta1, beta2)
        p.mul_(decay)
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        denom = (v.sqrt() / bc2_sqrt).add_(eps)
        p.addcdiv_(m, denom, value=-step_size)
        param_out[sl].copy_(p)


def grad_sq_norm(grad: torch.Tensor, segments: Sequence[AdamSegment]) -> float:
    """Sum of ``grad**2`` over the segments, accumulated in fp64.

    Returns inf or nan when any element in the segments is inf or nan (callers use this
    for fp16 overflow detection), never a silently finite number.
    """
    if grad.dim() != 1 or not grad.is_contiguous() or grad.dtype not in _FLOAT_DTYPES:
        raise ValueError("grad must be a 1-D contiguous float32/bfloat16/float16 tensor")
    segments = _validated_segments(segments, grad.numel(), check_step=False)
    if not segments:
        return 0.0
    if grad.device.type == "cpu" and kernel_backend() == "cpp":
        ext = _load_ext()
        assert ext is not None  # kernel_backend() said cpp
        return float(ext.grad_sq_norm(grad, segments))
    return float(grad_sq_norm_device(grad, segments).item())


def grad_sq_norm_device(grad: torch.Tensor, segments: Sequence[AdamSegment]) -> torch.Tensor:
    """`grad_sq_norm` as a 0-dim fp64 tensor on grad's device, without a host sync (the
    caller adds these up and reads the total once). No fp64 copy of the gradient: the
    norm reduces in fp64 as it reads."""
    total = torch.zeros((), dtype=torch.float64, device=grad.device)
    for s in _validated_segments(segments, grad.numel(), check_step=False):
        g = grad[s.offset : s.offset + s.numel]
        total += torch.linalg.vector_norm(g, dtype=torch.float64).square()
    return total
