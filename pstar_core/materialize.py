"""Materialization: a model built on `meta` gets its weights, straight into the chunks.

Each parameter is pointed at its chunk slot (the fp32 master slot for a trainable one, so
initialization happens at full precision), then initialized by the model's own init
code or loaded from a weights source (`WeightSource`, e.g. streaming a Hugging Face
checkpoint). The param chunks are then cast from the masters, and from then on a
parameter has storage only while an operator uses it.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pstar_core import lora
from pstar_core.chunk import ChunkType, TensorSlot, TensorState
from pstar_core.spans import Span
from pstar_core.store import ChunkStore
from pstar_core.tensors import ModelTensors

# fills the slots of a store (an engine's `tensors`), e.g. `hf.stream_weights`
WeightSource = Callable[[ChunkStore], None]


def materialize(
    tensors: ModelTensors,
    by_param: dict[int, TensorSlot],
    spans: dict[int, Span],
    weights: WeightSource | None,
    lazy_frozen: bool,
    adapter_dir: Path | None,
) -> None:
    """Point every parameter at its slot, initialize or load, then cast the masters down.

    With `weights` (a callable filling the slots, e.g. streaming a HF checkpoint), the
    model's random init is skipped except on modules without chunked parameters,
    whose non-persistent buffers (rotary frequencies) only init code can compute.
    `lazy_frozen`: frozen chunks get memory only when their tensors stream in
    (`startup.allocate`). `adapter_dir`: a LoRA adapter directory loaded over the init.
    A parameter larger than a chunk (`spans`) that init code writes is one whole copy
    while it runs, cut into its pieces after.
    """
    m = tensors.manager
    module = tensors.module
    preloaded = False
    # Another rank's tensor is initialized into a staging buffer and dropped, where
    # init code will write it: a random init writes every tensor, a weights source
    # only the adapters peft initializes; the others stay empty here.
    adapters = lora.is_peft(module)
    written = [
        s
        for s in by_param.values()
        if s.span is None and (weights is None or (adapters and s.trainable))
    ]
    staging = _Staging(written, m, m.dtype)
    for slot in by_param.values():
        if slot.span is not None:
            continue  # its span's parameter is what init code writes (below)
        if slot.param.is_meta:
            _rehome(slot.param, m.device)
        if lazy_frozen and not slot.trainable:
            continue  # streamed into its chunk by load_tensor; no view needed
        kind = ChunkType.PARAM_FP32 if slot.trainable else ChunkType.FROZEN
        chunk = m.chunk_of(kind, slot)
        view = chunk.view(slot) if m.owned(chunk) else staging.view(slot)
        if not slot.param.is_meta and slot.param.numel():
            if view is not None:
                view.copy_(slot.param.data)  # model_fn built real weights: keep them
            preloaded = True
        if view is not None:
            slot.param.data = view
    whole: list[tuple[Span, torch.Tensor]] = []  # the spans init code writes, and their copy
    for span in spans.values():
        p = span.param
        if p.is_meta:
            _rehome(p, m.device)
        if weights is not None and not (adapters and span.trainable):
            continue  # `weights` writes the pieces (`ModelTensors.load_tensor`)
        if lazy_frozen and not span.trainable:
            continue
        copy = torch.empty(span.shape, dtype=torch.float32 if span.trainable else m.dtype)
        if p.numel():
            copy.copy_(p.data)  # model_fn built real weights: keep them
            preloaded = True
        p.data = copy
        whole.append((span, copy))
    preloaded |= tensors.excluded.materialize()
    for mod in module.modules():
        for name, buf in mod._buffers.items():
            if buf is not None and buf.is_meta:
                mod._buffers[name] = torch.empty_like(buf, device=m.device)
            elif buf is not None and buf.device != m.device:
                mod._buffers[name] = buf.to(m.device)
    with torch.no_grad():
        if weights is not None:
            _init_buffer_only_modules(module, by_param.keys() | spans.keys())
            weights(tensors)
        elif not preloaded:
            _run_model_init(module)
        if lora.is_peft(module) and not preloaded:
            lora.init_adapters(module)
        for span, copy in whole:  # cut into its pieces, as a loaded tensor is
            tensors.load_tensor(span.name, copy, span.param)
        if adapter_dir is not None:
            lora.load_adapter(tensors, adapter_dir)
    for param, master in zip(m.lists[ChunkType.PARAM], m.lists[ChunkType.PARAM_FP32], strict=True):
        if m.owned(param):
            param.payload.copy_(master.payload)
    tensors.excluded.sync_from_masters()
    for slot in by_param.values():
        if slot.state is not TensorState.HOLD:  # a lazily loaded frozen one is HOLD already
            slot.set_state(TensorState.HOLD)
        m.drop_storage(slot)


class _Staging:
    """Where other ranks' tensors are initialized (and dropped) under ZeRO: the model's
    init code runs over every parameter in order, so the random stream reaches this
    rank's own tensors exactly as on one rank, but another rank's tensor only ever
    occupies a buffer the size of the largest such tensor (one per dtype), reused by all
    of them, instead of its chunk. A pretrained load writes only this rank's tensors, so
    it needs none (but for a LoRA model's adapters, which peft initializes)."""

    def __init__(self, slots: Any, m: Any, dtype: torch.dtype) -> None:
        need: dict[torch.dtype, int] = {}
        self.slots = set()  # of the tensors init code writes, other ranks' (by id)
        for s in slots:
            if not m.owned(m.param_chunk(s)):
                dt = torch.float32 if s.trainable else dtype
                need[dt] = max(need.get(dt, 0), s.numel)
                self.slots.add(id(s))
        self.dtype = dtype
        self.buffers = {dt: torch.empty(n, dtype=dt, device="cpu") for dt, n in need.items()}

    def view(self, slot: TensorSlot) -> torch.Tensor | None:
        """Where another rank's tensor is written while initializing (None: nothing writes
        it here, so it stays empty)."""
        if id(slot) not in self.slots:
            return None
        buf = self.buffers[torch.float32 if slot.trainable else self.dtype]
        return buf[: slot.numel].view(slot.shape)


def _rehome(param: nn.Parameter, device: torch.device) -> None:
    """Turn a meta parameter into an empty one on `device`, keeping the Python object.

    `param.data = x` cannot cross from meta to a real device, and replacing the object
    would break tied weights and any reference the user holds; swapping keeps both.
    """
    empty = nn.Parameter(torch.empty(0, device=device), requires_grad=param.requires_grad)
    torch.utils.swap_tensors(param, empty)


def _init_buffer_only_modules(module: nn.Module, chunked: Collection[int]) -> None:
    """Init the modules without chunked parameters (`chunked`: the parameters' ids)."""
    hf_init = getattr(module, "_init_weights", None)
    for mod in module.modules():
        if any(id(p) in chunked for p in mod.parameters(recurse=False)) or not mod._buffers:
            continue
        if hf_init is not None:
            hf_init(mod)
        elif hasattr(mod, "reset_parameters"):
            mod.reset_parameters()


def _run_model_init(module: nn.Module) -> None:
    """Run the model's own initializer on the materialized slots."""
    if hasattr(module, "initialize_weights"):  # transformers PreTrainedModel
        module.initialize_weights()
    elif hasattr(module, "init_weights"):
        module.init_weights()
    else:
        for mod in module.modules():
            if hasattr(mod, "reset_parameters"):
                mod.reset_parameters()


__all__ = ["WeightSource", "materialize"]
