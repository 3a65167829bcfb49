"""fakegpu: a second device for CPU-only tests.

`load()` builds `fakegpu.cpp` (once per process, cached on disk like the AdamW kernel),
renames PyTorch's PrivateUse1 backend to ``fakegpu`` and registers this module as
``torch.fakegpu``, so ``t.to("fakegpu")``, ``torch.device("fakegpu:1")`` and
``t.is_fakegpu`` work. Tensors on it live in host memory, but mixing them with CPU tensors
(other than 0-dim ones) or with another fakegpu device raises CUDA's same-device error,
``.numpy()`` refuses them, and their bytes are counted per device (`memory_allocated`)
against a capacity (`mem_get_info`; past it, ``torch.OutOfMemoryError``). It also
registers the ``fakenccl`` c10d backend (see `tests.fakedevice.fakenccl`), so
``dist.init_process_group("cpu:gloo,fakegpu:fakenccl")`` behaves like gloo + NCCL.

Devices: ``PSTAR_FAKEGPU_DEVICES`` of them (default 2), each with its own allocator counts,
capacity (16 GiB, or ``PSTAR_FAKEGPU_CAPACITY`` bytes, or `set_capacity`), RNG and streams;
the current device is per thread (`set_device`, `device`, ``torch.accelerator``).

Streams and events are torch's generic ones (``torch.Stream(device="fakegpu:0")``,
``torch.Event``, ``torch.accelerator.current_stream/set_stream``, ``Tensor.record_stream``)
and order work as on a GPU, in the only way a device without concurrency can show:

- Stream 0 of a device (the default stream) runs everything when it is issued.
- A copy (``dst.copy_(src, non_blocking=...)``, ``.to(..., non_blocking=True)``, either
  side on fakegpu) issued while another stream is current is queued on that stream. It
  runs, in stream order, only when something waits for it: synchronizing an event
  recorded after it, waiting on such an event (``stream.wait_event``: the copies queued up
  to the event run then) or on its stream (``wait_stream``), synchronizing its stream
  (``Stream.synchronize``) or its device (`synchronize`), or issuing any other op, or a
  blocking host copy, on that same stream. Reading the destination from the default
  stream does not run it: code that forgot to wait sees the old bytes. Until it ran,
  ``event.query()`` (of an event recorded after it) and ``stream.query()`` are False.
- Which copies, as on CUDA: a copy belongs to the current stream of its device side (the
  source's, device to device); a blocking copy with a host side runs at once, after the
  stream's queue (CUDA synchronizes the stream after it), a blocking device-to-device one
  is queued; a pageable host source is read when the copy is issued (CUDA stages it), a
  pinned one when the copy runs. Stricter than CUDA: a non-blocking device-to-host copy
  into pageable memory is queued too (CUDA happens to finish it before returning).
- Fakegpu memory a queued copy reads or writes stays allocated until the copy ran. Dropping
  the last reference to such a tensor, or resizing its storage, while the copy is queued on
  a stream other than the one the tensor was allocated on, without
  ``tensor.record_stream(that_stream)``, is a hazard on a GPU (the caching allocator may
  hand the block out again before the copy ran): `stream_hazards` counts them.
- Only copies are queued; every other op runs when issued (after its stream's queue).

A modeled link (off by default; `set_link`, or ``PSTAR_FAKEGPU_LINK="H2D,D2H,latency_us"``
with bandwidths in GB/s): each direction between host and device has a copy engine, as
PCIe does, and a copy takes latency + bytes / bandwidth of wall time on it after the
copies issued before it in that direction and those queued before it on its stream (the
directions overlap when on two streams); compute is the real CPU. A queued copy is done
at the time its engine gives it when issued, and whoever waits for it sleeps until then
(its bytes still land only when waited for); a copy that runs at once makes the host sleep
it out. `link_stats` counts per direction the bytes, the engine time issued and the time
the host slept waiting (the copy time not hidden). Collectives through fakenccl stage
through host memory, so with a link they are charged as copies too.

Pinned host memory: ``pin_memory()`` and ``torch.empty(..., pin_memory=True)`` take blocks
from a caching allocator shaped like torch's CUDA host allocator (each request rounded up
to a power of two, freed blocks kept for reuse, never returned): `pinned_allocator_bytes`
(live, as requested) and `pinned_allocator_held_bytes` (everything it holds) show what
pinning through it costs. `host_register` / `host_unregister` page-lock a range of
ordinary host memory as ``cudaHostRegister`` / ``cudaHostUnregister`` do (`pinned_bytes`),
registering making every page of the range resident, as locking it does;
``is_pinned()`` is True for a CPU tensor inside either.

Loading changes process-wide state for good, as a real accelerator would: the
PrivateUse1 backend is the accelerator torch reports (``torch.accelerator``,
``pin_memory()``/``is_pinned()`` go through this device's hooks), and a process can
rename PrivateUse1 only once.
"""

