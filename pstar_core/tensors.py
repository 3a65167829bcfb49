"""`ModelTensors`: the model's state-dict entries by name, wherever each one lives.

A chunked parameter lives in its chunk slot (this rank's, or another rank's under ZeRO,
broadcast by its owner when read), an excluded one as a plain tensor (`excluded`), a
buffer in its module. This is the engine's `ChunkStore` (see `store`): what
checkpoints, Hugging Face files and LoRA adapters read and write.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pstar_core.chunk import Chunk, ChunkType, TensorSlot, TensorState
from pstar_core.config import missing_unexpected
from pstar_core.excluded import ExcludedParams
from pstar_core.manager import ChunkManager
from pstar_core.spans import Span
from pstar_core.tiers import TierName
from pstar_core.zero import ZeroGroup


class ModelTensors:
    def __init__(
        self,
        module: nn.Module,
        manager: ChunkManager,
        by_param: dict[int, TensorSlot],
        spans: dict[int, Span],
        excluded: ExcludedParams,
        compute_dtype: str,
    ) -> None:
        self.module = module
        self.manager = manager
        self.by_name: dict[str, TensorSlot | Span] = {
            n: s for s in by_param.values() if s.span is None for n in s.aliases
        }
        self.by_name.update({n: span for span in spans.values() for n in span.aliases})
        self.excluded = excluded
        self.compute_dtype = compute_dtype
        self.source_dir: Path | None = None  # a HF model directory the weights came from
        # the frozen chunks hold exactly what `source_dir` holds (checkpoints leave them out)
        self.frozen_from_source = False
        # under ZeRO, the last chunk `read_tensor` had broadcast: (list, index), host copy
        self._gather_cache: tuple[Any, torch.Tensor] | None = None

    # -- the chunks (see `store.ChunkStore`) ------------------------------------------------

    @property
    def zero(self) -> ZeroGroup:
        return self.manager.zero

    @property
    def chunk_size(self) -> int:
        return self.manager.plan.chunk_size

    @property
    def lists(self) -> dict[ChunkType, list[Chunk]]:
        return self.manager.lists

    @property
    def slots(self) -> list[TensorSlot]:
        return self.manager.slots

    def own_chunks(self, kinds: Iterable[ChunkType] | None = None) -> Iterable[Chunk]:
        return self.manager.own_chunks(kinds)

    def in_memory(self, chunk: Chunk) -> Chunk:
        return self.manager.residency.in_memory(chunk)

    def colocate(self, chunks: Sequence[Chunk]) -> None:
        self.manager.residency.colocate(chunks)

    # -- tensors by name ----------------------------------------------------------------

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The model's state dict under its own names; trainable weights are fp32 masters.
        Every tensor is a host copy, wherever its chunk is (the device may not hold the
        whole model)."""
        names = self.module.state_dict(keep_vars=True)
        out = {name: self.read_tensor(name).to("cpu", copy=True) for name in names}
        self.forget_gathered()
        return out

    def load_state_dict(self, state: dict[str, torch.Tensor], strict: bool = True) -> None:
        """Load weights by name (the masters at full precision; optimizer states kept)."""
        own = self.module.state_dict(keep_vars=True)
        missing = [k for k in own if k not in state]
        unexpected = [k for k in state if k not in own]
        if strict and (missing or unexpected):
            raise KeyError(
                "state dict does not match the model: "
                + missing_unexpected(missing, unexpected, 10)
            )
        for name, value in state.items():
            if name in own:
                self.load_tensor(name, value, own[name])

    def forget_gathered(self) -> None:
        """Drop the chunk cached by `read_tensor` under ZeRO."""
        self._gather_cache = None

    def read_tensor(self, name: str) -> torch.Tensor:
        """A view of one state-dict entry: the fp32 master of a trainable parameter (a
        host copy for one larger than a chunk)."""
        slot = self.by_name.get(name)
        if slot is None:
            value = self.excluded.value(name)
            return (value if value is not None else self.module.get_buffer(name)).detach()
        if isinstance(slot, Span):
            return self._read_span(slot)
        return self._read_slot(slot)

    def _read_span(self, span: Span) -> torch.Tensor:
        """A host copy joined from the pieces, each copied before the next is read (which
        may bring a chunk back from disk in the place of the one before)."""
        out = None
        for piece, a, b in span.ranges():
            value = self._read_slot(piece)
            if out is None:
                out = torch.empty(span.numel, dtype=value.dtype)
            out[a:b].copy_(value)
        assert out is not None
        return out.view(span.shape)

    def _read_slot(self, slot: TensorSlot) -> torch.Tensor:
        kind = ChunkType.PARAM_FP32 if slot.trainable else ChunkType.FROZEN
        chunk = self.manager.chunk_of(kind, slot)
        if self.zero.enabled:
            return self._gathered(chunk)[slot.offset : slot.end].view(slot.shape)
        return self.manager.residency.in_memory(chunk).view(slot)

    def _gathered(self, chunk: Chunk) -> torch.Tensor:
        """A host copy of any rank's chunk, broadcast by its owner (every rank must ask too).

        The broadcast goes through a buffer on the compute device (NCCL takes no host
        memory); one chunk is cached, so reading a chunk's tensors in order costs one
        broadcast and memory stays bounded by a chunk.
        """
        m = self.manager
        key = (chunk.kind, chunk.index)
        if self._gather_cache is None or self._gather_cache[0] != key:
            if m.owned(chunk):
                buf = m.residency.in_memory(chunk).payload.to(m.device)
            else:
                buf = torch.empty(chunk.capacity, dtype=chunk.dtype, device=m.device)
            self.zero.broadcast(buf, src=m.owner(chunk))
            self._gather_cache = (key, buf.cpu())
        return self._gather_cache[1]

    @torch.no_grad()
    def load_tensor(self, name: str, value: torch.Tensor, own: torch.Tensor) -> None:
        """Write one state-dict entry (any dtype) into its slot, or into a plain tensor."""
        slot = self.by_name.get(name)
        if slot is None:
            self.excluded.load(name, own, value)
            return
        if tuple(value.shape) != tuple(slot.shape):
            raise ValueError(
                f"{name}: shape {tuple(value.shape)} in the source, "
                f"{tuple(slot.shape)} in the model"
            )
        if isinstance(slot, Span):
            flat = value.reshape(-1)
            for piece, a, b in slot.ranges():
                self._load_slot(piece, flat[a:b])
            return
        self._load_slot(slot, value)

    def _load_slot(self, slot: TensorSlot, value: torch.Tensor) -> None:
        m = self.manager
        if not m.owned(m.param_chunk(slot)):
            return  # another rank owns this tensor and loads it there
        if slot.trainable:
            chunks = [m.chunk_of(k, slot) for k in (ChunkType.PARAM_FP32, ChunkType.PARAM)]
            m.residency.make_resident([c for c in chunks if c.tier == TierName.DISK], TierName.HOST)
            master = chunks[0].view(slot)
            master.copy_(value)
            chunks[1].view(slot).copy_(master)
        else:
            m.residency.in_memory(m.chunk_of(ChunkType.FROZEN, slot)).view(slot).copy_(value)
            self.frozen_from_source = False
            if slot.state is TensorState.FREE:  # streaming in: a chunk whose tensors are all
                slot.set_state(TensorState.HOLD)  # in may go to disk to make room for the next


__all__ = ["ModelTensors"]
