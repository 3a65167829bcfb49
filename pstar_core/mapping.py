"""The tensor-to-chunk schema and the chunk-size search (no memory is allocated here).

Tensors are packed in model-initialization order, each into the current chunk if it
fits and otherwise into a new one, so tensors used together share a chunk. The same
placement serves the four aligned lists (param, param fp32, momentum, variance), so a
parameter has one (chunk, offset) everywhere. Frozen parameters form their own list.

[Note: tensors spanning chunks]
A tensor larger than the chunk size is cut into pieces that fill the current chunk's
rest, then whole chunks, then the start of one more (`Layout.spans`). The paper makes the
largest tensor the floor of the chunk size; with a 128k vocabulary that floor is a 525M-
element embedding, so every chunk, Adam temporary and ZeRO group buffer would be sized by
it. Here the floor is the largest tensor of at most `SPAN_ABOVE` elements: those above
it do not bound the search, and span chunks when larger than the size it picks (a
Llama-3-8B plans 208M-element chunks, its embedding and head 3 chunks each; models whose
tensors are all below the limit plan as the paper's rule does). An operator using such a
tensor gets all its pieces' chunks and one contiguous copy of it for the operator's time
(`spans.Span`); the tracer sees that copy as non-model memory.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

# Bytes per element of each list, by compute dtype: param, param fp32, momentum, variance.
BYTES_PARAM = {"fp32": 4, "bf16": 2, "fp16": 2}
BYTES_OPTIMIZER_STATES = 12
# A tensor larger than this does not set the chunk size's floor: it may span chunks.
SPAN_ABOVE = 256 * 2**20


@dataclass(frozen=True)
class Placement:
    chunk_index: int
    offset: int
    numel: int = 0  # of a spanning tensor's piece (else the whole tensor's, not kept)


@dataclass(frozen=True)
class Layout:
    """Where each tensor of one list goes, for one chunk size."""

    chunk_size: int
    placements: tuple[Placement, ...]
    num_chunks: int
    used_elems: int
    chunk_used: tuple[int, ...] = ()  # elements used in each chunk
    # a tensor larger than the chunk (by its index): its pieces, in order; `placements`
    # holds the first ([Note: tensors spanning chunks])
    spans: dict[int, tuple[Placement, ...]] = field(default_factory=dict)

    @property
    def utilization(self) -> float:
        return self.used_elems / (self.num_chunks * self.chunk_size) if self.num_chunks else 1.0

    def owners(self, nproc: int) -> tuple[int, ...]:
        """The rank that owns each chunk under ZeRO, the list padded to whole groups."""
        return balanced_owners(self.chunk_used, nproc)


def balanced_owners(chunk_used: Sequence[int], nproc: int) -> tuple[int, ...]:
    """Owners of the chunks of one list (padded with empty chunks to whole communication
    groups of `nproc`): in each group every rank owns one chunk, and the fullest chunk of
    the group goes to the rank holding the least so far.

    Chunk i to rank i % nproc is unbalanced whenever fill alternates with period nproc
    (an MLP whose big weights each fill a chunk, with the small tensors packed between
    them: one rank held 91% of the model data that way). Greedy per group keeps the
    spread between ranks below one chunk after every group, whatever the fill: the rank
    that gets the fullest chunk was the lightest, so it cannot pass the others by more
    than the difference of two chunks in the group.
    """
    n = -(-len(chunk_used) // nproc) * nproc
    used = list(chunk_used) + [0] * (n - len(chunk_used))
    held = [0] * nproc
    owners = [0] * n
    for g in range(0, n, nproc):
        members = sorted(range(g, g + nproc), key=lambda i: (-used[i], i))
        ranks = sorted(range(nproc), key=lambda r: (held[r], r))
        for i, r in zip(members, ranks, strict=True):
            owners[i] = r
            held[r] += used[i]
    return tuple(owners)


def pack(numels: Sequence[int], chunk_size: int) -> Layout:
    """Greedy in-order packing: a tensor that does not fit opens a new chunk; one larger
    than a chunk spans chunks from the current one's rest on."""
    placements = []
    used: list[int] = []
    spans: dict[int, tuple[Placement, ...]] = {}
    chunk, fill = -1, chunk_size  # forces the first tensor to open chunk 0
    for i, n in enumerate(numels):
        if n > chunk_size:
            pieces = []
            while n:
                if fill == chunk_size:
                    chunk, fill = chunk + 1, 0
                    used.append(0)
                take = min(n, chunk_size - fill)
                pieces.append(Placement(chunk, fill, take))
                fill, n = fill + take, n - take
                used[chunk] += take
            spans[i] = tuple(pieces)
            placements.append(pieces[0])
            continue
        if fill + n > chunk_size:
            chunk, fill = chunk + 1, 0
            used.append(0)
        placements.append(Placement(chunk, fill))
        fill += n
        used[chunk] += n
    return Layout(chunk_size, tuple(placements), chunk + 1, sum(numels), tuple(used), spans)


