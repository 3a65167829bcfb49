"""Memory tiers: the compute device, host memory, and disk spill files, each with a budget.

A tier allocates chunk payloads and counts the bytes it holds. The device tier is the
compute device: an accelerator (`cuda:N`, or the test suite's second device), its budget
from what its memory can give when it has allocator statistics; or the CPU with an
enforced budget, so every code path (eviction, placement, moves) runs on a machine
without a GPU. A move between tiers is always a real copy into a fresh buffer, and the
old buffer is dropped.

On a device that can page-lock host memory the host tier's chunks live in one pool the
engine registers itself (see [Note: one pinned pool]); the test suite's second device
has that capability, so the pool's pinned path runs in the CPU tests.
"""

from __future__ import annotations

import enum
import mmap
import os
import shutil
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch

from pstar_core.config import Budget, MemoryConfig
from pstar_core.devices import capabilities, check, plannable_bytes, register_host, unregister_host


class TierName(enum.StrEnum):
    """The three tiers, nearest to the compute first. A `str` too, so stats, JSON and
    configuration keys (`memory.host_budget`) keep the plain names."""

    DEVICE = "device"
    HOST = "host"
    DISK = "disk"


DEVICE, HOST, DISK = TierName.DEVICE, TierName.HOST, TierName.DISK


class MemoryBudgetError(MemoryError):
    """The model cannot be trained within the configured budgets; the message says why."""


def gib(n: float) -> str:
    """Bytes for people: GiB for big numbers, MiB or KiB for small budgets (tests, toys)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale or unit == "KiB":
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


class SpillFile:
    """The disk tier's storage: one sparse file per engine, unlinked as soon as it is open.

    Nothing of it outlives the process, however it ends (a crash, SIGKILL, an OOM kill):
    the kernel frees an unlinked file's blocks when its last descriptor closes. A chunk
    spilled gets a region of its size (regions are reused); a region given back is
    punched out of the file (`fallocate(PUNCH_HOLE)`), so disk usage follows the chunks
    held, not the most ever held.
    """

    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"pstar-spill-{os.getpid()}-{uuid.uuid4().hex[:8]}.bin"
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.unlink(path)
        self.directory = directory
        self._end = 0
        self._free: dict[int, list[int]] = {}  # region size -> offsets of free regions

    def write(self, data: torch.Tensor) -> int:
        """Store a CPU tensor's bytes; the offset to read them back from."""
        check(data.device.type == "cpu", f"a {data.device} tensor is read as NumPy to spill it")
        raw = data.view(torch.uint8).numpy()
        size = raw.nbytes
        free = self._free.get(size)
        offset = free.pop() if free else self._end
        if offset == self._end:
            self._end += size
        view = memoryview(raw).cast("B")
        done = 0
        while done < size:
            done += os.pwrite(self.fd, view[done:], offset + done)
        return offset

    def read(self, offset: int, out: torch.Tensor) -> None:
        """Fill a CPU tensor with the bytes stored at `offset`."""
        check(out.device.type == "cpu", f"spilled bytes are read into a {out.device} tensor")
        view = memoryview(out.view(torch.uint8).numpy()).cast("B")
        done = 0
        while done < len(view):
            n = os.preadv(self.fd, [view[done:]], offset + done)
            if n == 0:
                raise OSError(f"spill file ended early at {offset + done}")
            done += n

    def free(self, offset: int, size: int) -> None:
        _punch_hole(self.fd, offset, size)
        self._free.setdefault(size, []).append(offset)

    def high_water_bytes(self) -> int:
        """The file's size: the most ever spilled at once (regions are reused)."""
        return self._end

    def disk_bytes(self) -> int:
        """Bytes the file really occupies on disk (its allocated blocks)."""
        return os.fstat(self.fd).st_blocks * 512

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 0x01, 0x02


def _punch_hole(fd: int, offset: int, size: int) -> None:
    """Give a file region's blocks back to the filesystem (Linux); elsewhere a no-op."""
    global _fallocate
    if _fallocate is None:
        import ctypes
        import ctypes.util

        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            fn = libc.fallocate
            fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
            _fallocate = fn
        except (OSError, AttributeError):
            _fallocate = False
    if _fallocate:
        _fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, offset, size)


