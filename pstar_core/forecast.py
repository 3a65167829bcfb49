"""One steady-state iteration of one engine rank, forecast without running it: where the
chunks are at each moment, the device and host peaks, and the bytes moved between them.

The engine decides from a trace of the non-model memory at each moment (an operator);
this module writes that trace from the activation model instead (`moments`: any decoder
stack whose parameters are named by layer, as the zoo's GPT and transformers' models
are) and then
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
- after backward, Adam runs on the host for the other trainable chunks: their param chunk
  (holding its gradient) goes to the host and comes back at its next forward. Frozen
  chunks (a LoRA job's base) have no gradient and stay where they are;
- a chunk moved to the device keeps its host copy until something may write it there
  (backward's gradients, Adam; under ZeRO every gather): evicted before that, it moves
  no bytes ([Note: clean chunks] in transfers.py).
Two iterations are simulated from the start's placement and the second is reported, as
the engine's `*_last_iteration` stats are read after its warm-up.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from pstar_core.eviction import farthest_first
from pstar_core.mapping import BYTES_OPTIMIZER_STATES, BYTES_PARAM, Plan
from pstar_core.placement import device_margin

_LAYER = re.compile(r"(?:^|\.)(\d+)\.")


@dataclass(frozen=True)
class Arch:
    """What the activation model needs of a decoder stack."""

    hidden: int
    layers: int
    vocab: int
    intermediate: int  # the MLP's inner width (4 x hidden in GPT-2's blocks)
    tied: bool = True  # the output layer is the token embedding
    gated: bool = False  # a gated MLP (Llama's gate and up projections)
    kv_hidden: int | None = None  # keys' (and values') width, if narrower (grouped queries)

    def layer_bytes(self, act_bytes: int) -> int:
        """Bytes one layer keeps per token for its backward. GPT-2's block: its
        attention's inputs and output (4 h; SDPA keeps no s x s scores) and its MLP's 3
        inner activations (3 x 4 h), 16 h values as the tracer measured. A Llama layer:
        two norms' inputs and outputs, queries, keys and values, the attention's output
        and its projection (7 h + 2 kv), the gated MLP's gate, up, activation and product
        (4 x inner); below fp32 its two RMSNorms also keep an fp32 copy of their input
        (8 h bytes)."""
        h, inner = self.hidden, self.intermediate
        if not self.gated:
            return (4 * h + 3 * inner) * act_bytes
        upcast = 8 * h if act_bytes < 4 else 0
        return (7 * h + 2 * (self.kv_hidden or h) + 4 * inner) * act_bytes + upcast

    def layer_matmul_params(self) -> int:
        """Weights one layer multiplies each token by: queries, keys and values (keys and
        values narrower under grouped queries), the attention's output, the MLP (a gated
        one has three matrices)."""
        h, kv = self.hidden, self.kv_hidden or self.hidden
        return h * (h + 2 * kv) + h * h + (3 if self.gated else 2) * h * self.intermediate


@dataclass(frozen=True)
class Moment:
    name: str
    tensors: tuple[int, ...]  # indices (in init order) of the parameters it uses
    non_model: int  # bytes
    flops: float = 0.0  # the operator's work (a backward one's includes its recompute)


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
    # with `Rates` (else 0): the iteration's time, and what it would be with every copy
    # and collective free (its compute and Adam, overlapped as `Rates` says); its model
    # FLOPs, recompute included
    step_seconds: float = 0.0
    compute_seconds: float = 0.0
    flops: float = 0.0
    phase_seconds: dict[str, float] = field(default_factory=dict)  # forward, backward, ...

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Rates:
    """How fast one rank's parts work, for the time an iteration takes (`forecast`)."""

    flops_per_s: float  # what the device's matmuls reach (not its peak)
    host_to_device_bytes_per_s: float  # the link, each way (PCIe has an engine each way)
    device_to_host_bytes_per_s: float
    host_adam_params_per_s: float  # Adam on the host: this rank's share of it
    device_adam_params_per_s: float = math.inf
    collective_bytes_per_s: float = math.inf  # a rank's all-gather or reduce-scatter
    latency_s: float = 10e-6  # each copy's
    # as `MemoryConfig`: a chunk is sent for while the next prefetch_moments operators
    # run, or earlier while fewer than prefetch_chunks are on their way
    prefetch_moments: int = 2
    prefetch_chunks: int = 2
    # as `Engine.backward_and_step`: a chunk's Adam on the host starts once its gradients
    # are there, beside backward, on a thread of its own ([Note: Adam beside backward])
    adam_beside_backward: bool = True


