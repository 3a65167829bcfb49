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
import json
import logging
import os
import platform
import sys
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, NamedTuple

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


def ext_root() -> Path:
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
            # two environments with the same torch release build against different
            # headers and libraries: one build directory each, not one rebuilt in turn
            str(Path(torch.__file__).parent),
            sys.version,
            _cpu_signature(),
        ]
    )
    return "pstar_adam_" + hashlib.sha256(key.encode()).hexdigest()[:16]


@contextlib.contextmanager
def build_lock(path: Path) -> Iterator[None]:
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
            build_dir = ext_root() / name
            build_dir.mkdir(parents=True, exist_ok=True)
            with build_lock(ext_root() / f"{name}.flock"):
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
                "pstar AdamW C++ kernel unavailable (%s: %s); using torch's fused AdamW "
                "(a C++ compiler and the Python headers build it: see scripts/setup.sh)",
                type(exc).__name__,
                str(exc).strip().splitlines()[-1] if str(exc).strip() else "",
            )
    return _ext_module


def _requested_backend() -> str:
    choice = os.environ.get("PSTAR_ADAM_BACKEND", "auto").strip().lower()
    if choice not in ("auto", "cpp", "torch", "fused"):
        raise ValueError(f"PSTAR_ADAM_BACKEND must be auto, cpp, torch or fused, got {choice!r}")
    return choice


# [Note: which host kernel] Two kernels can run a chunk's AdamW on the host: ours
# (adam.cpp: reads the compute-dtype gradient from the param slot and writes the new
# param back in one pass, 28 bytes per element in bf16) and torch's fused AdamW (which
# needs fp32 gradients: a conversion pass before and a cast pass after, ~40 bytes per
# element in bf16). Which is faster depends on the CPU: ours was 1.06-1.15x torch's fused
# on AVX-512 machines and 0.99x on an AVX2 one. So neither is assumed: `prepare()` builds
# ours (timed) and measures both on this CPU, per chunk dtype and thread count, and the
# faster one is the default, ours only if it wins by `_CLEAR_MARGIN`. The answer is kept
# beside the build, keyed like it (source, flags, torch, CPU flags) plus torch's chosen
# ISA, so `scripts/setup.sh` and the image build pay for it once per CPU type; a job that
# meets a new CPU pays it before training starts, and says so (`service.worker.finetune`).
_CLEAR_MARGIN = 1.05
_MEASURE_ELEMS = 4 * 2**20  # 4M elements: ~70 MB of buffers, ~10 ms a call
_MEASURE_REPEATS = 5
_choice_lock = threading.Lock()
# (choice file, chunk dtype, threads) -> measurement
_choices: dict[tuple[str, str, int], dict[str, Any]] = {}


def _choice_path() -> Path:
    source = _SOURCE_PATH.read_text(encoding="utf-8")
    capability = torch.backends.cpu.get_cpu_capability()
    return ext_root() / f"{_ext_name(source)}.{capability}.choice.json"


def _dtype_key(dtype: torch.dtype) -> str:
    return "fp32" if dtype == torch.float32 else "bf16"  # fp16 moves the bytes bf16 does


def measure_backends(
    numel: int,
    grad_dtype: torch.dtype,
    backends: Sequence[str],
    repeats: int = _MEASURE_REPEATS,
) -> dict[str, float]:
    """Elements per second of each backend on one chunk laid out as the engine lays it
    out (fp32 master and states, the gradient read from and the param written into one
    slot of `grad_dtype`), interleaved (A B A B ...), medians."""
    import statistics
    import time

    gen = torch.Generator().manual_seed(0)
    bufs = [torch.randn(numel, generator=gen), torch.zeros(numel), torch.zeros(numel)]
    grad = torch.randn(numel, generator=gen).to(grad_dtype)
    slot = torch.empty_like(grad)
    seg = [AdamSegment(0, numel, 1, 1e-4, 0.01)]
    run = {"cpp": _adamw_cpp, "fused": _adamw_fused, "torch": _adamw_torch}
    times: dict[str, list[float]] = {b: [] for b in backends}
    for i in range(repeats + 1):  # the first round warms up (first touch, lazy init)
        for b in backends:
            slot.copy_(grad)
            start = time.perf_counter()
            run[b](*bufs, slot, slot, seg, 0.9, 0.999, 1e-8, 1.0)
            if i:
                times[b].append(time.perf_counter() - start)
    return {b: numel / statistics.median(ts) for b, ts in times.items()}


