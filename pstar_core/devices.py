"""The compute device: which one a rank uses, and the rules a GPU enforces, checked anywhere.

Everything device-specific sits here, behind `Capabilities` (what a device can do:
streams and events, page-locked host memory, allocator statistics, an RNG), so code
elsewhere branches on a capability and never on `device.type == "cuda"`:
- `resolve_device`: 'cuda' means this rank's GPU among the visible ones (set as the
  current device, as torchrun and Ray Train expect); an explicit 'cuda:N' as given;
- `to_device`: the inputs of a forward, moved by the engine (not left to the caller);
- `register_host`: page-locking the pinned pool (memory this engine owns);
- `plannable_bytes`: what an accelerator's memory can give the engine;
- `CopyStream`: copies beside compute, on torch's device-generic streams and events;
- the RNG state of this rank's device only, for checkpoints.

[Note: device discipline] On a machine without a GPU the device tier is CPU memory, so
nothing stops code from doing what a GPU would refuse: handing a host buffer to NCCL,
reading a device tensor as NumPy (moves between disk and device always pass through the
host, so the spill file only ever sees host memory). With
`PSTAR_DEVICE_CHECKS=1` (the test suite sets it) `check` turns each such rule into an
assertion that names the chunk, the tiers and the call site, so CPU tests fail where a GPU
would crash. The checks cost a comparison each; off, they cost nothing.
"""

from __future__ import annotations

import logging
import os
import traceback
import warnings
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch.utils._pytree import tree_map

log = logging.getLogger(__name__)


class DeviceDisciplineError(AssertionError):
    """Code did something a GPU would refuse (see [Note: device discipline])."""


def checks_enabled() -> bool:
    return os.environ.get("PSTAR_DEVICE_CHECKS") == "1"


def check(ok: bool, what: str) -> None:
    """Raise `DeviceDisciplineError` with the caller's site if `ok` is False (checks on)."""
    if ok or not checks_enabled():
        return
    site = traceback.extract_stack(limit=2)[0]  # the caller of check
    raise DeviceDisciplineError(f"{what} (at {site.filename}:{site.lineno} in {site.name})")


@dataclass(frozen=True)
class Capabilities:
    """What the compute device can do. The engine branches on these, never on the device's
    type, so every branch runs in the CPU tests on the test suite's second device (which
    has them all) and on CUDA alike."""

    accelerator: bool  # memory of its own, apart from the host's
    streams: bool  # streams and events: a copy can run beside compute, ordered by events
    pinned_host: bool  # host memory can be page-locked (registered) for async copies
    allocator_stats: bool  # memory_allocated / max_memory_allocated / mem_get_info
    rng: bool  # an RNG of its own (checkpoints keep its state)


NO_CAPABILITIES = Capabilities(False, False, False, False, False)


def capabilities(device: torch.device) -> Capabilities:
    """Read off the device's torch module (`torch.cuda`, or another backend's)."""
    if device.type == "cpu":
        return NO_CAPABILITIES
    module = device_module(device)
    return Capabilities(
        accelerator=True,
        streams=hasattr(module, "Stream") and hasattr(module, "Event"),
        pinned_host=_host_registrar(module) is not None,
        allocator_stats=hasattr(module, "mem_get_info") and hasattr(module, "max_memory_allocated"),
        rng=hasattr(module, "get_rng_state") and hasattr(module, "set_rng_state"),
    )


def _host_registrar(module: Any) -> tuple[Any, Any] | None:
    """(register(ptr, nbytes), unregister(ptr)) page-locking host memory for `module`'s
    device: cudaHostRegister for CUDA, the backend's own functions for others."""
    if hasattr(module, "host_register") and hasattr(module, "host_unregister"):
        return module.host_register, module.host_unregister
    cudart = getattr(module, "cudart", None)
    if cudart is None:
        return None

    def register(ptr: int, nbytes: int) -> None:  # pragma: no cover - CUDA only
        err = cudart().cudaHostRegister(ptr, nbytes, 0)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed: error {int(err)}")

    def unregister(ptr: int) -> None:  # pragma: no cover - CUDA only
        cudart().cudaHostUnregister(ptr)

    return register, unregister


