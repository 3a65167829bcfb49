"""What every stage of the one-GPU acceptance run shares (`benchmarks/gpu_stages.py`,
run by `scripts/gpu_check.py`): the device and its synchronization, the models and
batches for a GPU and for the test suite's fake device, the timed training loop, the
probe run budgets are made from, and a stage's result."""

from __future__ import annotations

import contextlib
import dataclasses
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

NA = "n/a"


@dataclasses.dataclass(frozen=True)
class Sizes:
    """The models and batches of a run: real ones on a GPU, small ones on the fake device."""

    model: str  # a zoo name, or "small"
    seq: int
    batch: int
    resume_model: str
    warmup_steps: int = 2
    timed_steps: int = 5


GPU = Sizes(model="gpt-1b", seq=1024, batch=4, resume_model="gpt-100m")
SMALL = Sizes(model="small", seq=64, batch=4, resume_model="small")


def sizes_for(device: str) -> Sizes:
    return GPU if device.startswith("cuda") else SMALL


def gpt_config(name: str, seq: int):
    from pstar_core.models import GPTConfig, get_config

    if name == "small":
        return GPTConfig(hidden_size=128, num_layers=4, num_heads=4, vocab_size=1024, seq_len=seq)
    return dataclasses.replace(get_config(name), seq_len=seq)


def open_device(device: str):
    """Load the fake device when asked for; the torch.device of this process's GPU."""
    import torch

    if device.startswith("fakegpu"):
        from tests import fakedevice

        fakedevice.load()
    dev = torch.device(device)
    if dev.index is None:
        dev = torch.device(dev.type, 0)
    getattr(torch, dev.type).set_device(dev)
    return dev


def is_cuda(dev) -> bool:
    return dev.type == "cuda"


def gpu_only(dev, value: Any) -> Any:
    """A figure only a real GPU gives (speeds, CUDA's own counters), else "n/a"."""
    return value if is_cuda(dev) else NA


def sync(dev) -> None:
    import torch

    getattr(torch, dev.type).synchronize(dev)


def batches(cfg, sizes: Sizes, n: int, seed: int = 0) -> list:
    """Token batches on the host (the engine moves its inputs; the baselines move theirs)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, cfg.vocab_size, (sizes.batch, sizes.seq), generator=g) for _ in range(n)
    ]


def flops_per_token(cfg, params: int) -> int:
    """Model FLOPs of one token in training (forward and backward, no recomputation):
    6 per parameter, plus attention's scores and mixing, 12 x layers x hidden x sequence."""
    return 6 * params + 12 * cfg.num_layers * cfg.hidden_size * cfg.seq_len


def vm_hwm() -> int | None:
    """Peak resident memory of this process (VmHWM), where /proc has it."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return None


def reset_vm_hwm() -> bool:
    """Start VmHWM again from the resident memory now (Linux: clear_refs 5)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


@dataclasses.dataclass
class Timed:
    """What a run of `warmup + timed` steps measured."""

    losses: list[float]
    step_s: list[float]  # each timed step, wall time with the device synchronized
    fwd_bwd_s: list[float]  # of which forward and backward
    moved_in_fwd_bwd: dict[str, int]  # the last timed step's moves before its step()

    def median(self, xs: list[float]) -> float:
        return sorted(xs)[len(xs) // 2]

    def tflops(self, per_token: int, tokens: int) -> float:
        return per_token * tokens / self.median(self.step_s) / 1e12


def timed_steps(
    data: list, dev, warmup: int, forward_backward: Callable[[Any], Any], step: Callable[[], None]
) -> Timed:
    """Train on `data`: the first `warmup` steps untimed, each other step timed with the
    device synchronized at its boundaries, forward+backward apart from the optimizer's
    `step`; `forward_backward(batch)` returns the loss."""
    out = Timed([], [], [], {})
    for i, x in enumerate(data):
        sync(dev)
        t0 = time.perf_counter()
        loss = forward_backward(x)
        sync(dev)
        t1 = time.perf_counter()
        step()
        sync(dev)
        t2 = time.perf_counter()
        out.losses.append(float(loss.detach()))
        if i >= warmup:
            out.step_s.append(t2 - t0)
            out.fwd_bwd_s.append(t1 - t0)
    return out


def run_engine(engine, data: list, dev, warmup: int, beside: bool = False) -> Timed:
    """`timed_steps` of the engine (which moves each batch to its device itself), with the
    moves of the last step's forward and backward. With `beside`, each step is
    `backward_and_step` (host Adam beside backward): all of it is in `fwd_bwd_s`, and the
    moves are the whole iteration's."""
    moved: dict[str, int] = {}

    def forward_backward(x):
        loss = engine(input_ids=x, labels=x).loss
        if beside:
            engine.backward_and_step(loss)
        else:
            engine.backward(loss)
        transfers = engine.manager.residency.transfers
        moved.clear()  # (a step just ended has closed its iteration's counts)
        moved.update(
            transfers.last_iteration_bytes_moved if beside else transfers.iteration_bytes_moved
        )
        return loss

    step = (lambda: None) if beside else engine.step  # beside: stepped in forward_backward
    out = timed_steps(data, dev, warmup, forward_backward, step)
    out.moved_in_fwd_bwd = moved
    return out


def engine_config(device: str, memory: dict | None = None, **extra: Any) -> dict:
    return {
        "dtype": "bf16",
        "device": device,
        "chunk_size": "auto",
        "optimizer": {"lr": 1e-4, "weight_decay": 0.01},
        "memory": memory or {},
        **extra,
    }


@dataclasses.dataclass
class Result:
    status: str  # "pass", "fail"
    numbers: dict[str, Any]
    detail: str = ""


def probe(cfg, data: list, device: str, dev) -> dict[str, Any]:
    """The `stats()` of `cfg` after a run with no budget on `data` (what
    `benchmarks.doctor.budgets` takes)."""
    import torch

    import pstar_core
    from pstar_core.models import build

    torch.manual_seed(0)
    engine = pstar_core.initialize(lambda: build(cfg), engine_config(device))
    run_engine(engine, data, dev, warmup=len(data))
    st = engine.stats()
    engine.close()
    return st


def init_single_rank(dev) -> None:
    import torch.distributed as dist

    backend = "nccl" if is_cuda(dev) else f"cpu:gloo,{dev.type}:fakenccl"
    store = Path(tempfile.mkdtemp(prefix="pstar-gpu-check-")) / "pg"
    dist.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1)
