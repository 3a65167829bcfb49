"""Module and tensor hooks that drive Access/Release during forward and backward.

- forward pre-hook: Access every chunked parameter the module owns directly;
- forward post-hook: Release them to HOLD_AFTER_FWD (to HOLD when the forward is a
  re-run by activation checkpointing inside backward), and register a multi-grad hook
  on the outputs: when the first output gradient arrives, backward is about to enter
  the module, so its parameters are accessed again;
- post-accumulate-grad hook on each trainable parameter: autograd calls it once per
  backward with the summed gradient, after every use (tied weights included), so it is
  the parameter's last use: the gradient overwrites the slot (HOLD_AFTER_BWD).

- gradient hook on the inputs of a module with frozen parameters: once every input's
  gradient exists, backward is done with the module, so its frozen parameters (which get
  no gradient to mark that moment) are released and their chunks may leave the device.

Whatever backward accessed but produced no gradient for (unused branches, frozen
parameters of a module whose inputs need no gradient) is released by `Engine.backward`
when the backward pass returns.

A parameter must be used inside the forward of the module that registers it (as in
FSDP); one used elsewhere is reported by the access check.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_flatten

from pstar_core.chunk import TensorSlot, TensorState
from pstar_core.manager import ChunkManager
from pstar_core.placement import BACKWARD_MOMENT, FORWARD_MOMENT
from pstar_core.spans import Span, SpanRef
from pstar_core.tiers import TierName


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def install_hooks(
    module: torch.nn.Module,
    by_param: dict[int, TensorSlot],
    spans: dict[int, Span],
    manager: ChunkManager,
) -> list[Any]:
    """Hook every module that owns chunked parameters; returns the handles."""
    handles: list[Any] = []
    for name, mod in module.named_modules():
        slots = operator_slots(mod, by_param, spans)
        if not slots:
            continue
        handles.append(mod.register_forward_pre_hook(_pre_forward(name, slots, manager)))
        handles.append(mod.register_forward_hook(_post_forward(name, slots, manager)))
    for slot in by_param.values():
        if slot.trainable and slot.span is None:
            handles.append(slot.param.register_post_accumulate_grad_hook(_grad_hook(slot, manager)))
    for span in spans.values():
        if span.trainable:
            handles.append(
                span.param.register_post_accumulate_grad_hook(_span_grad_hook(span, manager))
            )
    return handles


def operator_slots(
    mod: torch.nn.Module, by_param: dict[int, TensorSlot], spans: dict[int, Span]
) -> list[TensorSlot]:
    """The chunked tensors one module (operator) uses: its direct parameters (a span's
    pieces, in order, for a parameter larger than a chunk)."""
    out: list[TensorSlot] = []
    for p in mod.parameters(recurse=False):
        if id(p) in by_param:
            out.append(by_param[id(p)])
        elif id(p) in spans:
            out.extend(spans[id(p)].pieces)
    return out


def _pre_forward(name: str, slots: list[TensorSlot], manager: ChunkManager) -> Callable[..., None]:
    def hook(_mod: torch.nn.Module, _args: Any) -> None:
        manager.begin_operator(FORWARD_MOMENT + name)
        manager.access_slots(slots, forward=not _in_backward())

    return hook


def _post_forward(name: str, slots: list[TensorSlot], manager: ChunkManager) -> Callable[..., None]:
    def pre_backward(_grads: Any) -> None:
        manager.begin_operator(BACKWARD_MOMENT + name)
        manager.access_slots(slots)

    frozen = [s for s in slots if not s.trainable]

    def hook(_mod: torch.nn.Module, args: Any, output: Any) -> None:
        target = TensorState.HOLD if _in_backward() else TensorState.HOLD_AFTER_FWD
        for s in slots:
            manager.release(s, target)
        if torch.is_grad_enabled():
            tensors = _needing_grad(output)
            if len(tensors) == 1:  # the usual case: a tensor hook is half the cost
                tensors[0].register_hook(pre_backward)
            elif tensors:
                register_multi_grad_hook(tensors, pre_backward, mode="any")
            if tensors and frozen:
                _after_input_grads(_needing_grad(args), frozen, manager)

    return hook


def _after_input_grads(
    inputs: list[torch.Tensor], frozen: list[TensorSlot], manager: ChunkManager
) -> None:
    """Release `frozen` once the gradients of all `inputs` exist (backward is done with
    the module). A counter in the closure rather than `register_multi_grad_hook(mode=
    "all")`, which keeps the inputs' grad_fns in the hook it stores on them: a cycle
    through autograd's C++ nodes that leaked ~10 MB per step on a 64-layer LoRA model.
    Inputs that are leaves (a caller's tensor that may outlive the step and would collect
    hooks) are left to the release at the end of backward."""
    if not inputs or any(t.grad_fn is None for t in inputs):
        return
    left = [len(inputs)]

    def arrived(_grad: torch.Tensor) -> None:
        left[0] -= 1
        if left[0] == 0:
            manager.release_frozen_after_backward(frozen)

    for t in inputs:
        t.register_hook(arrived)


def _needing_grad(tree: Any) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):  # most modules return one tensor: no pytree walk
        return [tree] if tree.requires_grad else []
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor) and t.requires_grad]


def _grad_hook(slot: TensorSlot, manager: ChunkManager) -> Callable[[torch.Tensor], None]:
    def hook(param: torch.Tensor) -> None:
        grad = param.grad
        param.grad = None  # the temporary gradient is freed once it sits in the slot
        manager.grad_ready(slot, grad)

    return hook


def _span_grad_hook(span: Span, manager: ChunkManager) -> Callable[[torch.Tensor], None]:
    def hook(param: torch.Tensor) -> None:
        grad = param.grad
        param.grad = None
        for piece, share in span.grad_pieces(grad):
            manager.grad_ready(piece, share)

    return hook


class ChunkRef:
    """A saved-for-backward view of a chunk, kept as (chunk, geometry) instead of storage.

    Autograd saves views of parameters (e.g. `weight.t()` in a Linear). Holding the view
    would keep the chunk's old buffer alive after the chunk is evicted, so that memory
    would never be freed; the reference is re-resolved against the chunk's current
    payload when backward unpacks it.
    """

    __slots__ = ("chunk", "offset", "size", "stride")

    def __init__(self, chunk: Any, offset: int, size: torch.Size, stride: tuple[int, ...]):
        self.chunk, self.offset, self.size, self.stride = chunk, offset, size, stride


def saved_tensor_hooks(
    manager: ChunkManager, spans: Sequence[Span] = ()
) -> torch.autograd.graph.saved_tensors_hooks:
    residency = manager.residency
    chunk_of_tensor = residency.payloads.chunk_of_tensor  # called for every saved tensor

    def pack(t: torch.Tensor) -> Any:
        chunk = chunk_of_tensor(t)
        if chunk is None:
            for span in spans:  # empty unless a parameter is larger than a chunk
                if span.holds(t):
                    return SpanRef(span, t.storage_offset(), t.size(), t.stride())
            return t
        offset = t.storage_offset() - chunk.payload.storage_offset()  # within the chunk
        return ChunkRef(chunk, offset, t.size(), t.stride())

    def unpack(x: Any) -> torch.Tensor:
        if isinstance(x, SpanRef):
            return _span_copy(x.span, manager).as_strided(x.size, x.stride, x.offset)
        if not isinstance(x, ChunkRef):
            return x
        if x.chunk.tier != TierName.DEVICE:
            residency.make_resident([x.chunk], TierName.DEVICE)
        # a chunk already accounted on the device may still be on its way there (a
        # prefetch on the copy stream): its payload is read only once it has arrived
        residency.transfers.arrive(x.chunk)
        payload = x.chunk.payload
        return payload.as_strided(x.size, x.stride, payload.storage_offset() + x.offset)

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def _span_copy(span: Span, manager: ChunkManager) -> torch.Tensor:
    """The copy backward reads a span's saved view from: the one its module's Access in
    backward made, else (a forward re-run by activation checkpointing has released it
    already) one made from the pieces, which still hold the values."""
    if span.buffer is not None:
        return span.buffer
    if any(p.state is TensorState.HOLD_AFTER_BWD for p in span.pieces):
        raise RuntimeError(
            f"{span.name}: backward reads a saved copy of it after its gradient was written; "
            "use the parameter only inside the forward of the module that registers it"
        )
    residency = manager.residency
    chunks = list({id(c): c for c in (manager.param_chunk(p) for p in span.pieces)}.values())
    residency.make_resident(chunks, TierName.DEVICE)
    for c in chunks:
        residency.transfers.arrive(c)
    return torch.cat([manager.param_chunk(p).flat(p) for p in span.pieces])