from __future__ import annotations

import hashlib
import os
import sys
import threading
import time
from pathlib import Path
from types import ModuleType

import torch

from pstar_core.kernels.adam import build_lock, ext_root
from tests.fakedevice import fakenccl

DEVICE = "fakegpu"
_SOURCE_PATH = Path(__file__).with_name("fakegpu.cpp")
_CFLAGS = ["-O2"]

_lock = threading.Lock()
_ext: ModuleType | None = None
build_seconds: float | None = None  # time load() spent building/importing the extension
_initialized = False  # read by torch.utils.checkpoint (as torch.cuda._initialized)


def _ext_name(source: str) -> str:
    key = "\n".join([source, " ".join(_CFLAGS), torch.__version__, torch.__file__, sys.version])
    return "pstar_fakegpu_" + hashlib.sha256(key.encode()).hexdigest()[:16]


def _build() -> ModuleType:
    from torch.utils import cpp_extension

    name = _ext_name(_SOURCE_PATH.read_text(encoding="utf-8"))
    build_dir = ext_root() / name
    build_dir.mkdir(parents=True, exist_ok=True)
    with build_lock(ext_root() / f"{name}.flock"):
        (build_dir / "lock").unlink(missing_ok=True)  # a stale baton (see build_lock)
        return cpp_extension.load(
            name=name,
            sources=[str(_SOURCE_PATH)],
            extra_cflags=list(_CFLAGS),
            build_directory=str(build_dir),
            verbose=False,
        )


def _env_int(name: str, low: int, high: int | None = None) -> int | None:
    text = os.environ.get(name)
    if text is None:
        return None
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < low or (high is not None and value > high):
        bound = f"between {low} and {high}" if high is not None else f">= {low}"
        raise ValueError(f"{name}={text!r}: expected an integer {bound}")
    return value


def _env_link() -> tuple[float, float, float] | None:
    """PSTAR_FAKEGPU_LINK="H2D_GBps,D2H_GBps,latency_us" (see `set_link`), checked here."""
    text = os.environ.get("PSTAR_FAKEGPU_LINK")
    if not text:
        return None
    try:
        h2d, d2h, latency = (float(x) for x in text.split(","))
    except ValueError:
        h2d = -1.0
    if h2d < 0 or d2h < 0 or latency < 0:
        raise ValueError(
            f"PSTAR_FAKEGPU_LINK={text!r}: expected three numbers >= 0, "
            '"H2D_GBps,D2H_GBps,latency_us" such as "25,25,10"'
        )
    return h2d, d2h, latency


def load() -> ModuleType:
    """Build and register the device (idempotent); return the device module (`torch.fakegpu`)."""
    global _ext, _initialized, build_seconds
    with _lock:
        if _ext is None:
            _env_int("PSTAR_FAKEGPU_DEVICES", 1, 16)  # read by fakegpu.cpp; checked here
            capacity = _env_int("PSTAR_FAKEGPU_CAPACITY", 0)
            link = _env_link()
            start = time.perf_counter()
            ext = _build()
            ext.routed_to_cpu_kernels()  # see fakegpu.cpp: route_cpu_kernels
            if capacity is not None:
                ext.set_capacity(capacity, -1)
            if link is not None:
                ext.set_link(*link)
            build_seconds = time.perf_counter() - start
            if torch._C._get_privateuse1_backend_name() != DEVICE:
                torch.utils.rename_privateuse1_backend(DEVICE)
            if not hasattr(torch, DEVICE):
                torch._register_device_module(DEVICE, sys.modules[__name__])
            if not hasattr(torch.Tensor, f"is_{DEVICE}"):
                torch.utils.generate_methods_for_privateuse1_backend()
            ext.init_context()  # is_pinned() asks an initialized accelerator only
            _ext = ext
            _initialized = True
            fakenccl.register(ext)
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

_Device = torch.device | str | int | None


