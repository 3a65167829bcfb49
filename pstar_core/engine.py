"""`initialize(model_fn, config) -> Engine`: the one verb of the engine, and the Engine.

The model is built on the `meta` device, so no weight exists before its chunk slot does;
each parameter is then materialized straight into its slot (the fp32 master slot for a
trainable parameter, so initialization happens at full precision) and initialized by the
model's own init code. The param chunks are cast from the masters, and from then on a
parameter has storage only while an operator uses it.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import math
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pstar_core import lora, startup
from pstar_core.chunk import TRAINABLE_LISTS, ChunkType, TensorSlot, TensorState
from pstar_core.config import ConfigError, EngineConfig, missing_unexpected
from pstar_core.devices import resolve_device, to_device
from pstar_core.excluded import ExcludedParams
from pstar_core.hooks import install_hooks, operator_slots, saved_tensor_hooks
from pstar_core.manager import ChunkManager, TrainingPhase
from pstar_core.mapping import make_plan
from pstar_core.optim import ChunkAdamW, LossScaler, lr_factor, resolve_groups
from pstar_core.precision import resolve as resolve_precision
from pstar_core.tiers import FreedMemory, TierName, return_freed_host_memory
from pstar_core.tracer import BatchShape, Mode
from pstar_core.zero import ZeroGroup

log = logging.getLogger(__name__)
WeightSource = Callable[["Engine"], None]


def initialize(
    model_fn: Callable[[], nn.Module] | str | Path,
    config: EngineConfig | dict[str, Any] | str | Path | None = None,
    process_group: Any = None,
) -> Engine:
    """Build the model from `model_fn` on the meta device and put its parameters in chunks.

    `model_fn` may instead be a Hugging Face model directory (config.json + safetensors,
    sharded or not): the weights then stream from the files into the chunk slots.
    When torch.distributed is initialized, the chunks are sharded over `process_group`
    (default: the default group) with chunk-based ZeRO; nothing else changes.

    `config` is an `EngineConfig`, a dict, or a YAML path (see `pstar_core.config`).
    `model_fn` may also return a model whose weights already exist (for example one that
    loads them itself): they are then copied into the chunks and the originals dropped.
    """
    cfg = EngineConfig.parse(config)
    if isinstance(model_fn, (str, Path)):
        from pstar_core.hf import initialize_from_hf_dir

        return initialize_from_hf_dir(Path(model_fn), cfg, process_group)
    if not callable(model_fn):
        raise TypeError(f"model_fn must be a callable returning an nn.Module, got {model_fn!r}")
    with torch.device("meta"):
        module = model_fn()
    if not isinstance(module, nn.Module):
        raise TypeError(f"model_fn returned {type(module).__name__}, expected an nn.Module")
    return Engine(with_lora(module, cfg), cfg, process_group=process_group)


def with_lora(module: nn.Module, cfg: EngineConfig) -> nn.Module:
    """The model with the config's LoRA adapters added (on meta), or as it is."""
    if cfg.lora is None:
        return module
    if lora.is_peft(module):
        raise ConfigError(
            "lora: the model already is a peft model; drop the lora section (its adapters "
            "train as they are) or return the base model from model_fn"
        )
    return lora.wrap(module, cfg.lora)