def _waste(numels: Sequence[int], chunk_size: int, nproc: int = 1) -> int:
    """Unused elements for a chunk size, counting the empty chunks that pad the list to
    whole communication groups; the hot loop of the search, kept allocation-free."""
    chunks, fill = 0, chunk_size
    for n in numels:
        if n > chunk_size:  # spans: fills the rest of this chunk, then whole ones
            rest = n - (chunk_size - fill)
            more = -(-rest // chunk_size)
            chunks, fill = chunks + more, rest - (more - 1) * chunk_size
            continue
        if fill + n > chunk_size:
            chunks, fill = chunks + 1, 0
        fill += n
    if not numels:
        return 0
    chunks = -(-chunks // nproc) * nproc
    return chunks * chunk_size - sum(numels)


def search_chunk_size(lists: Sequence[Sequence[int]], align: int = 1024, nproc: int = 1) -> int:
    """The chunk size with the least waste over all lists, smallest among near-ties.

    Candidates lie between the largest tensor (a lower bound: every tensor must fit) and
    about a quarter of the model (so there are several chunks to move around), capped
    near 512M elements as in the paper's scan. A tensor above `SPAN_ABOVE` sets no floor:
    it spans chunks ([Note: tensors spanning chunks]). Besides a regular grid, exact sums
    of runs of consecutive tensors are tried: repeated transformer blocks then pack
    without gaps.
    """
    flat = [n for lst in lists for n in lst]
    if not flat:
        return align
    total = sum(flat)
    # every tensor but those above SPAN_ABOVE must fit a chunk
    floor = max((n for n in flat if n <= SPAN_ABOVE), default=align)
    lo = max(floor, min(math.ceil(total / 64), 256 * 2**20))
    hi = max(2 * lo, min(math.ceil(total / 4), 512 * 2**20))
    cands = {_round_up(lo + (hi - lo) * i // 255, align) for i in range(256)}
    for lst in lists:
        for start in _run_starts(lst):
            acc = 0
            for n in lst[start:]:
                acc += n
                if acc > hi:
                    break
                if acc >= lo:
                    cands.add(_round_up(acc, align))
    if nproc > 1:
        # with ZeRO, a list shorter than one group per rank is not sharded at all: also
        # try sizes that split the model into at least nproc chunks
        cands |= {_round_up(max(floor, -(-total // (nproc * k))), align) for k in range(1, 9)}
    sizes = sorted(c for c in cands if c >= floor)
    wastes = {c: sum(_waste(lst, c, nproc) for lst in lists) for c in sizes}
    best = {c: total / (total + w) for c, w in wastes.items()}
    top = max(best.values())
    return min(c for c, u in best.items() if u >= top - 0.005)


def _run_starts(numels: Sequence[int]) -> list[int]:
    # Start points for exact-fit candidates: the first tensor and the first few after it
    # (the embeddings usually precede the repeated blocks).
    return list(range(min(len(numels), 8)))


def _round_up(n: int, align: int) -> int:
    return -(-n // align) * align


@dataclass(frozen=True)
class Plan:
    """The chunk plan of a model: what `pstar plan` prints and `initialize` allocates."""

    chunk_size: int
    trainable: Layout
    frozen: Layout
    dtype: str
    params: int
    trainable_params: int
    # the tensors larger than a chunk, by name, with the chunks each spans
    spanning: tuple[tuple[str, int], ...] = ()

    @property
    def utilization(self) -> float:
        used = self.trainable.used_elems + self.frozen.used_elems
        slots = (self.trainable.num_chunks + self.frozen.num_chunks) * self.chunk_size
        return used / slots if slots else 1.0

    def rank_chunks(self, nproc: int = 1) -> tuple[int, int]:
        """The trainable and frozen chunks each ZeRO rank owns: one of every communication
        group, the lists padded to whole groups (nproc=1: the model's)."""
        return -(-self.trainable.num_chunks // nproc), -(-self.frozen.num_chunks // nproc)

    def list_bytes(self, nproc: int = 1) -> dict[str, int]:
        """The bytes of each chunk list one rank owns (nproc=1: the model's): the engine's
        lists, as `ChunkManager` builds them, and what the planner counts."""
        trainable, frozen = self.rank_chunks(nproc)
        p, c = BYTES_PARAM[self.dtype], self.chunk_size
        return {
            "param": trainable * c * p,
            "param_fp32": trainable * c * 4,
            "momentum": trainable * c * 4,
            "variance": trainable * c * 4,
            "frozen": frozen * c * p,
        }

    def list_stats(self) -> dict[str, dict[str, float | int]]:
        """Chunks, bytes and utilization of each chunk list."""
        out: dict[str, dict[str, float | int]] = {}
        for name, nbytes in self.list_bytes().items():
            layout = self.frozen if name == "frozen" else self.trainable
            out[name] = {
                "chunks": layout.num_chunks,
                "bytes": nbytes,
                "utilization": layout.utilization,
            }
        return out

    def per_rank(self, nproc: int) -> list[dict[str, int]]:
        """What each ZeRO rank holds: its chunks' bytes (the empty chunks that pad a list
        to whole groups included) and its model data (the tensors in them)."""
        p = BYTES_PARAM[self.dtype]
        out = [{"chunks": 0, "chunk_bytes": 0, "model_data_bytes": 0} for _ in range(nproc)]
        for layout, per_elem in ((self.trainable, p + BYTES_OPTIMIZER_STATES), (self.frozen, p)):
            owners = layout.owners(nproc)
            used = list(layout.chunk_used) + [0] * (len(owners) - len(layout.chunk_used))
            lists = 4 if layout is self.trainable else 1
            for r, u in zip(owners, used, strict=True):
                out[r]["chunks"] += lists
                out[r]["chunk_bytes"] += self.chunk_size * per_elem
                out[r]["model_data_bytes"] += u * per_elem
        return out

    @property
    def model_data_bytes(self) -> int:
        """Bytes of the tensors themselves (what `stats()` reports per parameter)."""
        p = BYTES_PARAM[self.dtype]
        return self.trainable.used_elems * (p + BYTES_OPTIMIZER_STATES) + self.frozen.used_elems * p

    @property
    def chunk_bytes(self) -> int:
        return sum(int(s["bytes"]) for s in self.list_stats().values())


def make_plan(
    numels: Sequence[int],
    trainable: Sequence[bool],
    names: Sequence[str],
    dtype: str,
    chunk_size: int | str = "auto",
    nproc: int = 1,
) -> Plan:
    """Lay out tensors (in init order) into the trainable and frozen lists.

    `nproc` (ZeRO ranks) makes the search count the padding of each list to whole
    communication groups, so a model is not left in one chunk that one rank owns.
    """
    tr = [n for n, t in zip(numels, trainable, strict=True) if t]
    fr = [n for n, t in zip(numels, trainable, strict=True) if not t]
    # a tensor larger than the size spans chunks
    size = search_chunk_size([tr, fr], nproc=nproc) if chunk_size == "auto" else int(chunk_size)
    trainable_layout, frozen_layout = pack(tr, size), pack(fr, size)
    tr_names = [n for n, t in zip(names, trainable, strict=True) if t]
    fr_names = [n for n, t in zip(names, trainable, strict=True) if not t]
    spanning = tuple(
        (names_[i], len(pieces))
        for layout, names_ in ((trainable_layout, tr_names), (frozen_layout, fr_names))
        for i, pieces in layout.spans.items()
    )
    return Plan(size, trainable_layout, frozen_layout, dtype, sum(numels), sum(tr), spanning)
