"""The compute device: which one a rank uses, and the rules a GPU enforces, checked anywhere.

Everything CUDA-specific that is not a tier or a collective sits here:
- `resolve_device`: 'cuda' means this rank's GPU, `cuda:$LOCAL_RANK` (set as the current
  device, as torchrun and Ray Train expect); an explicit 'cuda:N' is taken as given;
- `to_device`: the inputs of a forward, moved by the engine (not left to the caller);
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
from typing import Any

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


def resolve_device(spec: str) -> torch.device:
    """The device a rank computes on, from the config's 'cpu', 'cuda' or 'cuda:N'."""
    if spec == "cpu":
        return torch.device("cpu")
    if not spec.startswith("cuda"):
        return _other_backend(spec)
    if not torch.cuda.is_available():
        raise RuntimeError(
            f"device {spec!r} asked for, but torch sees no CUDA device (this is a CPU build "
            f"or no GPU is visible); use device 'cpu'"
        )
    if spec == "cuda":  # pragma: no cover - CUDA only
        index = int(os.environ.get("LOCAL_RANK", torch.cuda.current_device()))
        device = torch.device("cuda", index)
    else:  # pragma: no cover - CUDA only
        device = torch.device(spec)
        shared = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) > 1
        if shared and torch.cuda.device_count() > 1:
            log.warning(
                "device %s is fixed in the config while %s ranks share this host: they all "
                "use it; say 'cuda' to give each rank cuda:$LOCAL_RANK",
                spec,
                os.environ["LOCAL_WORLD_SIZE"],
            )
    torch.cuda.set_device(device)  # pragma: no cover - CUDA only
    return device  # pragma: no cover - CUDA only


def _other_backend(spec: str) -> torch.device:
    """A device of another backend torch has loaded: in this project, the test suite's
    second device (`tests/fakedevice`, a `privateuse1` backend with its own memory)."""
    try:
        device = torch.device(spec)
    except RuntimeError as e:
        raise RuntimeError(
            f"device {spec!r} is not a torch device: {e}; use 'cpu' or 'cuda'"
        ) from e
    module = getattr(torch, device.type, None)
    if module is None or not module.is_available():
        raise RuntimeError(f"device {spec!r}: no backend for it is loaded; use 'cpu' or 'cuda'")
    return device if device.index is not None else torch.device(device.type, 0)


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
    """The RNG states a checkpoint keeps: the CPU's, and this rank's GPU's only."""
    out = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":  # pragma: no cover - CUDA only
        out["cuda"] = torch.cuda.get_rng_state(device)
    return out


def set_rng_state(state: dict[str, torch.Tensor], device: torch.device) -> None:
    torch.set_rng_state(state["cpu"])
    if device.type == "cuda" and "cuda" in state:  # pragma: no cover - CUDA only
        torch.cuda.set_rng_state(state["cuda"], device)


class CopyStream:
    """Host-to-device copies off the compute stream (see [Note: prefetch] in prefetch.py).

    On CUDA a dedicated stream runs prefetch copies with `non_blocking=True` from pinned
    host memory, so they overlap the kernels of the compute stream; an event marks each
    copy's end. Elsewhere (`enabled` False) nothing is issued: there is no copy engine
    to overlap with, and the move happens when the chunk is used. Not exercised on a
    machine without a GPU.
    """

    def __init__(self, device: torch.device) -> None:
        self.enabled = device.type == "cuda"
        self.device = device
        # [CUDA] why a stream: copies on the compute stream would wait for its kernels
        self.stream = torch.cuda.Stream(device) if self.enabled else None  # pragma: no cover

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> Any:  # pragma: no cover - CUDA
        """Start `dst.copy_(src)` on the copy stream; the event to `wait` on."""
        assert self.stream is not None
        # dst was allocated on the compute stream, maybe from a block it freed a moment
        # ago: the copy starts after the compute stream's work issued so far
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        dst.record_stream(self.stream)  # freed later on the compute stream: wait for us too
        return done

    def wait(self, done: Any) -> None:  # pragma: no cover - CUDA only
        """The compute stream waits for the copy; the host too, because the pinned source
        buffer goes back to the pool (and may be refilled from disk) right after."""
        torch.cuda.current_stream(self.device).wait_event(done)
        done.synchronize()
