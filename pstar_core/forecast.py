"""One steady-state iteration of one engine rank, forecast without running it: where the
chunks are at each moment, the device and host peaks, and the bytes moved between them.

The engine decides from a trace of the non-model memory at each moment (an operator);
this module writes that trace from the activation model instead (`moments`) and then
applies the engine's own rules to it:
- device-aware placement: the margin is the device budget minus the peak non-model bytes
  of forward and backward minus the rank's param chunks (and, under ZeRO, two gathered
  groups; on an accelerator Adam's fp32 gradient buffer for one chunk); as many
  optimizer-state triples as fit there stay on the device and Adam runs there for them
  (`placement.place_optimizer_states`);
- at every moment the chunks an operator needs are on the device, and while the device's
  chunks and the non-model bytes of that moment or the next (whichever is more: the
  tracer's allowance) exceed the budget, the chunk whose next use is furthest away goes
  to the host (OPT, the paper's eviction);
- after backward, Adam runs on the host for the other chunks: their param chunk (holding
  its gradient) goes to the host and comes back at its next forward.
Two iterations are simulated from the start's placement and the second is reported, as
the engine's `*_last_iteration` stats are read after its warm-up.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from pstar_core.mapping import pack

_BLOCK = re.compile(r"^blocks\.(\d+)\.")


@dataclass(frozen=True)
class Moment:
    name: str
    tensors: tuple[int, ...]  # indices (in init order) of the parameters it uses
    non_model: int  # bytes


@dataclass(frozen=True)
class Forecast:
    device_peak_bytes: int  # chunks and non-model data, the most at any moment
    device_chunk_peak_bytes: int
    host_peak_bytes: int  # chunks on the host, the most at any moment
    host_to_device_bytes: int  # per iteration
    device_to_host_bytes: int
    device_adam_chunks: int
    margin_bytes: int
    least_device_bytes: int  # the smallest device budget the iteration runs in
    non_model_peak_bytes: int

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def moments(
    names: Sequence[str],
    hidden: int,
    layers: int,
    vocab: int,
    batch: int,
    seq: int,
    checkpointing: bool,
    act_bytes: int,
) -> list[Moment]:
    """The moments of one iteration of a zoo GPT (tied embedding and output layer) and the
    non-model bytes at each: activations kept block by block in forward (each block's
    input only with checkpointing, plus the block being computed), the logits at the
    output layer, then in backward the embedding's gradient on top of what is still kept,
    and three embedding-sized buffers at the embedding's own backward (the shape the
    engine's tracer measured, see `capacity.activation_peak_bytes`)."""
    full = 16 * batch * seq * hidden * act_bytes  # attention keeps no s x s scores (SDPA)
    kept = batch * seq * hidden * act_bytes if checkpointing else full
    logits = batch * seq * vocab * (act_bytes + 8)  # the logits, their fp32 softmax and loss
    emb = vocab * hidden * act_bytes
    grads = 12 * batch * seq * hidden * act_bytes  # a block's backward: its MLP's gradients
    index = {n: i for i, n in enumerate(names)}
    blocks: list[list[int]] = [[] for _ in range(layers)]
    other: dict[str, list[int]] = {"wte": [], "wpe": [], "ln_f": []}
    for i, n in enumerate(names):
        if m := _BLOCK.match(n):
            blocks[int(m.group(1))].append(i)
        else:
            other.setdefault(n.split(".")[0], []).append(i)
    wte = tuple(other["wte"]) or (index.get("wte.weight", 0),)
    out = [Moment("fwd:wte", wte, 0), Moment("fwd:wpe", tuple(other["wpe"]), 0)]
    for b in range(layers):
        working = full if checkpointing else 0
        out.append(Moment(f"fwd:blocks.{b}", tuple(blocks[b]), (b + 1) * kept + working))
    top = layers * kept
    out += [
        Moment("fwd:ln_f", tuple(other["ln_f"]), top),
        Moment("fwd:lm_head", wte, top + logits),
        Moment("bwd:lm_head", wte, top + logits),
        # the output layer's weight (the embedding's) is still held while its gradient
        # is written, at the next operator's start
        Moment("bwd:ln_f", tuple(other["ln_f"]) + wte, top + emb),
    ]
    for b in reversed(range(layers)):
        working = full if checkpointing else 0
        out.append(
            Moment(f"bwd:blocks.{b}", tuple(blocks[b]), (b + 1) * kept + working + grads + emb)
        )
    # the embeddings' backward holds the position embedding's chunk too (its gradient is
    # written in the same pass)
    both = wte + tuple(other["wpe"])
    out += [Moment("bwd:wpe", tuple(other["wpe"]), emb), Moment("bwd:wte", both, 3 * emb)]
    return out


