"""Memory tiers: the compute device, host memory, and disk spill files, each with a budget.

A tier allocates chunk payloads and counts the bytes it holds. The device tier is
`cuda:N` when there is a GPU, else the CPU with an enforced budget, so every code path
(eviction, placement, moves) runs on a machine without a GPU. A move between tiers is
always a real copy into a fresh buffer, and the old buffer is dropped.

[Note: CUDA] On CUDA the host tier would pin its buffers (`pin_memory=True`) so that
copies to the device can overlap compute. No test on a CPU-only machine exercises that
path; it is written to the torch documentation, not measured here.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import torch

from pstar_core.config import Budget, MemoryConfig


class MemoryBudgetError(MemoryError):
    """The model cannot be trained within the configured budgets; the message says why."""


def gib(n: float) -> str:
    """Bytes for people: GiB for big numbers, MiB or KiB for small budgets (tests, toys)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale or unit == "KiB":
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


@dataclass
class Tier:
    """One memory tier: a budget and the chunk bytes it holds now."""

    name: str  # "device", "host" or "disk"
    device: torch.device | None  # None for disk
    budget_bytes: int
    used_bytes: int = 0
    peak_bytes: int = 0
    directory: Path | None = None  # disk only
    pinned: bool = False
    files: set[Path] = field(default_factory=set)

    def free_bytes(self) -> int:
        return self.budget_bytes - self.used_bytes

    def add(self, nbytes: int) -> None:
        self.used_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.used_bytes)

    def remove(self, nbytes: int) -> None:
        self.used_bytes -= nbytes

    def allocate(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        assert self.device is not None, "the disk tier holds files, not tensors"
        return torch.empty(numel, dtype=dtype, device=self.device, pin_memory=self.pinned)

    def cleanup(self) -> None:
        for f in list(self.files):
            f.unlink(missing_ok=True)
        self.files.clear()


def host_memory_limit() -> int:
    """Physical memory, or the cgroup limit when a container sets a lower one."""
    limit = psutil.virtual_memory().total
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            limit = min(limit, int(text))
    return limit


def local_ranks() -> int:
    """Processes of this job on this host (torchrun and Ray set LOCAL_WORLD_SIZE)."""
    return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def _resolve(budget: Budget, whole: int) -> int:
    if budget is None:
        return whole
    if isinstance(budget, float):
        return int(budget * whole)
    return int(budget)


def make_tiers(cfg: MemoryConfig, device: torch.device) -> dict[str, Tier]:
    """Resolve the configured budgets into the three tiers."""
    host_whole = host_memory_limit() // local_ranks()
    if device.type == "cuda":
        dev_whole = torch.cuda.get_device_properties(device).total_memory
        pinned = True
    else:
        dev_whole = host_whole
        pinned = False
    tiers = {
        "device": Tier("device", device, _resolve(cfg.device_budget, dev_whole)),
        "host": Tier("host", torch.device("cpu"), _resolve(cfg.host_budget, host_whole)),
    }
    tiers["host"].pinned = pinned
    disk_dir = cfg.disk_dir or Path(os.environ.get("PSTAR_SPILL_DIR", "/tmp/pstar-spill"))
    disk_budget = 0
    if cfg.disk_budget:
        disk_dir.mkdir(parents=True, exist_ok=True)
        disk_budget = _resolve(cfg.disk_budget, shutil.disk_usage(disk_dir).free)
    tiers["disk"] = Tier("disk", None, disk_budget, directory=disk_dir)
    return tiers