class Engine:
    """Trains `module` with its model data in chunks. Use like the module plus an optimizer:

    >>> out = engine(input_ids=x, labels=y); engine.backward(out.loss); engine.step()
    """

    def __init__(
        self,
        module: nn.Module,
        cfg: EngineConfig,
        weights: WeightSource | None = None,
        process_group: Any = None,
    ) -> None:
        self.module = module
        self.source_dir: Path | None = None  # a HF model directory the weights came from
        # the frozen chunks hold exactly what `source_dir` holds (checkpoints leave them out)
        self.frozen_from_source = False
        self.device = resolve_device(cfg.device)
        self.global_step = 0

        params = _unique_params(module)
        exclude = [re.compile(p) for p in cfg.exclude_from_chunks]
        chunked = [
            (names, p) for names, p in params if not any(r.search(names[0]) for r in exclude)
        ]
        excluded = [(names, p) for names, p in params if any(r.search(names[0]) for r in exclude)]

        self.zero = ZeroGroup.from_default(
            process_group, cfg.zero.variant, self.device, cfg.zero.overlap_reductions
        )
        # 'auto' resolved from the hardware, the same on every rank; under ZeRO on a GPU
        # this first collective also creates NCCL's communicator (and its buffers), so the
        # device budget is measured with them in place
        self.precision = resolve_precision(
            cfg.dtype, self.device, self.zero.all_reduce_max if self.zero.enabled else None
        )
        cfg = cfg.model_copy(update={"dtype": self.precision.dtype})
        self.config = cfg
        self.dtype = cfg.torch_dtype
        log.info("compute dtype %s (%s)", self.precision.dtype, self.precision.reason)
        self.plan = make_plan(
            [p.numel() for _, p in chunked],
            [p.requires_grad for _, p in chunked],
            [names[0] for names, _ in chunked],
            cfg.dtype,
            cfg.chunk_size,
            self.zero.nproc,
        )
        self.manager = ChunkManager(self.plan, self.dtype, self.device, cfg.memory, self.zero)
        self._lazy_frozen = startup.allocate(self.manager.residency, weights is not None)
        groups, group_of = resolve_groups(
            [names[0] for names, _ in params], [p.dim() for _, p in params], cfg
        )
        group_by_id = {id(p): g for (_, p), g in zip(params, group_of, strict=True)}
        self.slots: dict[int, TensorSlot] = {}
        tr_place = iter(self.plan.trainable.placements)
        fr_place = iter(self.plan.frozen.placements)
        for names, p in chunked:
            place = next(tr_place if p.requires_grad else fr_place)
            slot = TensorSlot(
                names[0],
                names,
                p,
                p.shape,
                place.chunk_index,
                place.offset,
                p.numel(),
                p.requires_grad,
                group_by_id[id(p)],
            )
            self.manager.add_slot(slot)
            self.slots[id(p)] = slot
        self.by_name = {n: s for s in self.slots.values() for n in s.aliases}
        self.excluded = ExcludedParams(excluded, self.dtype, self.device, cfg, groups, group_by_id)
        self._materialize(weights)
        self.manager.drop_remote()
        self.load_peak_bytes = startup.enforce_budgets(self.manager.residency)
        startup.pin_host_chunks(self.manager.residency)
        self.manager.check_working_sets(
            [ops for mod in module.modules() if (ops := operator_slots(mod, self.slots))]
        )
        self._closed = False
        self._gather_cache: tuple[Any, torch.Tensor] | None = None
        if cfg.activation_checkpointing:
            _enable_activation_checkpointing(module)
        self.optimizer = ChunkAdamW(self.manager, cfg, groups)
        self.scaler = LossScaler(cfg.loss_scale, enabled=cfg.dtype == "fp16")
        self._hooks = install_hooks(module, self.slots, self.manager)
        self._saved_tensor_hooks = saved_tensor_hooks(self.manager)
        return_freed_host_memory()  # what loading the weights left behind
        self._freed = FreedMemory()

    # -- materialization ----------------------------------------------------------------

    def _materialize(self, weights: WeightSource | None) -> None:
        """Point every parameter at its slot, initialize or load, then cast the masters down.

        With `weights` (a callable filling the slots, e.g. streaming a HF checkpoint), the
        model's random init is skipped except on modules without chunked parameters,
        whose non-persistent buffers (rotary frequencies) only init code can compute.
        """
        m = self.manager
        preloaded = False
        # Another rank's tensor is initialized into a staging buffer and dropped, where
        # init code will write it: a random init writes every tensor, a weights source
        # only the adapters peft initializes; the others stay empty here.
        adapters = lora.is_peft(self.module)
        written = [s for s in self.slots.values() if weights is None or (adapters and s.trainable)]
        staging = _Staging(written, m, self.dtype)
        for slot in self.slots.values():
            if slot.param.is_meta:
                _rehome(slot.param, self.device)
            if self._lazy_frozen and not slot.trainable:
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
        preloaded |= self.excluded.materialize()
        for mod in self.module.modules():
            for name, buf in mod._buffers.items():
                if buf is not None and buf.is_meta:
                    mod._buffers[name] = torch.empty_like(buf, device=self.device)
                elif buf is not None and buf.device != self.device:
                    mod._buffers[name] = buf.to(self.device)
        with torch.no_grad():
            if weights is not None:
                _init_buffer_only_modules(self.module, self.slots)
                weights(self)
            elif not preloaded:
                _run_model_init(self.module)
            if lora.is_peft(self.module) and not preloaded:
                lora.init_adapters(self.module)
            if self.config.lora is not None and self.config.lora.adapter_dir is not None:
                lora.load_adapter(self, self.config.lora.adapter_dir)
        for param, master in zip(
            m.lists[ChunkType.PARAM], m.lists[ChunkType.PARAM_FP32], strict=True
        ):
            if m.owned(param):
                param.payload.copy_(master.payload)
        self.excluded.sync_from_masters()
        for slot in self.slots.values():
            if slot.state is not TensorState.HOLD:  # a lazily loaded frozen one is HOLD already
                slot.set_state(TensorState.HOLD)
            m.drop_storage(slot)

    # -- training -----------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The module's forward. A training forward (grad enabled, `train()` mode) starts
        an iteration if none is under way; any other forward (evaluation) is a pass of
        its own that the trace does not see (see `MemoryTracer`)."""
        self._check_open()
        m = self.manager
        evaluating = not (torch.is_grad_enabled() and self.module.training)
        args, kwargs = to_device((args, kwargs), self.device)  # the caller's batch, moved
        with self._abandon_on_error():
            if m.phase is TrainingPhase.IDLE:
                shape = batch_shape(args, kwargs)
                if evaluating:
                    m.phase = TrainingPhase.EVALUATION
                    m.tracer.start_untraced_pass(shape)
                else:
                    # an iteration (and the warm-up trace) starts with a training forward,
                    # so an evaluation before training does not become the traced iteration
                    m.tracer.start_iteration(shape)
            if m.phase is not TrainingPhase.EVALUATION:
                m.phase = TrainingPhase.FORWARD
            with self._saved_tensor_hooks:
                out = self.module(*args, **kwargs)
            m.finish_forward()
            m.reset_after_forward()
            if m.phase is TrainingPhase.EVALUATION:
                m.end_pass()
                m.phase = TrainingPhase.IDLE
        return out

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of `loss`; gradients add up over calls until `step()`."""
        self._check_open()
        with self._abandon_on_error():
            self.manager.phase = TrainingPhase.BACKWARD
            if self.scaler.enabled:
                loss = loss.float() * self.scaler.scale
            loss.backward()
            # Accessed for backward but received no gradient (frozen, or not on the loss
            # path).
            self.manager.release_all(TensorState.HOLD)
            self.manager.finish_backward()

    def step(self) -> bool:
        """One AdamW step over the accumulated gradients; False if skipped for fp16 overflow."""
        self._check_open()
        with self._abandon_on_error():
            self.manager.phase = TrainingPhase.STEP
            return self._step()

    def _step(self) -> bool:
        opt = self.optimizer
        opt.fold_grads()
        if self.zero.enabled:
            self.excluded.average_grads(self.zero)
        inv_scale = 1.0 / self.scaler.scale
        clip = self.config.gradient_clipping
        coef = 1.0
        if self.scaler.enabled or clip is not None:
            norm_sq = opt.grad_norm_sq()
            if self.zero.enabled:
                norm_sq = self.zero.all_reduce_sum(norm_sq)
            norm_sq += self.excluded.grad_norm_sq()
            if not math.isfinite(norm_sq):
                if not self.scaler.enabled:
                    raise FloatingPointError("gradient norm is not finite (inf/nan in gradients)")
                opt.drop_grads()
                self.excluded.zero_grad()
                self.scaler.update(overflow=True)
                self._end_iteration()
                log.info("fp16 overflow: step skipped, loss scale now %g", self.scaler.scale)
                return False
            if clip is not None:
                norm = math.sqrt(norm_sq) * inv_scale
                coef = min(1.0, clip / (norm + 1e-6))
        opt.step(inv_scale * coef)
        self.excluded.step(inv_scale * coef, opt.lr_scale)
        self.scaler.update(overflow=False)
        self.global_step += 1
        opt.lr_scale = lr_factor(self.config.scheduler, self.global_step)
        self._end_iteration()
        return True

    def _end_iteration(self) -> None:
        self.manager.phase = TrainingPhase.IDLE
        self.manager.end_iteration()
        self.manager.end_pass()
        self._freed.maybe_return()

    @contextlib.contextmanager
    def _abandon_on_error(self) -> Iterator[None]:
        try:
            yield
        except BaseException as e:
            try:
                self._abandon(e)
            except Exception:  # the original error is what the caller needs to see
                log.exception("could not reset the engine after an error")
            raise

    def abandon_iteration(self) -> None:
        """Give up the iteration under way, as after an exception inside it: the gradients
        accumulated since the last `step()` are dropped (parameters keep their values),
        the warm-up trace being recorded is discarded (the next iteration records one
        again), and the profiler is stopped. The engine calls it itself when forward,
        backward or step raise; call it when your own code fails between them.

        Under ZeRO every rank gives up the same iteration: the others raise
        `pstar_core.zero.RankFailed` (with this rank's reason) at their next collective,
        so a loop that catches it on every rank and goes on stays in step (see [Note:
        ranks fail together] in zero.py).
        """
        self._abandon(RuntimeError("abandon_iteration() was called"))

    def _abandon(self, error: BaseException) -> None:
        if self.zero.enabled:
            self.zero.report_failure(error)
        m = self.manager
        m.tracer.abort()
        m.groups.drop_all()
        m.release_all(TensorState.HOLD)
        m.reset_after_forward()
        if any(s.state is TensorState.HOLD_AFTER_BWD for s in m.slots) or m.grad_accum:
            self.optimizer.drop_grads()
        self.excluded.zero_grad()
        m.phase = TrainingPhase.IDLE

    def close(self) -> None:
        """Free every chunk (all tiers), close the spill file and remove the hooks. The
        engine cannot be used afterwards; closing twice is harmless. Also `with engine:`."""
        if self._closed:
            return
        if (
            self.manager.phase is not TrainingPhase.IDLE
            or self.manager.tracer.mode is not Mode.IDLE
        ):
            self._abandon(RuntimeError("the engine was closed inside an iteration"))
        for h in self._hooks:
            h.remove()
        self.manager.close()
        self._closed = True

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this engine was closed: build a new one with initialize()")

    def train(self, mode: bool = True) -> Engine:
        self.module.train(mode)
        return self

    def eval(self) -> Engine:
        return self.train(False)

    @property
    def lr(self) -> float:
        """The current learning rate of the base optimizer group."""
        return self.config.optimizer.lr * self.optimizer.lr_scale

    # -- state ---------------------------------------------------------------------------

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The model's state dict under its own names; trainable weights are fp32 masters.
        Every tensor is a host copy, wherever its chunk is (the device may not hold the
        whole model)."""
        names = self.module.state_dict(keep_vars=True)
        out = {name: self.read_tensor(name).to("cpu", copy=True) for name in names}
        self.forget_gathered()
        return out

    def forget_gathered(self) -> None:
        """Drop the chunk cached by `read_tensor` under ZeRO."""
        self._gather_cache = None

    def read_tensor(self, name: str) -> torch.Tensor:
        """A view of one state-dict entry: the fp32 master of a trainable parameter."""
        slot = self.by_name.get(name)
        if slot is None:
            value = self.excluded.value(name)
            return (value if value is not None else self.module.get_buffer(name)).detach()
        kind = ChunkType.PARAM_FP32 if slot.trainable else ChunkType.FROZEN
        chunk = self.manager.chunk_of(kind, slot)
        if self.zero.enabled:
            return self._gathered(chunk)[slot.offset : slot.end].view(slot.shape)
        return self.manager.residency.in_memory(chunk).view(slot)

    def _gathered(self, chunk: Any) -> torch.Tensor:
        """A host copy of any rank's chunk, broadcast by its owner (every rank must ask too).

        The broadcast goes through a buffer on the compute device (NCCL takes no host
        memory); one chunk is cached, so reading a chunk's tensors in order costs one
        broadcast and memory stays bounded by a chunk.
        """
        key = (chunk.kind, chunk.index)
        if self._gather_cache is None or self._gather_cache[0] != key:
            if self.manager.owned(chunk):
                buf = self.manager.residency.in_memory(chunk).payload.to(self.device)
            else:
                buf = torch.empty(chunk.capacity, dtype=chunk.dtype, device=self.device)
            self.zero.broadcast(buf, src=self.manager.owner(chunk))
            self._gather_cache = (key, buf.cpu())
        return self._gather_cache[1]

    def load_state_dict(self, state: dict[str, torch.Tensor], strict: bool = True) -> None:
        """Load weights by name (the masters at full precision; optimizer states kept)."""
        self._require_no_pending_grads("load_state_dict")
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
            if slot.state is TensorState.FREE:  # streaming in: a chunk whose tensors are all in
                slot.set_state(TensorState.HOLD)  # may go to disk to make room for the next

    def export_hf(
        self,
        directory: str | Path,
        dtype: torch.dtype | None = None,
        max_shard_bytes: int | None = None,
        variant: str | None = None,
    ) -> Path:
        """Write a directory that `transformers` loads with `from_pretrained` (safetensors,
        config, and the source's tokenizer files), shard by shard with bounded memory.

        A LoRA model exports as `variant="adapter"` (the default: a PEFT adapter directory
        that `PeftModel.from_pretrained` loads on its base) or `"merged"` (the base with
        the adapters folded in, a plain transformers model)."""
        from pstar_core.hf import export_hf

        self._require_no_pending_grads("export_hf")
        return export_hf(self, Path(directory), dtype, max_shard_bytes, variant)

    def _require_no_pending_grads(self, what: str) -> None:
        if (
            any(s.state is not TensorState.HOLD for s in self.slots.values())
            or self.manager.grad_accum
        ):
            raise RuntimeError(
                f"{what}: there are gradients not yet applied; call step() first "
                "(or load before the first backward)"
            )

    def save_checkpoint(self, directory: str | Path, shared: bool = True) -> Path:
        """Write this rank's chunks and the training state to `directory`.

        With `shared` (one filesystem for all ranks) the directory is replaced atomically;
        otherwise each rank fills its own directory (see `pstar_core.checkpoint`).
        """
        from pstar_core.checkpoint import save_checkpoint

        self._require_no_pending_grads("save_checkpoint")
        return save_checkpoint(self, Path(directory), shared)

    def load_checkpoint(self, directory: str | Path) -> None:
        """Restore a checkpoint written by `save_checkpoint` for the same model and config."""
        from pstar_core.checkpoint import load_checkpoint

        self._require_no_pending_grads("load_checkpoint")
        load_checkpoint(self, Path(directory))

    def stats(self) -> dict[str, Any]:
        """Measured numbers: chunks per list and tier, bytes, utilization, bytes moved."""
        m = self.manager
        chunks: dict[str, dict[str, Any]] = {}
        model_bytes = 0
        for kind, lst in m.lists.items():
            tiers: dict[str, int] = {}
            lst = [c for c in lst if m.owned(c)]
            for c in lst:
                if c.tier is not None:
                    tiers[c.tier] = tiers.get(c.tier, 0) + 1
            used = sum(c.used_elems for c in lst)
            esize = torch.empty((), dtype=lst[0].dtype).element_size() if lst else 0
            model_bytes += used * esize
            chunks[kind.value] = {
                "count": len(lst),
                "bytes": sum(c.nbytes for c in lst),
                "used_bytes": used * esize,
                "utilization": used / (len(lst) * self.plan.chunk_size) if lst else 1.0,
                "by_tier": tiers,
            }
        model_bytes += m.grad_accum.bytes + self.excluded.model_data_bytes()
        n_params = self.plan.params + self.excluded.numel  # of the whole model
        return {
            "dtype": self.config.dtype,  # resolved: never 'auto'
            "compute_dtype": self.config.dtype,
            "precision": self.precision.as_dict(),
            "chunk_size": self.plan.chunk_size,
            "params": n_params,
            "trainable_params": self.plan.trainable_params + self.excluded.trainable_numel,
            "chunks": chunks,
            "chunk_bytes": sum(c["bytes"] for c in chunks.values()) + m.grad_accum.bytes,
            "utilization": self.plan.utilization,
            "model_data_bytes": model_bytes,
            "model_data_bytes_per_param": model_bytes / n_params if n_params else 0.0,
            # frozen weights (a LoRA base) and trainable ones apart: ~2 and 14 in bf16
            "bytes_per_param": _bytes_per_param(chunks, self.plan, self.zero.nproc),
            "grad_accum_bytes": m.grad_accum.bytes,
            "peak_grad_accum_bytes": m.grad_accum.peak_bytes,
            "bytes_moved": dict(m.residency.transfers.bytes_moved),
            "prefetched": dict(m.residency.transfers.prefetched),
            "moves": dict(m.residency.transfers.moves),
            "bytes_moved_last_iteration": dict(m.residency.transfers.last_iteration_bytes_moved),
            "moves_last_iteration": dict(m.residency.transfers.last_iteration_moves),
            "tiers": m.residency.tier_bytes(),
            "load_peak_bytes": dict(self.load_peak_bytes),  # per tier, while loading
            "tracer": self.manager.tracer.stats(),
            "margin_bytes": self.manager.margin_bytes,
            "device_adam_chunks": len(m.device_adam),
            "world_size": self.zero.nproc,
            "device": str(self.device),
            "threads": torch.get_num_threads(),
            "rank": self.zero.rank,
            "comm_bytes_sent": self.zero.bytes_sent,
            "comm_overlapped_reductions": self.zero.overlapped,
            "host_pool": self.manager.residency.host_pool(),
            "comm_calls": {k: {"calls": c, "bytes": b} for k, (c, b) in self.zero.calls.items()},
            "comm_bytes_by_list": {k: dict(v) for k, v in self.zero.by_list.items()},
            "overflow_count": self.scaler.overflows,
            "loss_scale": self.scaler.scale,
            "global_step": self.global_step,
            "lr": self.lr,
        }


def _bytes_per_param(chunks: dict[str, dict[str, Any]], plan: Any, nproc: int) -> dict[str, float]:
    """Model data per parameter of the frozen list and of the trainable lists, from the
    bytes this rank's chunks use (a rank holds 1/nproc of each list)."""
    frozen = chunks[ChunkType.FROZEN.value]["used_bytes"]
    trainable = sum(chunks[k.value]["used_bytes"] for k in TRAINABLE_LISTS)
    n_frozen = plan.params - plan.trainable_params
    return {
        "frozen": frozen * nproc / n_frozen if n_frozen else 0.0,
        "trainable": trainable * nproc / plan.trainable_params if plan.trainable_params else 0.0,
    }


def batch_shape(args: tuple[Any, ...], kwargs: dict[str, Any]) -> BatchShape | None:
    """The batch's size for the tracer: `input_ids` if given, else the largest tensor
    argument; tokens = its elements, sequence = its last dimension."""
    ids = kwargs.get("input_ids")
    tensors = [ids] if isinstance(ids, torch.Tensor) else []
    if not tensors:
        tensors = [
            t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor) and t.dim() > 0
        ]
    if not tensors:
        return None
    t = max(tensors, key=lambda x: x.numel())
    if t.numel() == 0:
        return None
    return BatchShape(tokens=t.numel(), seq=t.shape[-1])


def _unique_params(module: nn.Module) -> list[tuple[tuple[str, ...], nn.Parameter]]:
    """Parameters in registration (= initialization) order, each with all its names."""
    seen: dict[int, tuple[list[str], nn.Parameter]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        seen.setdefault(id(p), ([], p))[0].append(name)
    return [(tuple(names), p) for names, p in seen.values()]


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


def _init_buffer_only_modules(module: nn.Module, slots: dict[int, TensorSlot]) -> None:
    hf_init = getattr(module, "_init_weights", None)
    for mod in module.modules():
        if any(id(p) in slots for p in mod.parameters(recurse=False)) or not mod._buffers:
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


def _enable_activation_checkpointing(module: nn.Module) -> None:
    fn = getattr(module, "activation_checkpointing_enable", None) or getattr(
        module, "gradient_checkpointing_enable", None
    )
    if fn is None:
        raise ConfigError(
            f"activation_checkpointing: {type(module).__name__} has no "
            "gradient_checkpointing_enable(); turn it off or add that method"
        )
    if "gradient_checkpointing_kwargs" in inspect.signature(fn).parameters:
        # Non-reentrant checkpointing re-runs forward through the same hooks and graph.
        fn(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        fn()


__all__ = ["Engine", "initialize"]