@dataclass
class _Position:
    """What the placement simulation did at one position of the access sequence."""

    kind: str  # "op" (forward), "bwd" or "adam"
    need: list[int]
    flops: float = 0.0
    moved_in: list[int] = field(default_factory=list)  # chunks copied to the device
    copied_out: list[int] = field(default_factory=list)  # chunks copied to the host
    for_adam: set[int] = field(default_factory=set)  # of those, ones Adam reads next


def moments(
    names: Sequence[str],
    arch: Arch,
    batch: int,
    seq: int,
    checkpointing: bool,
    act_bytes: int,
) -> list[Moment]:
    """The moments of one iteration and the non-model bytes at each: activations kept
    layer by layer in forward (each layer's input only with checkpointing, plus the layer
    being computed), the logits at the output layer, then in backward the output layer's
    weight gradient on top of what is still kept, and three embedding-sized buffers at
    the embedding's own backward (the shape the engine's tracer measured, see
    `benchmarks/plan_check.py`). Parameters are grouped by the first number in their names (the
    layer); those before the first layer are the embeddings, those after it the final
    norm and an untied output layer (`lm_head`)."""
    h, b, s = arch.hidden, batch, seq
    full = arch.layer_bytes(act_bytes) * b * s
    kept = b * s * h * act_bytes if checkpointing else full
    grads = 3 * arch.intermediate * b * s * act_bytes  # a layer's backward: its MLP's gradients
    # the logits, their fp32 softmax and loss gradient: 12 bytes a logit in any compute dtype
    # (the loss upcasts; measured the same in bf16 and fp32)
    logits = b * s * arch.vocab * 12
    emb = arch.vocab * h * act_bytes
    layers: list[list[int]] = [[] for _ in range(arch.layers)]
    before: list[int] = []
    after: list[int] = []
    for i, n in enumerate(names):
        m = _LAYER.search(n)
        if m and int(m.group(1)) < arch.layers:
            layers[int(m.group(1))].append(i)
        elif any(layers):
            after.append(i)
        else:
            before.append(i)
    head = tuple(i for i in after if "lm_head" in names[i])
    final = tuple(i for i in after if i not in head)
    token = (max(before, key=lambda i: _size_rank(names[i])),) if before else ()
    if arch.tied or not head:
        head = token
    # FLOPs, 2 a multiply-add: a layer's matmuls and its attention's scores and mixing
    # (4 s h a token, causal masking not discounted, as the paper and Megatron count);
    # backward twice forward, plus the forward again where checkpointing recomputes it
    tokens = b * s
    layer_fwd = 2.0 * tokens * arch.layer_matmul_params() + 4.0 * tokens * s * h
    layer_bwd = (3.0 if checkpointing else 2.0) * layer_fwd
    head_fwd = 2.0 * tokens * h * arch.vocab
    out = [Moment("fwd:embeddings", tuple(before), 0)]
    working = full if checkpointing else 0
    for k in range(arch.layers):
        out.append(Moment(f"fwd:layer.{k}", tuple(layers[k]), (k + 1) * kept + working, layer_fwd))
    top = arch.layers * kept
    out += [
        Moment("fwd:final", final, top),
        Moment("fwd:lm_head", head, top + logits, head_fwd),
        Moment("bwd:lm_head", head, top + logits, 2 * head_fwd),
        # the output layer's weight is still held while its gradient is written, at the
        # next operator's start
        Moment("bwd:final", final + head, top + emb),
    ]
    for k in reversed(range(arch.layers)):
        nm = (k + 1) * kept + working + grads + emb
        out.append(Moment(f"bwd:layer.{k}", tuple(layers[k]), nm, layer_bwd))
    # the embeddings' backward holds all of their chunks (their gradients are written in
    # the same pass)
    others = tuple(i for i in before if i not in token)
    out += [Moment("bwd:positions", others, emb), Moment("bwd:embeddings", tuple(before), 3 * emb)]
    return out


def _size_rank(name: str) -> int:
    """The token embedding among the tensors before the first layer: by its name."""
    n = name.lower()
    return 2 if ("wte" in n or "embed_tokens" in n or "word" in n) else 1 if "emb" in n else 0