def register_host(device: torch.device, buffer: torch.Tensor) -> None:
    """Page-lock an ordinary host buffer for `device`'s copies (see [Note: one pinned pool]
    in tiers.py): memory this engine owns, not the caching host allocator's."""
    register, _ = _host_registrar(device_module(device))
    register(buffer.data_ptr(), buffer.numel() * buffer.element_size())


def unregister_host(device: torch.device, buffer: torch.Tensor) -> None:
    _, unregister = _host_registrar(device_module(device))
    unregister(buffer.data_ptr())


def plannable_bytes(device: torch.device, safety: float) -> int:
    """What an accelerator can give the engine: `safety` x the memory free now, plus what
    its caching allocator already holds (ours to reuse). Called after the device context
    and (under ZeRO) the communicator exist, so neither is counted as available; the
    device's total would count both, and chunks filling `budget - N_i` exactly would then
    run out of memory in the tight regime the engine is for."""
    module = device_module(device)
    free, _total = module.mem_get_info(device)
    return int(safety * (free + module.memory_reserved(device)))


def local_device_index(module: Any) -> int:
    """This rank's device among the visible ones. One visible device: it (Ray Train and
    Kubernetes narrow CUDA_VISIBLE_DEVICES to each worker's GPU, so LOCAL_RANK may be 3
    with one device visible). Several: LOCAL_RANK's (torchrun), or the global rank's modulo
    the count when only RANK is set; a rank without either uses the current device."""
    count = module.device_count()
    if count < 1:
        raise RuntimeError("no device of this kind is visible to this process")
    if count == 1:
        return 0
    if "LOCAL_RANK" in os.environ:
        local_rank = int(os.environ["LOCAL_RANK"])
        if local_rank >= count:
            raise RuntimeError(
                f"LOCAL_RANK is {local_rank} but only {count} devices are visible to this "
                "process; start at most one rank per visible device, or narrow "
                "CUDA_VISIBLE_DEVICES to one device per rank"
            )
        return local_rank
    if "RANK" in os.environ:
        log.warning(
            "LOCAL_RANK is not set and %d devices are visible: rank %s takes device %d "
            "(RANK modulo the count); set LOCAL_RANK (torchrun does) to choose",
            count,
            os.environ["RANK"],
            int(os.environ["RANK"]) % count,
        )
        return int(os.environ["RANK"]) % count
    return int(module.current_device())


def resolve_device(spec: str) -> torch.device:
    """The device a rank computes on, from the config's 'cpu', 'cuda' or 'cuda:N' (or
    another loaded backend's name, as the test suite's second device): without an index,
    this rank's device (`local_device_index`), made the current device as torchrun and
    Ray Train expect; with one, as given."""
    if spec == "cpu":
        return torch.device("cpu")
    kind = spec.split(":", 1)[0]
    module = getattr(torch, kind, None) if kind.isidentifier() else None
    if module is None or not hasattr(module, "is_available") or not module.is_available():
        if kind == "cuda":
            raise RuntimeError(
                f"device {spec!r} asked for, but torch sees no CUDA device (this is a CPU "
                "build or no GPU is visible); use device 'cpu'"
            )
        raise RuntimeError(f"device {spec!r}: no backend for it is loaded; use 'cpu' or 'cuda'")
    try:
        asked = torch.device(spec)
    except RuntimeError as e:
        raise RuntimeError(
            f"device {spec!r} is not a torch device: {e}; use 'cpu' or 'cuda'"
        ) from e
    if asked.index is None:
        device = torch.device(kind, local_device_index(module))
    else:
        device = asked
        if device.index >= module.device_count():
            raise RuntimeError(
                f"device {spec!r}: only {module.device_count()} {kind} devices are visible to "
                f"this process (indices 0..{module.device_count() - 1})"
            )
        shared = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) > 1
        if shared and module.device_count() > 1:
            log.warning(
                "device %s is fixed in the config while %s ranks share this host with %d "
                "devices visible: they all use it; say %r to give each rank its own",
                spec,
                os.environ["LOCAL_WORLD_SIZE"],
                module.device_count(),
                kind,
            )
    module.set_device(device)
    _expandable_segments(module)
    return device


