"""`Engine.stats()`: every number the engine reports, each one measured or counted.

Chunks per list and tier, bytes and utilization, model data per parameter, bytes moved
between tiers (per direction, in total and in the last iteration), the tiers' budgets and
peaks, the tracer's numbers, ZeRO's collectives and bytes sent, the loss scaler and the
schedule. Read from the parts that count them; nothing here is kept between calls.
"""

from __future__ import annotations

from typing import Any

import torch

from pstar_core.chunk import TRAINABLE_LISTS, ChunkType
from pstar_core.excluded import ExcludedParams
from pstar_core.manager import ChunkManager
from pstar_core.mapping import Plan
from pstar_core.optim import LossScaler
from pstar_core.precision import Precision


def engine_stats(
    manager: ChunkManager,
    excluded: ExcludedParams,
    precision: Precision,
    scaler: LossScaler,
    *,
    load_peak_bytes: dict[str, int],
    global_step: int,
    lr: float,
) -> dict[str, Any]:
    """Measured numbers: chunks per list and tier, bytes, utilization, bytes moved."""
    m = manager
    plan, zero = m.plan, m.zero
    chunks: dict[str, dict[str, Any]] = {}
    model_bytes = 0
    for kind, lst in m.lists.items():
        tiers: dict[str, int] = {}
        lst = [c for c in lst if m.owned(c)]
        for c in lst:
            if c.tier is not None:
                tiers[c.tier] = tiers.get(c.tier, 0) + 1
        used = sum(c.used_elems for c in lst)
        esize = torch.empty((), dtype=lst[0].dtype).element_size() if lst else 0
        model_bytes += used * esize
        chunks[kind.value] = {
            "count": len(lst),
            "bytes": sum(c.nbytes for c in lst),
            "used_bytes": used * esize,
            "utilization": used / (len(lst) * plan.chunk_size) if lst else 1.0,
            "by_tier": tiers,
        }
    model_bytes += m.grad_accum.bytes + excluded.model_data_bytes()
    n_params = plan.params + excluded.numel  # of the whole model
    transfers = m.residency.transfers
    return {
        "dtype": precision.dtype,  # resolved: never 'auto'
        "compute_dtype": precision.dtype,
        "precision": precision.as_dict(),
        "chunk_size": plan.chunk_size,
        "params": n_params,
        "trainable_params": plan.trainable_params + excluded.trainable_numel,
        "chunks": chunks,
        "chunk_bytes": sum(c["bytes"] for c in chunks.values()) + m.grad_accum.bytes,
        "utilization": plan.utilization,
        "model_data_bytes": model_bytes,
        "model_data_bytes_per_param": model_bytes / n_params if n_params else 0.0,
        # frozen weights (a LoRA base) and trainable ones apart: ~2 and 14 in bf16
        "bytes_per_param": _bytes_per_param(chunks, plan, zero.nproc),
        "grad_accum_bytes": m.grad_accum.bytes,
        "peak_grad_accum_bytes": m.grad_accum.peak_bytes,
        "bytes_moved": dict(transfers.bytes_moved),
        "prefetched": dict(transfers.prefetched),
        # evictions that copied nothing back: the chunk's host copy was current
        "clean_evictions": transfers.clean_evictions,
        "host_copy_bytes": transfers.host_copy_bytes,
        "moves": dict(transfers.moves),
        "bytes_moved_last_iteration": dict(transfers.last_iteration_bytes_moved),
        "moves_last_iteration": dict(transfers.last_iteration_moves),
        "tiers": m.residency.tier_bytes(),
        "load_peak_bytes": dict(load_peak_bytes),  # per tier, while loading
        "tracer": m.tracer.stats(),
        "margin_bytes": m.margin_bytes,
        "device_adam_chunks": len(m.device_adam),
        "world_size": zero.nproc,
        "device": str(m.device),
        "threads": torch.get_num_threads(),
        "rank": zero.rank,
        "comm_bytes_sent": zero.bytes_sent,
        "comm_overlapped_reductions": zero.overlapped,
        "comm_gathered_ahead": m.groups.gathered_ahead,  # [Note: gathers ahead] in groups.py
        # of which an agreed section's script asked for without room ([Note: agreed
        # sections] in zero.py): the rank made room as for a gather at use
        "comm_gathered_ahead_made_room": m.groups.ahead_made_room,
        # own chunks a settle at the device's limit sent to the host ([Note: leaving the
        # group buffer] in groups.py)
        "comm_evicted_under_pressure": m.groups.evicted_under_pressure,
        "host_pool": m.residency.host_pool(),
        "comm_calls": {k: {"calls": c, "bytes": b} for k, (c, b) in zero.calls.items()},
        # in the failure flags' all-reduces ([Note: ranks fail together] in zero.py): their
        # round trip and the wait for the slowest rank to reach the same collective
        "comm_flag_s": zero.flag_s,
        "comm_flag_exchanges": zero.flag_checks,
        # sections run with no flags, on the collectives agreed for them ([Note: agreed
        # sections] in zero.py)
        "comm_agreed_sections": zero.agreed_sections,
        "comm_bytes_by_list": {k: dict(v) for k, v in zero.by_list.items()},
        "overflow_count": scaler.overflows,
        "loss_scale": scaler.scale,
        "global_step": global_step,
        "lr": lr,
    }


def _bytes_per_param(chunks: dict[str, dict[str, Any]], plan: Plan, nproc: int) -> dict[str, float]:
    """Model data per parameter of the frozen list and of the trainable lists, from the
    bytes this rank's chunks use (a rank holds 1/nproc of each list)."""
    frozen = chunks[ChunkType.FROZEN.value]["used_bytes"]
    trainable = sum(chunks[k.value]["used_bytes"] for k in TRAINABLE_LISTS)
    n_frozen = plan.params - plan.trainable_params
    return {
        "frozen": frozen * nproc / n_frozen if n_frozen else 0.0,
        "trainable": trainable * nproc / plan.trainable_params if plan.trainable_params else 0.0,
    }


__all__ = ["engine_stats"]
