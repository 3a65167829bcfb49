"""Whether a training model fits where its engine would run, asked before it is built:
the capacity planner's chunk plan of the base (with its adapters for LoRA, built on the
meta device: nothing allocated) gives the model data one engine holds, which must fit in
the memory its engine may use, or the create is a 400 that gives the numbers and what
would fit (LoRA instead of every weight, a smaller rank, a smaller base, more memory).

The memory: `PSTAR_DEFAULT_RESOURCES`' `memory_per_worker` when the deployment sets one
(what Ray reserves for the actor), else what this host has available now (the engine
runs here, or on a Ray worker of the embedded head, which is this host too).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

from service.errors import InvalidRequest

GiB = 2**30
# beside the chunks: the process's libraries, a step's activations and the engine's
# working buffers of a small batch (the planner's activation model needs a batch shape,
# which a session never declares)
MARGIN_BYTES = 1 * GiB


@dataclass(frozen=True)
class Fit:
    chunk_bytes: int  # the model data one engine holds (chunks: params, masters, Adam)
    budget_bytes: int  # the memory it may use
    dtype: str
    trainable_params: int
    params: int

    @property
    def fits(self) -> bool:
        return self.chunk_bytes + MARGIN_BYTES <= self.budget_bytes


def plan(base_path: Path, rank: int, targets: tuple[str, ...], dtype: str, workers: int = 1) -> Fit:
    """The chunk plan of the model as a session would build it (one engine of `workers`,
    its share of the chunks), against what this host has available now."""
    import psutil

    chunk_bytes, planned, trainable, params = _chunks(base_path, rank, targets, dtype, workers)
    return Fit(chunk_bytes, int(psutil.virtual_memory().available), planned, trainable, params)


@functools.lru_cache(maxsize=64)
def _chunks(
    base_path: Path, rank: int, targets: tuple[str, ...], dtype: str, workers: int
) -> tuple[int, str, int, int]:
    from pstar_core.capacity import arch_of, module_tensors
    from pstar_core.mapping import make_plan
    from pstar_core.precision import planned_dtype
    from service.adapters import wrap_meta
    from service.sessions.hosts import LORA_ALPHA
    from service.tools.planning import build_meta

    module = build_meta(str(base_path))
    config = module.config
    if rank:
        module = wrap_meta(
            module,
            {"r": rank, "alpha": LORA_ALPHA, "dropout": 0.0, "target_modules": list(targets)},
        )
    t = module_tensors(module, arch_of(config), 1)
    planned = planned_dtype(dtype, False)
    chunks = make_plan(t.numels, t.trainable, t.names, planned, "auto", workers)
    per_rank = sum(chunks.list_bytes(workers).values())
    return per_rank, planned, chunks.trainable_params, chunks.params


def check(
    base_id: str,
    base_path: Path,
    rank: int,
    targets: tuple[str, ...],
    dtype: str,
    budget: int | None,
    workers: int = 1,
) -> Fit:
    """`plan`, with the deployment's `budget` if it gives one; a 400 when it does not fit."""
    f = plan(base_path, rank, targets, dtype, workers)
    if budget is not None:
        f = Fit(f.chunk_bytes, budget, f.dtype, f.trainable_params, f.params)
    if f.fits:
        return f
    what = f"LoRA rank {rank}" if rank else "every weight (rank 0)"
    hint = (
        "train LoRA adapters (rank > 0) instead, which keeps the base in its compute dtype "
        "alone, or"
        if not rank
        else "use a smaller rank or"
    )
    each = f" per engine of {workers}" if workers > 1 else ""
    raise InvalidRequest(
        f"{base_id} with {what} needs {f.chunk_bytes / GiB:.2f} GiB of model data{each} "
        f"({f.params:,} parameters, {f.trainable_params:,} trained, {f.dtype}) plus "
        f"{MARGIN_BYTES / GiB:.0f} GiB beside it, and its engine may use "
        f"{f.budget_bytes / GiB:.2f} GiB; {hint} a smaller base model, more engines "
        "(user_metadata pstar_workers, with PSTAR_SESSION_ENGINES=ray), or give the "
        "engines more memory (PSTAR_DEFAULT_RESOURCES memory_per_worker)",
        param="base_model",
        code="model_does_not_fit",
    )