def _index(device: _Device) -> int:
    """A device index; -1 (the current device) for None or a device without an index."""
    if device is None:
        return -1
    if isinstance(device, int):
        return device
    device = torch.device(device)
    if device.type != DEVICE:
        raise ValueError(f"expected a {DEVICE} device, got {device}")
    return -1 if device.index is None else device.index


def is_available() -> bool:
    return _ext is not None


def is_initialized() -> bool:
    return _ext is not None


def _lazy_init() -> None:
    load()


def _is_in_bad_fork() -> bool:
    return False


def device_count() -> int:
    """``PSTAR_FAKEGPU_DEVICES`` (default 2)."""
    return int(_loaded().device_count())


def current_device() -> int:
    return int(_loaded().current_device())


def set_device(device: _Device) -> None:
    index = _index(device)
    if index >= 0:
        _loaded().set_device(index)


class device:
    """Context manager selecting a fakegpu device for the block; named like
    torch.cuda.device, which torch.utils.checkpoint and fork_rng use."""

    def __init__(self, device: _Device) -> None:
        self.index = _index(device)
        self.previous = -1

    def __enter__(self) -> None:
        if self.index >= 0:
            self.previous = int(_loaded().exchange_device(self.index))

    def __exit__(self, *exc: object) -> None:
        if self.index >= 0:
            _loaded().set_device(self.previous)


def synchronize(device: _Device = None) -> None:
    """Run every copy queued on the device's streams (see the module docstring)."""
    _loaded().synchronize(_index(device))


def current_stream(device: _Device = None) -> torch.Stream:
    return _loaded().current_stream(_index(device))


def default_stream(device: _Device = None) -> torch.Stream:
    return _loaded().default_stream(_index(device))


class stream:
    """Context manager making `s` the current stream of its device for the block (None: a
    no-op); named like torch.cuda.stream, which FSDP2 uses through the device module."""

    def __init__(self, s: torch.Stream | None) -> None:
        self.s = s
        self.previous: torch.Stream | None = None

    def __enter__(self) -> None:
        if self.s is not None:
            self.previous = torch.accelerator.current_stream(self.s.device)
            torch.accelerator.set_stream(self.s)

    def __exit__(self, *exc: object) -> None:
        if self.previous is not None:
            torch.accelerator.set_stream(self.previous)


def set_link(h2d_gbps: float, d2h_gbps: float | None = None, latency_us: float = 0.0) -> None:
    """Model a link between host and device (see the module docstring): host-to-device
    and device-to-host bandwidths in GB/s (0: that direction is free) and a latency per
    copy. `set_link(0)` turns it off. The counts of `link_stats` start again."""
    d2h = h2d_gbps if d2h_gbps is None else d2h_gbps
    if min(h2d_gbps, d2h, latency_us) < 0:
        raise ValueError("link bandwidths and latency must be >= 0")
    _loaded().set_link(float(h2d_gbps), float(d2h), float(latency_us))


def link_stats() -> dict:
    """Per direction ("host_to_device", "device_to_host"): GBps, copies, bytes, busy_s
    (the engine time issued), waited_s (the host asleep waiting for copies: the copy time
    not hidden) and free_at_s (when its engine is done with what it was given, on the
    clock of `time.monotonic`); and latency_us."""
    return dict(_loaded().link_stats())


def pending_copies(device: _Device = None) -> int:
    """Copies queued on the device's streams that nothing has waited for yet."""
    return int(_loaded().pending_copies(_index(device)))


def stream_hazards() -> int:
    """How often a tensor was freed while a copy queued on another stream used its memory,
    without ``record_stream`` on that stream (process-wide, never reset)."""
    return int(_loaded().stream_hazards())


def memory_allocated(device: _Device = None) -> int:
    """Bytes held by live fakegpu tensors on the device (exact: no caching allocator, no
    rounding), memory kept for a queued copy included."""
    return int(_loaded().memory_allocated(_index(device)))


def max_memory_allocated(device: _Device = None) -> int:
    return int(_loaded().max_memory_allocated(_index(device)))


def memory_reserved(device: _Device = None) -> int:
    """No caching allocator: what is reserved is what is allocated."""
    return memory_allocated(device)


def max_memory_reserved(device: _Device = None) -> int:
    return max_memory_allocated(device)


def reset_peak_memory_stats(device: _Device = None) -> None:
    _loaded().reset_peak_memory_stats(_index(device))


