"""Parameters larger than a chunk ([Note: tensors spanning chunks] in mapping.py).

Such a parameter's elements lie in pieces, each an ordinary `TensorSlot` of its own chunk
(the first in the rest of a chunk, then whole chunks, then the start of one more). The
pieces go through Access and Release, the tracer, eviction, ZeRO and Adam as any tensor
does; each has a stand-in parameter that no module holds. What is particular to a span:

- the operator that uses the parameter gets one contiguous copy of it (`bind`), made
  once its pieces are resident, and dropped with their Release (`unbind`): for the time
  of the operator, the parameter's size of memory besides its chunks;
- its gradient is cut into the pieces' slots (`grad_pieces`);
- autograd keeps no copy between forward and backward: a saved copy is packed as a
  `SpanRef` and read from the copy that backward's Access makes (see `hooks`);
- names, state dicts and Hugging Face files see the whole parameter (`ModelTensors`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from pstar_core.chunk import TensorSlot

__all__ = ["Span", "SpanRef"]


@dataclass(eq=False)
class Span:
    """One parameter larger than a chunk, and the slots of its pieces (in order)."""

    name: str  # first name under which the model registers it
    aliases: tuple[str, ...]  # every name (tied weights have several)
    param: nn.Parameter
    shape: torch.Size
    trainable: bool
    pieces: tuple[TensorSlot, ...] = ()
    # the contiguous copy an operator computes on (None while no operator uses it)
    buffer: torch.Tensor | None = field(default=None, repr=False)

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.pieces)

    def ranges(self) -> Iterator[tuple[TensorSlot, int, int]]:
        """Each piece with its [start, end) in the flattened parameter."""
        start = 0
        for piece in self.pieces:
            yield piece, start, start + piece.numel
            start += piece.numel

    def bind(self) -> None:
        """Point the parameter at one contiguous copy of its pieces (their stand-ins must
        point at their slots: the pieces are accessed)."""
        first = self.pieces[0].param
        buf = torch.empty(self.numel, dtype=first.dtype, device=first.device)
        for piece, a, b in self.ranges():
            buf[a:b].copy_(piece.param.data)
        self.buffer = buf
        self.param.data = buf.view(self.shape)

    def unbind(self, placeholder: torch.Tensor) -> None:
        """The operator is done: the copy is freed (autograd holds a `SpanRef`, not it)."""
        self.buffer = None
        self.param.data = placeholder

    def grad_pieces(self, grad: torch.Tensor) -> Iterator[tuple[TensorSlot, torch.Tensor]]:
        """The parameter's gradient cut into its pieces' shares (views, no copy)."""
        flat = grad.reshape(-1)
        for piece, a, b in self.ranges():
            yield piece, flat[a:b]

    def holds(self, t: torch.Tensor) -> bool:
        """Whether `t` is a view of the current copy."""
        buf = self.buffer
        return (
            buf is not None
            and t.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
            and t.dtype == buf.dtype
        )


class SpanRef:
    """A saved-for-backward view of a span's copy, kept as (span, geometry): the copy is
    freed when forward's operator ends, and backward reads the one its Access makes."""

    __slots__ = ("offset", "size", "span", "stride")

    def __init__(self, span: Span, offset: int, size: torch.Size, stride: tuple[int, ...]):
        self.span, self.offset, self.size, self.stride = span, offset, size, stride


def stand_in(device: torch.device, dtype: torch.dtype) -> nn.Parameter:
    """A piece's parameter: no module holds it; Access points it at the piece's slot."""
    return nn.Parameter(torch.empty(0, dtype=dtype, device=device), requires_grad=False)