def forecast(
    plan: Plan,
    trainable: Sequence[bool],
    steps: Sequence[Moment],
    device_budget: int,
    nproc: int = 1,
    adam_temporary: int = 0,
    rates: Rates | None = None,
) -> Forecast:
    """One rank's steady-state iteration (see the module docstring) of the tensors `plan`
    lays out (`trainable`: each tensor's list, in init order, as `make_plan` took them).
    Under ZeRO (`nproc` > 1) the rank owns one chunk of each communication group: an
    operator needs its groups gathered on the device (the other ranks' chunks arrive by
    collective and are dropped after use), and only the owned chunks stay, move and take
    Adam. With `rates`, also the time it takes (`_timeline`)."""
    n_train, n_frozen = plan.rank_chunks(nproc)  # groups: one owned chunk each
    units = n_train + n_frozen  # trainable first, then frozen
    # each tensor's units (a tensor larger than a chunk spans several), and the bytes of
    # the contiguous copy an operator gets of such a tensor (none for the others)
    index: list[tuple[int, ...]] = []
    copy_bytes: list[int] = []
    at = {True: 0, False: 0}
    for t in trainable:
        layout, base = (plan.trainable, 0) if t else (plan.frozen, n_train)
        i, at[t] = at[t], at[t] + 1
        pieces = layout.spans.get(i, (layout.placements[i],))
        index.append(tuple(sorted({base + p.chunk_index // nproc for p in pieces})))
        copy_bytes.append(
            sum(p.numel for p in pieces) * BYTES_PARAM[plan.dtype] if i in layout.spans else 0
        )
    chunk = plan.chunk_size * BYTES_PARAM[plan.dtype]  # one param chunk
    others = (nproc - 1) * chunk  # a group's chunks of the other ranks, while gathered
    triple = plan.chunk_size * BYTES_OPTIMIZER_STATES  # fp32 master, momentum, variance
    uses = [sorted({u for t in m.tensors for u in index[t]}) for m in steps]
    copies = [sum(copy_bytes[t] for t in set(m.tensors)) for m in steps]

    peak_nm = max((m.non_model + c for m, c in zip(steps, copies, strict=True)), default=0)
    margin = device_margin(device_budget, peak_nm, units * chunk, nproc, chunk)
    device_adam = min(n_train, max(0, margin - adam_temporary) // triple)
    pinned = device_adam * triple  # device-Adam states stay on the device

    # the access sequence of two iterations: every moment, then Adam's per trainable chunk
    seq: list[tuple[str, list[int], int]] = []
    record: list[_Position] = []  # what happened at each position, for `_timeline`
    for _ in range(2):
        for m, u, c in zip(steps, uses, copies, strict=True):
            kind = "bwd" if m.name.startswith("bwd:") else "op"
            seq.append((kind, u, m.non_model + c))
            record.append(_Position(kind, u, m.flops))
        for i in range(n_train):
            seq.append(("adam", [i], 0))
            record.append(_Position("adam", [i]))
    next_use = _next_uses(seq, units)
    # the room a moment leaves for chunks: the engine's allowance is max(N_j, N_j+1)
    allowance = [max(seq[t][2], seq[t + 1][2] if t + 1 < len(seq) else 0) for t in range(len(seq))]
    group = chunk + others
    ops = [(u, a) for (kind, u, _), a in zip(seq, allowance, strict=True) if kind != "adam"]
    least = max((len(u) * group + a for u, a in ops), default=0)

    on_device: set[int] = set(range(device_adam))  # at start: the warm-up placed these
    # device chunks whose host copy is current ([Note: clean chunks] in transfers.py): one
    # moved in and only read since (forward, or a frozen chunk) goes back without a copy;
    # under ZeRO every gather may write a rank's own chunk, so none stays clean
    clean: set[int] = set()
    moved = {"in": 0, "out": 0}  # bytes of the second (steady) iteration
    dev_peak = chunk_peak = host_peak = 0
    half = len(seq) // 2

    def move(i: int, to_device: bool, counting: bool) -> None:
        (on_device.add if to_device else on_device.discard)(i)
        copied = to_device or i not in clean
        (clean.add if to_device and nproc == 1 else clean.discard)(i)
        if copied:
            (record[t].moved_in if to_device else record[t].copied_out).append(i)
            nxt = next_use[t][i]
            at_adam = seq[t][0] == "adam" or (nxt < len(seq) and seq[int(nxt)][0] == "adam")
            if not to_device and at_adam:
                record[t].for_adam.add(i)
        if counting and copied:
            moved["in" if to_device else "out"] += chunk

    for t, (kind, need, nm) in enumerate(seq):
        counting = t >= half
        gathered = len(need) * others if kind != "adam" else 0
        if kind == "adam":  # on the device for its chunks, else on the host
            (i,) = need
            if (i < device_adam) != (i in on_device):
                move(i, i < device_adam, counting)
            clean.discard(i)  # Adam writes it (on the host: the chunk itself)
        else:
            for i in need:
                if i not in on_device:
                    move(i, True, counting)
                if kind == "bwd" and i < n_train:
                    clean.discard(i)  # its gradients are written there
            room = device_budget - pinned - gathered - allowance[t]
            # OPT: the chunk whose next use is furthest goes first
            ahead = next_use[t]
            spare = farthest_first((i for i in on_device if i not in need), ahead.__getitem__, int)
            while spare and len(on_device) * chunk > room:
                move(spare.pop(0), False, counting)
        if counting:
            chunks_here = len(on_device) * chunk + gathered + pinned
            chunk_peak = max(chunk_peak, chunks_here)
            dev_peak = max(dev_peak, chunks_here + nm)
            off = units - len(on_device) + len(clean)  # a host copy is host memory too
            host_peak = max(host_peak, off * chunk + (n_train - device_adam) * triple)
    step_s = compute_s = 0.0
    phases: dict[str, float] = {}
    if rates is not None:
        step_s, compute_s, phases = _timeline(
            record, rates, chunk, plan.chunk_size, device_adam, nproc, others
        )
        if rates.adam_beside_backward:  # compute and Adam overlap: the step with links free
            free = replace(
                rates,
                host_to_device_bytes_per_s=math.inf,
                device_to_host_bytes_per_s=math.inf,
                collective_bytes_per_s=math.inf,
                latency_s=0.0,
            )
            compute_s = _timeline(record, free, chunk, plan.chunk_size, device_adam, nproc, 0)[0]
    return Forecast(
        device_peak_bytes=dev_peak,
        device_chunk_peak_bytes=chunk_peak,
        host_peak_bytes=host_peak,
        host_to_device_bytes=moved["in"],
        device_to_host_bytes=moved["out"],
        device_adam_chunks=device_adam,
        margin_bytes=margin,
        least_device_bytes=least,
        non_model_peak_bytes=peak_nm,
        step_seconds=step_s,
        compute_seconds=compute_s,
        phase_seconds=phases,
        flops=sum(m.flops for m in steps),
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


def _timeline(
    record: list[_Position],
    rates: Rates,
    chunk_bytes: int,
    chunk_numel: int,
    device_adam: int,
    nproc: int,
    others: int,
) -> tuple[float, float, dict[str, float]]:
    """The second iteration's time, its compute and Adam time alone, and its time per
    phase (forward, backward, optimizer; each from the end of the one before), from the
    placement simulation's moves, with the overlap the engine builds (issue 32):
    - the main thread runs each position in turn: an operator on the device (its FLOPs,
      after its chunks arrived and, under ZeRO, its groups were gathered), Adam on the
      host or the device;
    - under ZeRO a group is gathered ahead, while the operator before computes, and
      reduce-scattered once backward is done with it, in flight meanwhile; collectives
      run one after another (one communicator);
    - each direction of the link carries its copies one after another;
    - a chunk moved in is sent for when the operator `prefetch_moments` before its use
      starts, or earlier, at the use of the chunk moved in `prefetch_chunks` before it;
      one Adam updated on the host is sent for right after that Adam, with at most
      `prefetch_chunks` such copies on the link (what is left waits for the forward);
      a chunk evicted for room is copied out first;
    - a chunk whose Adam runs on the host leaves when backward is done with it (its last
      use before Adam), and its Adam waits for it; with `adam_beside_backward` that Adam
      runs then, on a host thread of its own, one chunk after another, and the chunk's
      Adam moment only waits for it."""
    h2d = chunk_bytes / rates.host_to_device_bytes_per_s + rates.latency_s
    d2h = chunk_bytes / rates.device_to_host_bytes_per_s + rates.latency_s
    gather = others / rates.collective_bytes_per_s  # one group: the other ranks' chunks
    host_adam = chunk_numel / rates.host_adam_params_per_s
    device_adam_s = chunk_numel / rates.device_adam_params_per_s
    n = len(record)
    start, end = [0.0] * n, [0.0] * n
    clock = h2d_free = d2h_free = collective_free = 0.0
    ins: list[tuple[int, float]] = []  # (position, done) of every copy in, in order
    updated: dict[int, float] = {}  # chunk -> when Adam on the host updated it
    out_done: dict[int, float] = {}  # chunk -> when its last copy out is done
    step_end = 0.0  # the end of the latest iteration's last Adam
    beside_on = rates.adam_beside_backward  # Adam beside backward: its own host thread
    adam_free = 0.0  # the host Adam thread's (beside backward)
    beside: dict[int, float] = {}  # chunk -> when its Adam beside backward is done
    compute = 0.0
    gathered_before: set[int] = set()
    lookahead, depth = rates.prefetch_moments, rates.prefetch_chunks
    # a chunk next used by Adam on the host leaves as soon as backward is done with it
    # (`Residency._send_done_for_host_adam`): its copy goes on the link then
    send_after: dict[int, list[tuple[int, int]]] = {}  # position -> (move's position, chunk)
    for t, p in enumerate(record):
        for i in p.for_adam:
            used = next((u for u in range(t - 1, -1, -1) if i in record[u].need), None)
            if used is not None and record[used].kind != "adam":
                send_after.setdefault(used, []).append((t, i))
    sent_early = {move for moves in send_after.values() for move in moves}
    for t, p in enumerate(record):
        # copies in: when each is sent for
        sends: list[float] = []
        for i in p.moved_in:
            j = len(ins)
            at = start[t - lookahead] if t >= lookahead else clock
            if j >= depth and ins[j - depth][0] < t:
                at = min(at, start[ins[j - depth][0]])
            if i in updated:  # Adam on the host updated it: sent for after that Adam
                adam_end = updated.pop(i)
                after = max(adam_end, ins[j - depth][1] if j >= depth else 0.0)
                at = after if after <= step_end else max(at, adam_end)
            sends.append(at)
            ins.append((t, math.inf))
        # copies out: one evicted for room before the copies in (or the operator) that
        # need the room
        room = min(sends, default=clock)
        room_done = 0.0
        for i in p.copied_out:
            if (t, i) not in sent_early:  # (one sent after its last use is on its way)
                d2h_free = max(d2h_free, room) + d2h
                out_done[i] = d2h_free
            if p.kind != "adam":
                room_done = max(room_done, out_done[i])
        arrived = 0.0
        for k, at in enumerate(sends):
            h2d_free = max(h2d_free, at, room_done) + h2d
            ins[len(ins) - len(sends) + k] = (t, h2d_free)
            arrived = h2d_free
        begin = max(clock, arrived, room_done)
        if p.kind == "adam":
            (i,) = p.need
            on_host = i >= device_adam
            if on_host:
                begin = max(begin, out_done.get(i, 0.0))
            took = host_adam if on_host else device_adam_s
            compute += took
            if i in beside:  # updated beside backward: its moment waits for that
                took = max(0.0, beside.pop(i) - begin)
            elif on_host and beside_on:
                begin = max(begin, adam_free)  # the thread may still run another's
                adam_free = begin + took
            start[t], end[t] = begin, begin + took
            if on_host:
                updated[i] = end[t]
            step_end = end[t]
        else:
            took = p.flops / rates.flops_per_s
            compute += took
            if nproc > 1:
                # a group not gathered for the operator before was gathered ahead, while
                # that one computed; the collectives run one after another
                ahead = start[t - 1] if t > 0 and record[t - 1].kind != "adam" else begin
                for _ in set(p.need) - gathered_before:
                    collective_free = max(collective_free, ahead) + gather
                    begin = max(begin, collective_free)
            start[t] = begin
            end[t] = begin + took
            if nproc > 1 and p.kind == "bwd":
                # a group backward is done with is reduce-scattered, in flight meanwhile
                following = set(record[t + 1].need) if t + 1 < n else set()
                for _ in set(p.need) - following:
                    collective_free = max(collective_free, end[t]) + gather
            gathered_before = set(p.need)
        clock = end[t]
        for _, i in send_after.get(t, ()):
            d2h_free = max(d2h_free, clock) + d2h
            out_done[i] = d2h_free
            if beside_on and i >= device_adam:
                adam_free = max(adam_free, d2h_free) + host_adam
                beside[i] = adam_free
    half = n // 2
    phase_of = {"op": "forward", "bwd": "backward", "adam": "optimizer"}
    phases: dict[str, float] = {}
    before = end[half - 1]
    for t in range(half, n):
        phase = phase_of[record[t].kind]
        phases[phase] = phases.get(phase, 0.0) + end[t] - before
        before = end[t]
    return end[-1] - end[half - 1], compute / 2, phases
