"""fakegpu: a second device for CPU-only tests.

`load()` builds `fakegpu.cpp` (once per process, cached on disk like the AdamW kernel),
renames PyTorch's PrivateUse1 backend to ``fakegpu`` and registers this module as
``torch.fakegpu``, so ``t.to("fakegpu")``, ``torch.device("fakegpu:0")`` and
``t.is_fakegpu`` work. Tensors on it live in host memory, but mixing them with CPU tensors
(other than 0-dim ones) raises CUDA's same-device error, ``.numpy()`` refuses them, and
their bytes are counted (`memory_allocated`). It also registers the ``fakenccl`` c10d
backend (see `tests.fakedevice.fakenccl`), so
``dist.init_process_group("cpu:gloo,fakegpu:fakenccl")`` behaves like gloo + NCCL.

Loading changes process-wide state for good, as a real accelerator would: the
PrivateUse1 backend is the accelerator torch reports (``torch.accelerator``,
``pin_memory()``/``is_pinned()`` go through this device's hooks), and a process can
rename PrivateUse1 only once.
"""

from __future__ import annotations

import hashlib
import sys
import threading
import time
from pathlib import Path
from types import ModuleType

import torch

from pstar_core.kernels.adam import _build_lock, _ext_root

DEVICE = "fakegpu"
_SOURCE_PATH = Path(__file__).with_name("fakegpu.cpp")
_CFLAGS = ["-O2"]

_lock = threading.Lock()
_ext: ModuleType | None = None
build_seconds: float | None = None  # time load() spent building/importing the extension
_initialized = False  # read by torch.utils.checkpoint (as torch.cuda._initialized)


def _ext_name(source: str) -> str:
    key = "\n".join([source, " ".join(_CFLAGS), torch.__version__, sys.version])
    return "pstar_fakegpu_" + hashlib.sha256(key.encode()).hexdigest()[:16]


def _build() -> ModuleType:
    from torch.utils import cpp_extension

    name = _ext_name(_SOURCE_PATH.read_text(encoding="utf-8"))
    build_dir = _ext_root() / name
    build_dir.mkdir(parents=True, exist_ok=True)
    with _build_lock(_ext_root() / f"{name}.flock"):
        (build_dir / "lock").unlink(missing_ok=True)  # a stale baton (see _build_lock)
        return cpp_extension.load(
            name=name,
            sources=[str(_SOURCE_PATH)],
            extra_cflags=list(_CFLAGS),
            build_directory=str(build_dir),
            verbose=False,
        )


def load() -> ModuleType:
    """Build and register the device (idempotent); return the device module (`torch.fakegpu`)."""
    global _ext, _initialized, build_seconds
    with _lock:
        if _ext is None:
            start = time.perf_counter()
            ext = _build()
            ext.routed_to_cpu_kernels()  # see fakegpu.cpp: route_cpu_kernels
            build_seconds = time.perf_counter() - start
            if torch._C._get_privateuse1_backend_name() != DEVICE:
                torch.utils.rename_privateuse1_backend(DEVICE)
            if not hasattr(torch, DEVICE):
                torch._register_device_module(DEVICE, sys.modules[__name__])
            if not hasattr(torch.Tensor, f"is_{DEVICE}"):
                torch.utils.generate_methods_for_privateuse1_backend()
            _ext = ext
            _initialized = True
            from tests.fakedevice import fakenccl

            fakenccl.register()
    return sys.modules[__name__]


def _loaded() -> ModuleType:
    if _ext is None:
        raise RuntimeError("fakegpu is not loaded: call tests.fakedevice.load() first")
    return _ext


def extension() -> ModuleType:
    """The compiled extension (kernels list, FakeNcclBackend)."""
    return _loaded()


def registered_kernels() -> list[str]:
    """The aten ops with a kernel of their own; every other op goes through the fallback."""
    return list(_loaded().registered_kernels())


def routed_to_cpu_kernels() -> list[str]:
    """Ops whose CompositeExplicitAutograd kernel is bypassed for the CPU one (bitwise CPU)."""
    return list(_loaded().routed_to_cpu_kernels())


# ---------------------------------------------------------------------------------------
# The device module API (what torch and the engine call as torch.fakegpu.*)
# ---------------------------------------------------------------------------------------


def is_available() -> bool:
    return _ext is not None


def is_initialized() -> bool:
    return _ext is not None


def _lazy_init() -> None:
    load()


def _is_in_bad_fork() -> bool:
    return False


def device_count() -> int:
    return 1


def current_device() -> int:
    return 0


def set_device(device: torch.device | str | int) -> None:
    index = device if isinstance(device, int) else torch.device(device).index
    if index not in (None, 0):
        raise RuntimeError(f"fakegpu has one device, got {device!r}")


class device:
    """Context manager selecting a fakegpu device (index 0 only); named like
    torch.cuda.device, which torch.utils.checkpoint and fork_rng use."""

    def __init__(self, device: torch.device | str | int | None) -> None:
        if device is not None:
            set_device(device)

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def synchronize(device: torch.device | str | int | None = None) -> None:
    """Nothing to wait for: every fakegpu kernel is synchronous."""


def memory_allocated(device: torch.device | str | int | None = None) -> int:
    """Bytes held by live fakegpu tensors (exact: no caching allocator, no rounding)."""
    return int(_loaded().memory_allocated())


def max_memory_allocated(device: torch.device | str | int | None = None) -> int:
    return int(_loaded().max_memory_allocated())


def memory_reserved(device: torch.device | str | int | None = None) -> int:
    """No caching allocator: what is reserved is what is allocated."""
    return memory_allocated(device)


def max_memory_reserved(device: torch.device | str | int | None = None) -> int:
    return max_memory_allocated(device)


def reset_peak_memory_stats(device: torch.device | str | int | None = None) -> None:
    _loaded().reset_peak_memory_stats()


def get_rng_state(device: torch.device | str | int = DEVICE) -> torch.Tensor:
    return _loaded().get_rng_state()


def set_rng_state(new_state: torch.Tensor, device: torch.device | str | int = DEVICE) -> None:
    _loaded().set_rng_state(new_state)


def get_rng_state_all() -> list[torch.Tensor]:
    return [get_rng_state()]


def set_rng_state_all(new_states: list[torch.Tensor]) -> None:
    set_rng_state(new_states[0])


def manual_seed(seed: int) -> None:
    _loaded().manual_seed(int(seed) & 0xFFFF_FFFF_FFFF_FFFF)


def manual_seed_all(seed: int) -> None:
    manual_seed(seed)


def seed() -> None:
    _loaded().seed()


def seed_all() -> None:
    seed()


def initial_seed() -> int:
    return int(_loaded().initial_seed())


def get_amp_supported_dtype() -> list[torch.dtype]:
    return [torch.float16, torch.bfloat16]


# Whether the device computes bf16 natively: an Ampere-or-later GPU does, a V100 or T4 does
# not (`dtype: auto` then picks fp16 with loss scaling). Tests flip it to play either.
bf16_native = True


def is_bf16_supported(including_emulation: bool = True) -> bool:
    """As `torch.cuda.is_bf16_supported`: native bf16, or (with emulation) any bf16 at all."""
    return bf16_native or including_emulation