def _expandable_segments(module: Any) -> None:
    """Ask the caching allocator for expandable segments unless the user configured it:
    chunks of one size come and go all iteration, and with fixed segments the freed ones
    fragment the device (reserved far above allocated); expandable segments map pages
    into one growing range instead. The tracer reports reserved memory beside allocated
    (`stats()['tracer']['peak_reserved_bytes']`) to show what is left of it."""
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + os.environ.get("PYTORCH_ALLOC_CONF", "")
    setter = getattr(getattr(module, "memory", None), "_set_allocator_settings", None)
    if setter is None or "expandable_segments" in conf:
        return
    try:  # pragma: no cover - CUDA only (the test device has no caching allocator)
        with warnings.catch_warnings():  # torch 2.11 names a newer, private API instead
            warnings.simplefilter("ignore", FutureWarning)
            setter("expandable_segments:True")
    except RuntimeError as e:  # pragma: no cover - an allocator without the option
        log.info("expandable segments not available: %s", e)


class AllocatorReading(NamedTuple):
    """One read of a device allocator's counters."""

    allocated: int  # bytes held by live tensors now
    peak_allocated: int  # the most since the last `reset_peaks`
    peak_reserved: int  # the most the allocator itself held since then (its cache too)


class AllocatorCounters:
    """[Note: reading the allocator] The tracer reads the device allocator at every moment
    of every iteration (about 600 moments for Llama-8B). `torch.cuda.memory_allocated`
    builds the whole statistics dict and flattens it in Python (50-150 us), and a traced
    moment read it three times more (the window's peaks). Here a moment is one read: the
    nested dict straight from the allocator (`memory_stats_as_nested_dict`, where the
    device module has it), which holds the count now and the peaks together. Devices
    without it (the test suite's) answer the three plain calls. `reads` counts reads."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.module = device_module(device)
        self._nested = getattr(self.module, "memory_stats_as_nested_dict", None)
        self.reads = 0

    def read(self) -> AllocatorReading:
        self.reads += 1
        if self._nested is not None:
            stats = self._nested(self.device)
            allocated, reserved = stats["allocated_bytes"]["all"], stats["reserved_bytes"]["all"]
            return AllocatorReading(allocated["current"], allocated["peak"], reserved["peak"])
        m, d = self.module, self.device
        allocated, peak = int(m.memory_allocated(d)), int(m.max_memory_allocated(d))
        return AllocatorReading(allocated, peak, int(m.max_memory_reserved(d)))

    def reset_peaks(self) -> None:
        self.module.reset_peak_memory_stats(self.device)


def host_threads() -> int:
    """[Note: host threads under torchrun] torchrun sets OMP_NUM_THREADS=1 for every rank
    when it starts more than one per node, so host Adam (the C++ kernel's OpenMP team)
    ran on one core: about 3 s per billion parameters a step. When torch runs on one
    thread for that reason (TORCHELASTIC_RUN_ID set and OMP_NUM_THREADS 1), the engine
    gives each rank its share of the cores this process may run on (divided by
    LOCAL_WORLD_SIZE); PSTAR_HOST_THREADS=N sets the count outright. Otherwise torch's
    own setting stands. Returns the thread count from here on (logged when changed)."""
    asked = os.environ.get("PSTAR_HOST_THREADS", "").strip()
    now = torch.get_num_threads()
    if asked:
        if not asked.isdigit() or int(asked) < 1:
            raise ValueError(f"PSTAR_HOST_THREADS must be a positive integer, got {asked!r}")
        want, why = int(asked), "PSTAR_HOST_THREADS"
    elif (
        now == 1
        and os.environ.get("OMP_NUM_THREADS") == "1"
        and "TORCHELASTIC_RUN_ID" in os.environ
    ):
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        want, why = max(1, (cores or 1) // local), "torchrun set OMP_NUM_THREADS=1"
    else:
        return now
    if want != now:
        torch.set_num_threads(want)
        log.info("host threads: %d, torch had %d (%s)", want, now, why)
    return want


def device_module(device: torch.device) -> Any:
    """`torch.cuda` for CUDA, the backend's module for another accelerator: where its
    allocator statistics are read (`memory_allocated`, `max_memory_allocated`,
    `reset_peak_memory_stats`)."""
    return getattr(torch, device.type)


def to_device(tree: Any, device: torch.device) -> Any:
    """Every tensor in `tree` (args, kwargs) on `device`; others as they are."""

    def move(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.device != device:
            return x.to(device, non_blocking=x.is_pinned())
        return x

    return tree_map(move, tree)


def rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    """The RNG states a checkpoint keeps: the CPU's, and this rank's device's only."""
    out = {"cpu": torch.get_rng_state()}
    if capabilities(device).rng:
        out["device"] = device_module(device).get_rng_state(device)
    return out


def set_rng_state(state: dict[str, torch.Tensor], device: torch.device) -> None:
    torch.set_rng_state(state["cpu"])
    saved = state.get("device", state.get("cuda"))  # "cuda": checkpoints before 2026-11
    if capabilities(device).rng and saved is not None:
        device_module(device).set_rng_state(saved, device)


class CopyStream:
    """Copies between host and device off the compute stream (see [Note: prefetch] in
    prefetch.py), one stream per direction as PCIe has a copy engine per direction.

    On a device with streams, copies run with `non_blocking=True` between pinned host
    memory and the device, so they overlap the compute stream's kernels and each other;
    an event marks each copy's end. Elsewhere (`enabled` False) nothing is issued: there
    is no copy engine to overlap with, and the move happens when the chunk is used.
    Written with torch's device-generic `Stream`/`Event`, so the test suite's second
    device (whose copies on a side stream only land once waited for) runs it.
    """

    def __init__(self, device: torch.device) -> None:
        self.enabled = capabilities(device).streams
        self.device = device
        # why streams: copies on the compute stream would wait for its kernels; why two:
        # an eviction's copy out need not wait for a prefetch's copy in
        self._to_device = torch.Stream(device=device) if self.enabled else None
        self._to_host = torch.Stream(device=device) if self.enabled else None

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> Any:
        """Start `dst.copy_(src)` on its direction's stream; the event to `wait` on."""
        stream = self._to_host if dst.device.type == "cpu" else self._to_device
        assert stream is not None
        # the device side was allocated or written on the compute stream (a block freed
        # a moment ago, a gradient backward just wrote): the copy starts after the
        # compute stream's work issued so far
        compute = torch.accelerator.current_stream(self.device)
        stream.wait_stream(compute)
        # torch.accelerator.set_stream, not `with stream`: torch.Stream is no context
        # manager in torch 2.6
        torch.accelerator.set_stream(stream)
        try:
            dst.copy_(src, non_blocking=True)
            done = torch.Event(device=self.device)
            done.record(stream)
        finally:
            torch.accelerator.set_stream(compute)
        # the device side is freed later on the compute stream: its block is not handed
        # out again before this copy is done
        (src if dst.device.type == "cpu" else dst).record_stream(stream)
        return done

    def wait(self, done: Any, host: bool = True) -> None:
        """The compute stream waits for the copy; with `host`, the host too (a copy out's
        bytes are read by the host). A copy in needs no host wait: its pinned source is
        given back only once its event says the copy is done (`Transfers`)."""
        torch.accelerator.current_stream(self.device).wait_event(done)
        if host:
            done.synchronize()
