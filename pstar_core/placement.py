"""Device-aware operator placement (the paper's DMM): where Adam runs for each chunk.

After a trace exists, the device's margin space is its budget minus the peak non-model
memory minus all param chunks (plus, under ZeRO, two gathered groups in flight, and on a
GPU the fused Adam's fp32 gradient buffer for one chunk). As many
optimizer-state chunk triples (fp32 master, momentum, variance) as fit there stay on the
device, and Adam runs there for them; the rest live and update on the host. Adam is
memory-bound, so either tier can run it; the forward and backward operators always run
on the device.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pstar_core.chunk import ChunkType
from pstar_core.kernels import adam_temporary_bytes

if TYPE_CHECKING:
    from pstar_core.manager import ChunkManager


def place_optimizer_states(m: ChunkManager) -> int:
    """Decide `m.device_adam` from the trace (again after a re-trace); the margin."""
    from pstar_core.manager import PARAM_LISTS, TRAINABLE_LISTS

    trace = m.tracer.trace
    m.device_adam.clear()
    if trace is None or m.memory.policy == "static":
        return 0
    params = sum(c.nbytes for c in m.own_chunks(PARAM_LISTS))
    if m.zero.enabled:  # two gathered groups may be in flight at once
        params += 2 * (m.zero.nproc - 1) * m.lists[ChunkType.PARAM][0].nbytes
    margin = m.residency.tiers["device"].budget_bytes - trace.peak_non_model - params
    left = margin
    if m.device.type != "cpu":
        # Adam on a GPU (torch's fused kernel) needs its fp32 gradient buffer; the warm-up
        # ran Adam on the host, so the trace never saw it (the C++ CPU kernel needs none)
        left -= adam_temporary_bytes(m.plan.chunk_size)
    for i, chunk in enumerate(m.lists[ChunkType.PARAM]):
        if not m.owned(chunk):
            continue
        triple = sum(m.lists[k][i].nbytes for k in TRAINABLE_LISTS[1:])
        if triple > left:
            break
        m.device_adam.add(i)
        left -= triple
    return margin


def adam_tier(m: ChunkManager, index: int) -> str:
    """Where Adam runs for trainable chunk `index` (the host until a trace exists)."""
    return "device" if index in m.device_adam else "host"
