"""Device-aware operator placement (the paper's DMM): where Adam runs for each chunk.

After a trace exists, the device's margin space is its budget minus the peak non-model
memory of forward and backward minus all param chunks (plus, under ZeRO, two gathered
groups in flight, and on an accelerator the fused Adam's fp32 gradient buffer for one
chunk). As many
optimizer-state chunk triples (fp32 master, momentum, variance) as fit there stay on the
device, and Adam runs there for them; the rest live and update on the host. Adam is
memory-bound, so either tier can run it; the forward and backward operators always run
on the device.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from pstar_core.chunk import PARAM_LISTS, TRAINABLE_LISTS, Chunk, ChunkType
from pstar_core.kernels import adam_temporary_bytes
from pstar_core.tiers import TierName

if TYPE_CHECKING:
    from pstar_core.tracer import Trace

ADAM_MOMENT = "adam."  # the moment of Adam on trainable chunk i is named f"adam.{i}"
FORWARD_MOMENT = "fwd:"  # a module's forward is the moment f"fwd:{name}"
BACKWARD_MOMENT = "bwd:"  # and its backward f"bwd:{name}"


def place_optimizer_states(
    trace: Trace | None,
    lists: Mapping[ChunkType, Sequence[Chunk]],
    owned: Callable[[Chunk], bool],
    *,
    device_budget_bytes: int,
    nproc: int,
    chunk_size: int,
    device: torch.device,
    keep: set[int] | None = None,
) -> tuple[set[int], int]:
    """The trainable chunks whose Adam runs on the device, decided from the trace (again
    after a re-trace), and the margin; none and 0 without a trace. `keep`, where given
    and it fits the margin, is the answer instead: the placement of the run a checkpoint
    continues ([Note: a resumed run places as the run it continues]).

    The margin comes from the peak non-model memory of the forward and backward moments
    only: Adam's own moments measured whatever tier the traced step happened to update
    each chunk on (the host in a first warm-up; the device after a resume, see
    `checkpoint`), and a decision that depended on it would not be the same twice. What
    Adam itself needs on the device is reserved explicitly instead: its temporaries are
    set aside in the trace at the device-Adam moments (`Trace.reserved`, not written into
    the measurements), so A_j there leaves room for them.
    """
    device_adam: set[int] = set()
    if trace is None:
        return device_adam, 0
    params = sum(c.nbytes for kind in PARAM_LISTS for c in lists[kind] if owned(c))
    peak = max(
        (
            n
            for name, n in zip(trace.names, trace.non_model, strict=False)
            if not is_adam_moment(name)
        ),
        default=0,
    )
    margin = device_margin(
        device_budget_bytes, peak, params, nproc, lists[ChunkType.PARAM][0].nbytes
    )
    temporary = adam_temporary_bytes(chunk_size, device)
    left = margin - temporary
    triples = {
        i: sum(lists[k][i].nbytes for k in TRAINABLE_LISTS[1:])
        for i, chunk in enumerate(lists[ChunkType.PARAM])
        if owned(chunk)
    }
    if keep is not None and keep <= triples.keys() and sum(triples[i] for i in keep) <= left:
        device_adam = set(keep)
    else:
        for i, triple in triples.items():
            if triple > left:
                break
            device_adam.add(i)
            left -= triple
    _reserve_adam_temporaries(trace, device_adam, temporary)
    return device_adam, margin


def device_margin(
    budget: int, peak_non_model: int, own_param_bytes: int, nproc: int, chunk_bytes: int
) -> int:
    """The device's room for optimizer states (the paper's margin space): its budget less
    the peak non-model memory of forward and backward, this rank's param and frozen chunks,
    and under ZeRO two gathered groups of the other ranks' chunks (`chunk_bytes` each),
    which may be in flight at once. The engine's placement and the planner's forecast
    both read it here."""
    in_flight = 2 * (nproc - 1) * chunk_bytes if nproc > 1 else 0
    return budget - peak_non_model - own_param_bytes - in_flight


def is_adam_moment(moment_name: str) -> bool:
    return moment_name.startswith(ADAM_MOMENT)


def _reserve_adam_temporaries(trace: Trace, device_adam: set[int], temporary: int) -> None:
    """At the moments of Adam on the device, room for what the kernel allocates there (a
    warm-up that ran them on the host measured nothing on the device): set aside in
    `trace.reserved`, beside the measured N_j (each placement replaces the last's)."""
    trace.reserved.clear()
    if not temporary:
        return
    for j, name in enumerate(trace.names):
        if is_adam_moment(name) and int(name[len(ADAM_MOMENT) :]) in device_adam:
            trace.reserved[j] = temporary


def adam_tier(device_adam: set[int], index: int) -> TierName:
    """Where Adam runs for trainable chunk `index` (the host until a trace exists)."""
    return TierName.DEVICE if index in device_adam else TierName.HOST


def moment_tier(device_adam: set[int], moment_name: str) -> TierName:
    """Where the chunks a moment uses are read: Adam's tier at an Adam moment, the device
    at an operator's."""
    if is_adam_moment(moment_name):
        return adam_tier(device_adam, int(moment_name[len(ADAM_MOMENT) :]))
    return TierName.DEVICE


def saved(device: torch.device, device_budget_bytes: int, device_adam: set[int]) -> dict[str, Any]:
    """Where Adam ran for each chunk, as a checkpoint keeps it: a resumed engine's first
    (warm-up) step updates the same chunks on the same tier, so it runs the same kernels
    as the run it continues (a fused device kernel and the host's differ in the last
    bits)."""
    return {
        "device": device.type,
        "device_budget": device_budget_bytes,
        "device_adam": sorted(device_adam),
    }


def restored(
    saved: dict[str, Any] | None,
    device: torch.device,
    device_budget_bytes: int,
    num_chunks: int,
) -> tuple[set[int], bool] | None:
    """The chunks whose Adam ran on the device in the run being continued, for this
    engine's warm-up step: on the same kind of device with at least its budget (a smaller
    one may not hold those chunks; the step is then as any warm-up's, on the host); None
    where that does not hold. And whether the budget is the same: then the placement is
    kept after this engine's own trace too, while it fits.

    [Note: a resumed run places as the run it continues] A trace depends on the step it
    traced: the batch, what was resident, what the process had allocated before. On an
    H200 the resumed run's first trace found room for both trainable chunks' states where
    the original run's had found room for one; placing again moved a chunk's Adam to the
    other tier, whose kernel rounds differently, and the resumed run was no longer the
    run it continued. With the same budget the run keeps the placement it continues as
    long as its own trace says that placement fits; with a larger budget it places
    again (the room is the point of moving to a larger device)."""
    if saved is None or saved["device"] != device.type:
        return None
    if device_budget_bytes < saved["device_budget"]:
        return None
    chunks = {i for i in saved["device_adam"] if i < num_chunks}
    return chunks, device_budget_bytes == saved["device_budget"]