def _measured(dtype: torch.dtype, threads: int) -> dict[str, Any]:
    """The backends' speeds on this CPU for `dtype` at `threads` threads, from the file
    `prepare` wrote, or measured now (and added to it)."""
    path = _choice_path()
    key = (str(path), _dtype_key(dtype), threads)
    if key in _choices:
        return _choices[key]
    with _choice_lock:
        if key in _choices:
            return _choices[key]
        path.parent.mkdir(parents=True, exist_ok=True)
        with build_lock(path.with_suffix(".flock")):
            saved = json.loads(path.read_text()) if path.is_file() else {}
            entry = saved.get(f"{key[1]}/{key[2]}")
            if entry is None:
                built = _load_ext() is not None
                backends = ["cpp", "fused"] if built else ["fused"]
                rates = measure_backends(_MEASURE_ELEMS, torch.float32 if key[1] == "fp32"
                                         else torch.bfloat16, backends)  # fmt: skip
                wins = built and rates["cpp"] >= _CLEAR_MARGIN * rates["fused"]
                entry = {"backend": "cpp" if wins else "fused", "elems_per_s": rates}
                saved[f"{key[1]}/{key[2]}"] = entry
                path.write_text(json.dumps(saved, indent=1))
                logger.info(
                    "host AdamW on this CPU (%s, %d threads, %s chunks): %s (%s)",
                    torch.backends.cpu.get_cpu_capability(),
                    threads,
                    key[1],
                    entry["backend"],
                    ", ".join(f"{b} {r / 1e9:.2f} G elem/s" for b, r in rates.items()),
                )
        _choices[key] = entry
        return entry


def prepared(threads: int | None = None) -> bool:
    """Whether this CPU's host-kernel choice (and the build it needs) is on disk already:
    if not, the first `adamw_` call (or `prepare`) builds and measures."""
    if _requested_backend() != "auto":
        return True
    path = _choice_path()
    if not path.is_file():
        return False
    saved = json.loads(path.read_text())
    threads = threads or torch.get_num_threads()
    return all(f"{d}/{threads}" in saved for d in ("bf16", "fp32"))


def prepare(threads: Sequence[int] | None = None) -> dict[str, Any]:
    """Build the C++ kernel for this CPU (if it is not built yet) and measure which host
    kernel is faster for each chunk dtype at each thread count (default: 1 and this
    process's); what `scripts/setup.sh` and the image build run. Returns the build time
    and the choices."""
    import time

    start = time.perf_counter()
    built = _load_ext() is not None
    build_s = time.perf_counter() - start
    counts = sorted(set(threads or (1, torch.get_num_threads())))
    saved_threads = torch.get_num_threads()
    out: dict[str, Any] = {"built": built, "build_s": build_s, "choices": {}}
    try:
        for n in counts:
            torch.set_num_threads(n)
            for dtype in (torch.bfloat16, torch.float32):
                out["choices"][f"{_dtype_key(dtype)}/{n}"] = _measured(dtype, n)
    finally:
        torch.set_num_threads(saved_threads)
    out["capability"] = torch.backends.cpu.get_cpu_capability()
    out["path"] = str(_choice_path())
    return out