_fallocate = None


_PAGE = mmap.PAGESIZE


class HostArena:
    """[Note: one pinned pool] Host chunks of a rank on an accelerator live in one buffer,
    sliced.

    Copies between page-locked host memory and a device run asynchronously, so the host
    tier is pinned. Pinning chunk by chunk would go through torch's caching host
    allocator, which rounds each block up to a power of two and never gives it back (about
    2x the chunk bytes for Llama-1B on 8 GPUs, for the life of the process). Instead, once
    materialization is over, the rank maps one ordinary buffer of the bytes its host tier
    can ever hold (its own chunks and their accumulation buffers, at most its budget) and
    slices it: a region per chunk, regions of one size reused first (chunks come in two
    sizes, 2 and 4 bytes per element). A chunk that finds no room (regions of the other
    size free, none of its own) gets an ordinary, unpinned buffer (its copies are
    synchronous) and is counted in `fallbacks`. `close()` unlocks and unmaps it.

    [Note: the pool grows as it fills] The mapping is address space only: a page costs
    memory once written. Page-locking (`devices.register_host`: cudaHostRegister on CUDA)
    makes every page of its range resident, so the pool is locked region by region, each
    when it is first handed out (a freed region stays locked for the next chunk of its
    size). Locking it whole at once made the pool resident before any chunk was copied
    in, beside the unpinned payloads it replaces: about 24 bytes per parameter at start in
    bf16 (an 8B model could not start on a 128 GiB machine), where now the peak is the
    payloads plus one region, and the accumulation buffers' part costs nothing until
    accumulation happens.

    [Note: one registration a region] A copy's host side must lie inside one page-locked
    range: CUDA answers a copy that runs from one registration into the next with
    cudaErrorInvalidValue. The pool was once locked in slices of 64 MiB: a chunk that
    straddled two slices failed at its first copy (an H200, the doctor's small model).
    So each region is its own registration, and regions start on page boundaries (their
    sizes rounded up to whole pages: `region_bytes`), so no two registrations share a
    page.
    """

    def __init__(self, nbytes: int, pin_for: torch.device | None) -> None:
        self.buffer = torch.frombuffer(mmap.mmap(-1, max(nbytes, 1)), dtype=torch.uint8)
        self.buffer = self.buffer[:nbytes]
        self.pinned_for = pin_for  # the device it is page-locked for, or None
        self.nbytes = nbytes
        self._end = 0
        self._regions: list[int] = []  # the start of every region handed out (each locked)
        self._free: dict[int, list[int]] = {}  # region size -> free offsets
        self._live: dict[int, tuple[int, int]] = {}  # data_ptr -> (offset, size)
        self.fallbacks = 0

    @staticmethod
    def region_bytes(numel: int, dtype: torch.dtype) -> int:
        """The pool bytes a payload of `numel` elements of `dtype` takes: whole pages."""
        return -(-numel * dtype.itemsize // _PAGE) * _PAGE

    @property
    def live_bytes(self) -> int:
        return sum(size for _, size in self._live.values())

    @property
    def locked_bytes(self) -> int:
        """Bytes of the pool page-locked so far (every region handed out, live or free)."""
        return self._end if self.pinned_for is not None else 0

    def allocate(self, numel: int, dtype: torch.dtype) -> torch.Tensor | None:
        size = self.region_bytes(numel, dtype)
        free = self._free.get(size)
        if free:
            offset = free.pop()
        elif self._end + size <= self.nbytes:
            offset, self._end = self._end, self._end + size
            if self.pinned_for is not None:
                register_host(self.pinned_for, self.buffer[offset : self._end])
            self._regions.append(offset)
        else:
            self.fallbacks += 1
            return None
        t = self.buffer[offset : offset + numel * dtype.itemsize].view(dtype)
        self._live[t.data_ptr()] = (offset, size)
        return t

    def owns(self, t: torch.Tensor) -> bool:
        return t.data_ptr() in self._live

    def free(self, t: torch.Tensor) -> None:
        region = self._live.pop(t.data_ptr(), None)
        if region is not None:
            self._free.setdefault(region[1], []).append(region[0])

    def close(self) -> None:
        """Unlock the pool (its memory goes when the last view of it does)."""
        if self.pinned_for is not None:
            for start in self._regions:
                unregister_host(self.pinned_for, self.buffer[start:])
            self.pinned_for = None
        self._regions.clear()


@dataclass
class Tier:
    """One memory tier: a budget and the chunk bytes it holds now."""

    name: TierName
    device: torch.device | None  # None for disk
    budget_bytes: int
    used_bytes: int = 0
    peak_bytes: int = 0
    window_peak_bytes: int = 0  # the most held since the tracer's current moment began
    compute_low_bytes: int = 0  # the least held since the operator's chunks were in place
    iteration_peak_bytes: int = 0  # the most held in the iteration under way
    last_iteration_peak_bytes: int = 0  # ... in the last complete iteration
    directory: Path | None = None  # disk only
    pin_for: torch.device | None = None  # host: the device its pool is page-locked for
    spill: SpillFile | None = None  # disk only, opened on first use
    use_arena: bool = False  # host of an accelerator rank: chunks sliced from one pool
    arena: HostArena | None = None  # made by `make_arena` once the rank's chunks are known

    def add(self, nbytes: int) -> None:
        self.used_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.used_bytes)
        self.window_peak_bytes = max(self.window_peak_bytes, self.used_bytes)
        self.iteration_peak_bytes = max(self.iteration_peak_bytes, self.used_bytes)

    def new_iteration(self) -> None:
        self.last_iteration_peak_bytes = self.iteration_peak_bytes
        self.iteration_peak_bytes = self.used_bytes

    def new_window(self) -> int:
        """Start a new moment's window; the peak of the window that ends."""
        peak, self.window_peak_bytes = self.window_peak_bytes, self.used_bytes
        return peak

    def remove(self, nbytes: int) -> None:
        self.used_bytes -= nbytes
        self.compute_low_bytes = min(self.compute_low_bytes, self.used_bytes)

    def start_compute(self) -> None:
        """The operator's chunks are in place: from here the tracer takes the least chunk
        bytes held as C_i (see [Note: C_i on an accelerator] in tracer.py)."""
        self.compute_low_bytes = self.used_bytes

    def allocate(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A chunk payload. In host memory it is a slice of the pinned pool when there is
        one and it has room, else its own anonymous mapping (never the caching host
        allocator's pinned blocks, see [Note: one pinned pool]): glibc's malloc keeps freed
        blocks below its moving mmap threshold (up to 32 MiB) for reuse, so chunks that
        move between tiers would leave the process holding far more than its budgets
        (seen: a 2 GiB cap reached with 1.6 GiB of chunks); a mapping goes back to the
        system when the chunk lets it go."""
        assert self.device is not None, "the disk tier holds files, not tensors"
        if self.arena is not None:
            t = self.arena.allocate(numel, dtype)
            if t is not None:
                return t
        if self.device.type == "cpu":
            size = numel * torch.empty((), dtype=dtype).element_size()
            return torch.frombuffer(mmap.mmap(-1, size), dtype=dtype, count=numel)
        return torch.empty(numel, dtype=dtype, device=self.device)

    def release(self, payload: torch.Tensor) -> None:
        """A payload leaves this tier (moved, forgotten or replaced): its arena region,
        if it has one, is free again."""
        if self.arena is not None:
            self.arena.free(payload)

    def make_arena(self, nbytes: int) -> None:
        """The pinned pool, `nbytes` exactly (see [Note: one pinned pool])."""
        self.arena = HostArena(nbytes, pin_for=self.pin_for)

    def spill_file(self) -> SpillFile:
        assert self.directory is not None, "only the disk tier has a spill file"
        if self.spill is None:
            self.spill = SpillFile(self.directory)
        return self.spill

    def close(self) -> None:
        if self.spill is not None:
            self.spill.close()
            self.spill = None
        if self.arena is not None:
            self.arena.close()


def return_freed_host_memory() -> None:
    """Collect garbage cycles and hand the C allocator's free memory back to the system.

    The host budget counts the chunks; memory the process has freed but glibc keeps
    (fragmented arenas) still counts against a container's limit. After a burst of
    short-lived allocations (streaming a model in, the CPU tracer's profile of the
    warm-up, whose event tree is a graph of Python objects freed only by the cycle
    collector) this returned a few hundred MB in `pstar bench lora`'s scale runs.
    """
    import gc

    gc.collect()
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


class FreedMemory:
    """Hands glibc's free memory back when a step ends holding `slack` bytes more than a
    step needs, checked at the end of each iteration (one RSS read, ~50 us; a trim takes
    ~20-40 ms at 1 GiB). Chunk moves and Adam's temporaries free memory that glibc keeps:
    `pstar bench lora`'s engine grew 15-40 MB per step without it.

    [Note: what a step needs] A step's activations, gradients and logits are freed at its
    end and allocated again by the next step; glibc keeps that memory, so the RSS at the
    end of a step includes it. Trimming it back would make the next step fault every page
    in again (75k page faults for 300 MB): measured on gpt-45m, trimming at every step made
    the engine's matmuls ~10% slower than plain torch's, the whole step 1.06x plain fp32
    PyTorch. So the reference (`base`) is the RSS at a step's end, not after a trim: the
    first check takes it as it is, and a trim that the next step took back whole (within
    `slack / 4`) shows the footprint grew (a longer batch), which becomes the reference.
    Growth step over step (fragmentation) is still given back once it passes `slack`.
    """

    def __init__(
        self,
        slack: int = 64 * 2**20,
        rss: Callable[[], int] | None = None,
        trim: Callable[[], None] | None = None,
    ) -> None:
        self.slack = slack
        process = psutil.Process()
        self._rss = rss or (lambda: process.memory_info().rss)
        self._trim = trim or (lambda: _LIBC.malloc_trim(0))
        self.enabled = trim is not None or _LIBC is not None
        self.base: int | None = None  # the RSS a step ends with (see the note)
        self._returned_at: int | None = None  # the RSS the last trim started from
        self.trims = 0

    def maybe_return(self) -> None:
        if not self.enabled:
            return
        rss = self._rss()
        if self.base is None:
            self.base = rss
            return
        if self._returned_at is not None and rss >= self._returned_at - self.slack // 4:
            self.base = max(self.base, rss)  # the step took it all back: it needs it
        self._returned_at = None
        if rss > self.base + self.slack:
            self._trim()
            self.trims += 1
            self._returned_at = rss


def _load_libc():
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "malloc_trim") else None  # glibc only
    except OSError:
        return None


_LIBC = _load_libc()


def host_memory_available() -> int:
    """What this host can still give: the kernel's MemAvailable, or, in a container whose
    cgroup sets a lower limit, that limit less the cgroup's working set (its usage less
    the page cache it can drop, as the kubelet counts it)."""
    available = psutil.virtual_memory().available
    cgroups = (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current", "inactive_file"),
        (
            "/sys/fs/cgroup/memory/memory.limit_in_bytes",
            "/sys/fs/cgroup/memory/memory.usage_in_bytes",
            "total_inactive_file",
        ),
    )
    for limit_path, usage_path, inactive in cgroups:
        try:
            limit_text = Path(limit_path).read_text().strip()
            usage = int(Path(usage_path).read_text().strip())
            stat = Path(limit_path).with_name("memory.stat").read_text()
        except (OSError, ValueError):
            continue
        if not limit_text.isdigit() or int(limit_text) >= psutil.virtual_memory().total:
            continue
        cache = next(
            (int(line.split()[1]) for line in stat.splitlines() if line.split()[0] == inactive),
            0,
        )
        available = min(available, int(limit_text) - (usage - cache))
    return max(0, available)


HOST_MARGIN_BYTES = 2 * 2**30
HOST_MARGIN_SHARE = 0.1


def host_share(ranks: int | None = None) -> int:
    """[Note: the default host budget] What one rank's host tier may plan with when no
    budget is set: the memory available when the engine starts (`host_memory_available`:
    other processes' and this one's own memory are already out of it) less a margin for
    everything else the processes still need (Python, the CUDA runtime's host memory,
    activations when the CPU is the device, data loading): max(2 GiB, 10 %), the rest
    shared between the ranks of this host (`ranks`, default `local_ranks()`). Never all of
    RAM: the pinned pool is locked memory, and a budget the size of RAM let it lock all of
    it. An engine reads it as it starts, before its first collective, so the ranks of a
    host read it before any of them has made a chunk: a rank reading it after another had
    filled its share would get less than its equal part."""
    available = host_memory_available()
    margin = max(HOST_MARGIN_BYTES, int(HOST_MARGIN_SHARE * available))
    return max(0, available - margin) // (ranks or local_ranks())


def reserved_share(reserved: int) -> int:
    """What a rank for which a scheduler reserved `reserved` bytes plans with: the
    reservation less the margin `host_share` keeps (the process itself, activations on a
    CPU device, data loading). Its host budget is taken from this, so jobs sharing a host
    stay within what each reserved."""
    return max(0, reserved - max(HOST_MARGIN_BYTES, int(HOST_MARGIN_SHARE * reserved)))


def host_whole(reserved: int | None = None, ranks: int | None = None) -> int:
    """What one rank's budgets are taken from: its share of the host (`host_share`), and
    never more than a scheduler's reservation leaves it (`reserved_share`)."""
    whole = host_share(ranks)
    return whole if reserved is None else min(whole, reserved_share(reserved))


def local_ranks() -> int:
    """Processes of this job on this host (torchrun and Ray set LOCAL_WORLD_SIZE)."""
    return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def _host_budget(cfg: MemoryConfig) -> Budget:
    """memory.host_budget, or else PSTAR_HOST_BUDGET (bytes, or a fraction of the host
    share, `host_share`): how a deployment keeps the host tier under its pods' memory limit without
    every job saying so (k8s/: the worker pods' environment sets it)."""
    if cfg.host_budget is not None:
        return cfg.host_budget
    raw = os.environ.get("PSTAR_HOST_BUDGET", "").strip()
    if not raw:
        return None
    try:
        value: Budget = float(raw) if "." in raw else int(raw)
    except ValueError:
        value = -1
    if (isinstance(value, float) and not 0 < value <= 1) or (isinstance(value, int) and value < 0):
        raise ValueError(
            f"PSTAR_HOST_BUDGET must be bytes (an integer) or a fraction in (0, 1] such as "
            f"0.7, got {raw!r}"
        )
    return value


def _resolve(budget: Budget, whole: int) -> int:
    if budget is None:
        return whole
    if isinstance(budget, float):
        return int(budget * whole)
    return int(budget)


def make_tiers(
    cfg: MemoryConfig, device: torch.device, host_whole: int | None = None
) -> dict[TierName, Tier]:
    """Resolve the configured budgets into the three tiers; `host_whole` is the host
    share a budget is taken from (`host_share()` now, by default)."""
    host_whole = host_share() if host_whole is None else host_whole
    caps = capabilities(device)
    # an accelerator: what its memory can give us; the CPU as the device: the host's
    dev_whole = plannable_bytes(device, cfg.device_safety) if caps.allocator_stats else host_whole
    device_budget, host_budget = _resolve(cfg.device_budget, dev_whole), _host_budget(cfg)
    host = Tier(TierName.HOST, torch.device("cpu"), _resolve(host_budget, host_whole))
    tiers = {TierName.DEVICE: Tier(TierName.DEVICE, device, device_budget), TierName.HOST: host}
    host.pin_for = device if caps.pinned_host else None
    # PSTAR_HOST_ARENA=1 slices the host tier from one (unpinned) buffer on a machine
    # without a GPU too, so the pool's bookkeeping runs in CPU tests
    host.use_arena = caps.pinned_host or os.environ.get("PSTAR_HOST_ARENA") == "1"
    disk_dir = cfg.disk_dir or Path(os.environ.get("PSTAR_SPILL_DIR", "/tmp/pstar-spill"))
    disk_budget = 0
    if cfg.disk_budget:
        disk_dir.mkdir(parents=True, exist_ok=True)
        disk_budget = _resolve(cfg.disk_budget, shutil.disk_usage(disk_dir).free)
    tiers[TierName.DISK] = Tier(TierName.DISK, None, disk_budget, directory=disk_dir)
    return tiers