def mem_get_info(device: _Device = None) -> tuple[int, int]:
    """(free, total) bytes, as torch.cuda.mem_get_info: total is the device's capacity,
    free what allocated tensors leave of it."""
    free, total = _loaded().mem_get_info(_index(device))
    return int(free), int(total)


def set_capacity(nbytes: int, device: _Device = None) -> None:
    """The capacity of `device`, or of every device if None (default 16 GiB, or
    ``PSTAR_FAKEGPU_CAPACITY``); an allocation past it raises ``torch.OutOfMemoryError``."""
    _loaded().set_capacity(int(nbytes), _index(device))


_full_capacity: dict[int, int] = {}  # device -> its capacity before a memory fraction


def set_per_process_memory_fraction(fraction: float, device: _Device = None) -> None:
    """As torch.cuda's: allocations past `fraction` of the device raise out of memory.
    (Here it lowers the capacity, so mem_get_info's total shrinks with it; 1.0 restores.)"""
    if not 0 <= fraction <= 1:
        raise ValueError(f"fraction must be in [0, 1], got {fraction}")
    index = _index(device)
    full = _full_capacity.setdefault(index, mem_get_info(index)[1])
    set_capacity(int(fraction * full), index)
    if fraction == 1.0:
        _full_capacity.pop(index, None)


def host_register(ptr: int, nbytes: int) -> None:
    """Page-lock `nbytes` of host memory at `ptr`, as ``cudaHostRegister(ptr, nbytes, 0)``:
    its pages become resident; raises if the range overlaps memory already pinned."""
    _loaded().host_register(int(ptr), int(nbytes))


def host_unregister(ptr: int) -> None:
    """Undo `host_register` (`ptr` its start), as ``cudaHostUnregister``; raises for a
    pointer that starts no registered range."""
    _loaded().host_unregister(int(ptr))


def pinned_bytes() -> int:
    """Host bytes page-locked now by `host_register`."""
    return int(_loaded().pinned_bytes())


def pinned_allocator_bytes() -> int:
    """Bytes of live blocks from the pinned allocator (``pin_memory()``), as requested."""
    return int(_loaded().pinned_allocator_bytes())


def pinned_allocator_held_bytes() -> int:
    """Bytes the pinned allocator holds: every block it took (rounded up to a power of
    two), live or cached, since it never gives memory back."""
    return int(_loaded().pinned_allocator_held_bytes())


def get_rng_state(device: _Device = DEVICE) -> torch.Tensor:
    return _loaded().get_rng_state(_index(device))


def set_rng_state(new_state: torch.Tensor, device: _Device = DEVICE) -> None:
    _loaded().set_rng_state(new_state, _index(device))


def get_rng_state_all() -> list[torch.Tensor]:
    return [get_rng_state(i) for i in range(device_count())]


def set_rng_state_all(new_states: list[torch.Tensor]) -> None:
    for i, state in enumerate(new_states):
        set_rng_state(state, i)


def manual_seed(seed: int) -> None:
    """Seed the current device's generator."""
    _loaded().manual_seed(int(seed) & 0xFFFF_FFFF_FFFF_FFFF, -1)


def manual_seed_all(seed: int) -> None:
    for i in range(device_count()):
        _loaded().manual_seed(int(seed) & 0xFFFF_FFFF_FFFF_FFFF, i)


def seed() -> None:
    _loaded().seed(-1)


def seed_all() -> None:
    for i in range(device_count()):
        _loaded().seed(i)


def initial_seed() -> int:
    return int(_loaded().initial_seed(-1))


def get_amp_supported_dtype() -> list[torch.dtype]:
    return [torch.float16, torch.bfloat16]


# Whether the device computes bf16 natively: an Ampere-or-later GPU does, a V100 or T4 does
# not (`dtype: auto` then picks fp16 with loss scaling). Tests flip it to play either.
bf16_native = True


def is_bf16_supported(including_emulation: bool = True) -> bool:
    """As `torch.cuda.is_bf16_supported`: native bf16, or (with emulation) any bf16 at all."""
    return bf16_native or including_emulation


# The stream and event classes, as torch.cuda has them: the device module's way of saying
# that the device orders work on streams (`pstar_core.devices.capabilities`). Streams and
# events themselves are torch's device-generic ones, backed by fakegpu.cpp's guard.
Stream = torch.Stream
Event = torch.Event
