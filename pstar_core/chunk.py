"""Chunks and the tensors that live in them: the paper's tensor states and their transitions.

A `Chunk` is one contiguous buffer of `capacity` elements of one dtype. A `TensorSlot` is
one parameter's region (offset, numel) in a chunk, with its state. A trainable parameter
has the same (chunk index, offset) in the four aligned lists; the state lives on the
param-list slot, because that is the one hooks drive.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from pstar_core.tiers import TierName


class ChunkType(enum.Enum):
    PARAM = "param"  # compute dtype (fp16/bf16/fp32); after backward, slots hold grads
    PARAM_FP32 = "param_fp32"  # fp32 master weights
    MOMENTUM = "momentum"
    VARIANCE = "variance"
    FROZEN = "frozen"  # compute dtype, parameters with requires_grad=False (no grad, no OS)
    GRAD_ACCUM = "grad_accum"  # fp32, exists only while gradients accumulate


PARAM_LISTS = (ChunkType.PARAM, ChunkType.FROZEN)  # the lists whose chunks hold parameters
# the four aligned lists of trainable tensors: a tensor has the same (chunk index, offset)
# in each, and the param list comes first
TRAINABLE_LISTS = (ChunkType.PARAM, ChunkType.PARAM_FP32, ChunkType.MOMENTUM, ChunkType.VARIANCE)


class TensorState(enum.Enum):
    FREE = "FREE"
    COMPUTE = "COMPUTE"
    HOLD = "HOLD"
    HOLD_AFTER_FWD = "HOLD_AFTER_FWD"
    HOLD_AFTER_BWD = "HOLD_AFTER_BWD"


# Allowed transitions. COMPUTE -> COMPUTE is a nested access (tied weights, or a forward
# re-run by activation checkpointing inside backward). HOLD_AFTER_BWD -> COMPUTE is absent
# on purpose: the slot then holds a gradient, so computing on it would be silently wrong;
# the manager first moves the gradient out (HOLD_AFTER_BWD -> HOLD) when accumulating.
_LEGAL: dict[TensorState, frozenset[TensorState]] = {
    TensorState.FREE: frozenset({TensorState.HOLD, TensorState.COMPUTE}),
    TensorState.HOLD: frozenset({TensorState.COMPUTE, TensorState.FREE}),
    TensorState.COMPUTE: frozenset(
        {
            TensorState.COMPUTE,
            TensorState.HOLD,
            TensorState.HOLD_AFTER_FWD,
            TensorState.HOLD_AFTER_BWD,
        }
    ),
    TensorState.HOLD_AFTER_FWD: frozenset({TensorState.COMPUTE, TensorState.HOLD}),
    TensorState.HOLD_AFTER_BWD: frozenset({TensorState.HOLD, TensorState.FREE}),
}
HOLD_LIKE = frozenset({TensorState.HOLD, TensorState.HOLD_AFTER_FWD, TensorState.HOLD_AFTER_BWD})


class IllegalTransition(RuntimeError):
    """A tensor was asked to move between two states the paper's state machine forbids."""


@dataclass(eq=False)
class TensorSlot:
    """One parameter's place in the chunks and its state in the current iteration."""

    name: str  # first name under which the model registers it
    aliases: tuple[str, ...]  # every name (tied weights have several)
    param: torch.nn.Parameter
    shape: torch.Size
    chunk_index: int  # index within its list (trainable lists or the frozen list)
    offset: int
    numel: int
    trainable: bool
    group: int = 0  # index into the engine's optimizer groups
    state: TensorState = TensorState.FREE
    compute_refs: int = 0
    step: int = 0  # optimizer steps taken by this parameter (torch keeps one per param)
    grad_in_accum: bool = False  # an earlier micro-batch left a grad in the accum chunk
    forward_uses: int = 0  # operators that used it in this forward (tied weights: several)
    backward_done: bool = False  # frozen: its module's backward is over (input grads)
    # a piece of a parameter larger than a chunk: its `spans.Span` (typed loosely, since
    # spans.py builds on this module)
    span: Any = None

    def set_state(self, new: TensorState) -> None:
        if new not in _LEGAL[self.state]:
            raise IllegalTransition(
                f"parameter {self.name!r}: illegal transition {self.state.value} -> {new.value}"
            )
        self.state = new

    @property
    def end(self) -> int:
        return self.offset + self.numel


@dataclass(eq=False)
class Chunk:
    """A contiguous buffer of `capacity` elements; `payload` is None while it has no memory."""

    kind: ChunkType
    index: int
    capacity: int
    dtype: torch.dtype
    slots: list[TensorSlot] = field(default_factory=list)
    tier: TierName | None = None  # None before allocation
    pins: int = 0  # > 0 while a collective needs the payload where it is
    disk_offset: int | None = None  # where its bytes are in the disk tier's spill file
    nbytes: int = 0
    # Starts as zeros and has no memory until its first use (momentum and variance): the
    # first move allocates it zeroed where it goes, so initialize holds 6 bytes per
    # trainable parameter (bf16 param and fp32 master), not 14.
    zero_pending: bool = False

    def __post_init__(self) -> None:
        self.nbytes = self.capacity * torch.empty((), dtype=self.dtype).element_size()
        self._payload: torch.Tensor | None = None
        # On the device: the host buffer it came from, still holding the same bytes while
        # the chunk is only read there ([Note: clean chunks] in transfers.py); None else
        self.host_copy: torch.Tensor | None = None
        # slot -> its view of the payload, made at its first `view` (see `payload`)
        self._views: dict[int, torch.Tensor] = {}

    @property
    def payload(self) -> torch.Tensor | None:
        """The chunk's memory (None while it has none: spilled, freed, never used)."""
        return self._payload

    @payload.setter
    def payload(self, payload: torch.Tensor | None) -> None:
        # the cached views hold the old memory: dropped with it, so an evicted chunk's
        # buffer is freed at once
        self._payload = payload
        self._views.clear()

    @property
    def used_elems(self) -> int:
        return sum(s.numel for s in self.slots)

    def view(self, slot: TensorSlot) -> torch.Tensor:
        """The slot's region of this chunk, shaped like the parameter. Made once per
        payload (a slice and a view are two dispatcher calls, ~4 us, on every Access of
        every parameter) and dropped when the payload changes."""
        view = self._views.get(id(slot))
        if view is None:
            assert self._payload is not None, f"{self.kind.value} chunk {self.index} has no payload"
            view = self._views[id(slot)] = self._payload[slot.offset : slot.end].view(slot.shape)
        return view

    def flat(self, slot: TensorSlot) -> torch.Tensor:
        assert self.payload is not None, f"{self.kind.value} chunk {self.index} has no payload"
        return self.payload[slot.offset : slot.end]