def kernel_backend(dtype: torch.dtype = torch.bfloat16) -> str:
    """Where host (CPU) calls on chunks of `dtype` go: ``"cpp"`` (the compiled kernel),
    ``"fused"`` (torch's fused AdamW, as on a GPU) or ``"torch"`` (the reference in torch
    ops). ``PSTAR_ADAM_BACKEND`` forces one; by default the faster of cpp and fused on
    this CPU (see [Note: which host kernel]). Tensors on a device take the fused path."""
    choice = _requested_backend()
    if choice in ("torch", "fused"):
        return choice
    if choice == "cpp":
        if _load_ext() is None:
            raise RuntimeError("PSTAR_ADAM_BACKEND=cpp but the C++ kernel failed to build")
        return "cpp"
    return _measured(dtype, torch.get_num_threads())["backend"]


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
    backend = kernel_backend(grad.dtype) if master.device.type == "cpu" else "fused"
    run = {"cpp": _adamw_cpp, "fused": _adamw_fused, "torch": _adamw_torch}[backend]
    run(master, exp_avg, exp_avg_sq, grad, param_out, segments, beta1, beta2, eps, grad_scale)


def _adamw_cpp(
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
    ext = _load_ext()
    assert ext is not None, "the C++ AdamW kernel is not built"
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


def adam_temporary_bytes(capacity: int, device: torch.device) -> int:
    """The most memory of `device` one `adamw_` call allocates on a chunk of `capacity`
    elements there, beyond what the CPU tracer measures itself: on an accelerator the
    fused path's fp32 gradients of its segments, plus the steps; on the CPU nothing (the
    profiler sees the host kernels' temporaries in the warm-up)."""
    if device.type == "cpu":
        return 0
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
    chunk element (`adam_temporary_bytes`), is the only temporary. Step counts are made
    on the device, one 0-dim tensor per distinct count. The new masters are cast into
    `param_out` by one `_foreach_copy_`. No host synchronisation.
    """
    lo = min(s.offset for s in segments)
    hi = max(s.offset + s.numel for s in segments)
    if grad.dtype == torch.float32 and grad_scale == 1.0:
        # read in place: the kernel does not write gradients, and param_out (which may
        # be the same memory) is only written after it
        g32 = grad[lo:hi]
    else:
        g32 = grad[lo:hi].to(torch.float32, copy=True)  # a copy: grad may alias param_out
        if grad_scale != 1.0:
            g32.mul_(grad_scale)
    # each distinct step count made on the device by a fill, shared by its segments (the
    # kernel only reads them): a copy from pageable host memory would wait for the
    # device's queue first, a host sync at every device-Adam call
    steps = {
        step: torch.full((), float(step), dtype=torch.float32, device=master.device)
        for step in {s.step for s in segments}
    }
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
            [steps[segments[i].step] for i in members],
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
    if grad.device.type == "cpu" and kernel_backend(grad.dtype) == "cpp":
        ext = _load_ext()
        assert ext is not None  # kernel_backend() said cpp
        return float(ext.grad_sq_norm(grad, segments))
    return float(grad_sq_norm_device(grad, segments).item())


_NORM_PIECE = 1 << 20  # elements a norm reads at once at most (an 8 MiB fp64 copy)


def grad_sq_norm_device(grad: torch.Tensor, segments: Sequence[AdamSegment]) -> torch.Tensor:
    """`grad_sq_norm` as a 0-dim fp64 tensor on grad's device, without a host sync (the
    caller adds these up and reads the total once).

    A norm asked for in fp64 reads its input through an fp64 copy (TensorIterator casts
    the whole input first; only CUDA's bf16/fp16 to fp32 is read in place): 8 bytes per
    element of the gradient, 4.2 GB for a Llama-3 embedding's. So each segment is read in
    pieces of at most `_NORM_PIECE` elements and half the chunk, whose squared norms add
    up in fp64: the copy is one piece at a time, at most 4 bytes per chunk element, and
    the sum is the fp64 one."""
    total = torch.zeros((), dtype=torch.float64, device=grad.device)
    piece = max(1, min(_NORM_PIECE, grad.numel() // 2))
    for s in _validated_segments(segments, grad.numel(), check_step=False):
        for start in range(s.offset, s.offset + s.numel, piece):
            g = grad[start : min(start + piece, s.offset + s.numel)]
            total += torch.linalg.vector_norm(g, dtype=torch.float64).square()
    return total