def forecast(
    numels: Sequence[int],
    steps: Sequence[Moment],
    chunk_size: int,
    param_bytes: int,
    device_budget: int,
    nproc: int = 1,
    adam_temporary: int = 0,
) -> Forecast:
    """One rank's steady-state iteration (see the module docstring). Under ZeRO
    (`nproc` > 1) the rank owns one chunk of each communication group: an operator needs
    its groups gathered on the device (the other ranks' chunks arrive by collective and
    are dropped after use), and only the owned chunks stay, move and take Adam."""
    layout = pack(list(numels), chunk_size)
    n = -(-layout.num_chunks // nproc)  # communication groups: one owned chunk each
    chunk = chunk_size * param_bytes  # one param chunk
    others = (nproc - 1) * chunk  # a group's chunks of the other ranks, while gathered
    triple = chunk_size * 12  # fp32 master, momentum, variance
    of_tensor = [p.chunk_index // nproc for p in layout.placements]
    uses = [sorted({of_tensor[t] for t in m.tensors}) for m in steps]

    peak_nm = max((m.non_model for m in steps), default=0)
    # as `placement.place_optimizer_states`: two gathered groups may be in flight
    margin = device_budget - peak_nm - n * chunk - 2 * others
    left = margin - adam_temporary
    device_adam = 0
    while device_adam < n and triple <= left:
        left -= triple
        device_adam += 1
    pinned = device_adam * triple  # device-Adam states stay on the device

    # the access sequence of two iterations: every moment, then Adam's per chunk
    seq: list[tuple[str, list[int], int]] = []
    for _ in range(2):
        seq += [("op", u, m.non_model) for m, u in zip(steps, uses, strict=True)]
        seq += [("adam", [i], 0) for i in range(n)]
    next_use = _next_uses(seq, n)
    # the room a moment leaves for chunks: the engine's allowance is max(N_j, N_j+1)
    allowance = [max(seq[t][2], seq[t + 1][2] if t + 1 < len(seq) else 0) for t in range(len(seq))]
    group = chunk + others
    ops = [(u, a) for (kind, u, _), a in zip(seq, allowance, strict=True) if kind == "op"]
    least = max((len(u) * group + a for u, a in ops), default=0)

    on_device: set[int] = set(range(device_adam))  # at start: the warm-up placed these
    moved_in = moved_out = 0
    dev_peak = chunk_peak = host_peak = 0
    half = len(seq) // 2
    for t, (kind, need, nm) in enumerate(seq):
        counting = t >= half
        gathered = len(need) * others if kind == "op" else 0
        if kind == "adam":
            (i,) = need
            if i < device_adam:
                if i not in on_device:
                    on_device.add(i)
                    moved_in += chunk if counting else 0
            elif i in on_device:
                on_device.discard(i)
                moved_out += chunk if counting else 0
        else:
            for i in need:
                if i not in on_device:
                    on_device.add(i)
                    moved_in += chunk if counting else 0
            room = device_budget - pinned - gathered - allowance[t]
            while on_device and len(on_device) * chunk > room:
                spare = [i for i in on_device if i not in need]
                if not spare:
                    break  # the operator's own chunks: the engine says the budget is short
                far = max(spare, key=lambda i: next_use[t][i])
                on_device.discard(far)
                moved_out += chunk if counting else 0
        if counting:
            chunks_here = len(on_device) * chunk + gathered + pinned
            chunk_peak = max(chunk_peak, chunks_here)
            dev_peak = max(dev_peak, chunks_here + nm)
            off = n - len(on_device)
            host_peak = max(host_peak, off * chunk + (n - device_adam) * triple)
    return Forecast(
        device_peak_bytes=dev_peak,
        device_chunk_peak_bytes=chunk_peak,
        host_peak_bytes=host_peak,
        host_to_device_bytes=moved_in,
        device_to_host_bytes=moved_out,
        device_adam_chunks=device_adam,
        margin_bytes=margin,
        least_device_bytes=least,
        non_model_peak_bytes=peak_nm,
    )


def _next_uses(seq: list[tuple[str, list[int], int]], n: int) -> list[list[float]]:
    """For each position, when each chunk is next used (inf: not again)."""
    out: list[list[float]] = [[] for _ in seq]
    nxt = [math.inf] * n
    for t in range(len(seq) - 1, -1, -1):
        out[t] = list(nxt)
        for i in seq[t][1]:
            nxt[i] = t
    return out
