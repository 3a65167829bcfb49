"""`initialize(model_fn, config) -> Engine`: the one verb of the engine, and the Engine.

The model is built on the `meta` device, so no weight exists before its chunk slot does;
each parameter is then materialized straight into its slot (see `materialize`), and from
then on a parameter has storage only while an operator uses it.

The Engine wires the parts together and runs the iteration: forward (`__call__`),
`backward` and `step`. What it reports (`stats`), what it reads and writes
(`tensors`: state dicts, checkpoints, Hugging Face export) and how it gives up a failed
iteration (`abandon`) live in modules of their own.
"""

from __future__ import annotations

import inspect
import logging
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pstar_core import checkpoint, hf, lora, startup, stats
from pstar_core.abandon import IterationGuard
from pstar_core.checkpoint import TrainingState
from pstar_core.chunk import TensorSlot, TensorState
from pstar_core.config import ConfigError, EngineConfig
from pstar_core.devices import host_threads, resolve_device, rng_state, set_rng_state, to_device
from pstar_core.excluded import ExcludedParams
from pstar_core.hooks import install_hooks, operator_slots, saved_tensor_hooks
from pstar_core.manager import ChunkManager, TrainingPhase
from pstar_core.mapping import Plan, make_plan
from pstar_core.materialize import WeightSource, materialize
from pstar_core.optim import ChunkAdamW, LossScaler, StepHyper, lr_factor, resolve_groups
from pstar_core.precision import resolve as resolve_precision
from pstar_core.spans import Span, stand_in
from pstar_core.tensors import ModelTensors
from pstar_core.tiers import FreedMemory, host_whole, return_freed_host_memory
from pstar_core.tracer import BatchShape, Mode
from pstar_core.zero import ZeroGroup

log = logging.getLogger(__name__)


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
        return _from_hf_dir(Path(model_fn), cfg, process_group)
    if not callable(model_fn):
        raise TypeError(f"model_fn must be a callable returning an nn.Module, got {model_fn!r}")
    with torch.device("meta"):
        module = model_fn()
    if not isinstance(module, nn.Module):
        raise TypeError(f"model_fn returned {type(module).__name__}, expected an nn.Module")
    return Engine(with_lora(module, cfg), cfg, process_group=process_group)


def _from_hf_dir(directory: Path, cfg: EngineConfig, process_group: Any) -> Engine:
    """An engine whose weights stream from a Hugging Face model directory (`hf`)."""
    module, files = hf.model_on_meta(directory)
    engine = Engine(
        with_lora(module, cfg),
        cfg,
        weights=lambda store: hf.stream_weights(store, files),
        process_group=process_group,
    )
    engine.tensors.source_dir = directory
    engine.tensors.frozen_from_source = True
    return engine


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
        # What this host can give, read before the first collective: no rank of this host
        # has made a chunk yet, so each reads the same (one that had would leave the
        # others less: see [Note: the default host budget] in tiers.py)
        whole = host_whole(cfg.memory.host_reserved)
        self.device = resolve_device(cfg.device)
        self.global_step = 0
        host_threads()  # torchrun's one thread per rank would starve host Adam

        params = _unique_params(module)
        exclude = [re.compile(p) for p in cfg.exclude_from_chunks]
        chunked = [
            (names, p) for names, p in params if not any(r.search(names[0]) for r in exclude)
        ]
        excluded = [(names, p) for names, p in params if any(r.search(names[0]) for r in exclude)]

        self.zero = ZeroGroup.from_default(
            process_group,
            cfg.zero.variant,
            self.device,
            cfg.zero.overlap_reductions,
            cfg.zero.gather_ahead,
            per_section=not cfg.zero.agree_per_collective,
        )
        # 'auto' resolved from the hardware, the same on every rank; under ZeRO on a GPU
        # this first collective also creates NCCL's communicator
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
        # the collectives' own device buffers exist before the device budget is read
        # (see [Note: communicator buffers before the budget] in zero.py)
        self.zero.warm_up(self.plan.chunk_size, self.dtype)
        self.manager = ChunkManager(
            self.plan, self.dtype, self.device, cfg.memory, self.zero, whole
        )
        lazy_frozen = startup.allocate(self.manager.residency, weights is not None)
        groups, group_of = resolve_groups(
            [names[0] for names, _ in params], [p.dim() for _, p in params], cfg
        )
        group_by_id = {id(p): g for (_, p), g in zip(params, group_of, strict=True)}
        # by id(param); a parameter larger than a chunk by its pieces' stand-ins, and in spans
        self.slots, self.spans = _add_slots(chunked, self.plan, group_by_id, self.manager)
        self.excluded = ExcludedParams(excluded, self.dtype, self.device, cfg, groups, group_by_id)
        # the model's tensors by name: what state dicts, checkpoints and exports read
        self.tensors = ModelTensors(
            module, self.manager, self.slots, self.spans, self.excluded, cfg.dtype
        )
        self.by_name = self.tensors.by_name
        adapter_dir = cfg.lora.adapter_dir if cfg.lora is not None else None
        materialize(self.tensors, self.slots, self.spans, weights, lazy_frozen, adapter_dir)
        self.manager.drop_remote()
        self.load_peak_bytes = startup.enforce_budgets(self.manager.residency)
        startup.pin_host_chunks(self.manager.residency)
        self.manager.check_working_sets(
            [
                ops
                for mod in module.modules()
                if (ops := operator_slots(mod, self.slots, self.spans))
            ]
        )
        self._closed = False
        if cfg.activation_checkpointing:
            _enable_activation_checkpointing(module)
        self.optimizer = ChunkAdamW(self.manager, cfg, groups)
        self.scaler = LossScaler(cfg.loss_scale, enabled=cfg.dtype == "fp16")
        self._guard = IterationGuard(self.manager, self.optimizer, self.excluded)
        self.manager.backward_operator = self.optimizer.beside.poll
        self._hooks = install_hooks(module, self.slots, self.spans, self.manager)
        self._saved_tensor_hooks = saved_tensor_hooks(self.manager, list(self.spans.values()))
        return_freed_host_memory()  # what loading the weights left behind
        self._freed = FreedMemory()

    # -- training -----------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The module's forward. A training forward (grad enabled, `train()` mode) starts
        an iteration if none is under way; any other forward (evaluation) is a pass of
        its own that the trace does not see (see `MemoryTracer`)."""
        self._check_open()
        m = self.manager
        evaluating = not (torch.is_grad_enabled() and self.module.training)
        args, kwargs = to_device((args, kwargs), self.device)  # the caller's batch, moved
        with self._guard.on_error():
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
                # [Note: agreed sections] in zero.py: a training forward starts a section;
                # an evaluation inside an iteration ends the one under way (its
                # collectives are not that section's)
                self.zero.point(None if evaluating else "forward", m.tracer.following)
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
        with self._guard.on_error():
            self.manager.phase = TrainingPhase.BACKWARD
            self.zero.point("backward", self.manager.tracer.following)
            if self.scaler.enabled:
                loss = loss.float() * self.scaler.scale
            loss.backward()
            # Accessed for backward but received no gradient (frozen, or not on the loss
            # path).
            self.manager.release_all(TensorState.HOLD)
            self.manager.finish_backward()
            self.zero.point(None, False)

    def backward_and_step(self, loss: torch.Tensor, hyper: StepHyper | None = None) -> bool:
        """`backward(loss)` then `step(hyper)`, with the same result to the bit; where that
        is exact, Adam on the host runs beside backward: each host-Adam chunk is updated
        as soon as backward is done with it, while backward goes on (see [Note: Adam
        beside backward] in beside.py). Use it for the step's last backward when the step
        follows at once. Exact, so it runs so, when: the trace is followed (not the
        warm-up), a device apart from the host computes, no fp16 loss scale is checked
        and no gradient clipping needs the global norm first. Otherwise it is plainly
        backward, then step. False if the step was skipped (fp16 overflow)."""
        self._check_open()
        clip = self.config.gradient_clipping if hyper is None else hyper.max_grad_norm
        if (
            self.config.memory.adam_beside_backward
            and self.device.type != "cpu"
            and not self.scaler.enabled
            and clip is None
        ):
            self.optimizer.beside.arm(hyper)
        self.backward(loss)
        with self._guard.on_error():  # Adam on the chunks whose gradients land from now on
            self.optimizer.beside.drain()
        return self.step(hyper)

    def step(self, hyper: StepHyper | None = None) -> bool:
        """One AdamW step over the accumulated gradients; False if skipped for fp16 overflow.
        `hyper` gives this step's learning rate, betas, eps and weight decay instead of the
        config and its schedule (a loop that sets them per step, as Tinker's `optim_step`)."""
        self._check_open()
        with self._guard.on_error():
            self.manager.phase = TrainingPhase.STEP
            return self._step(hyper)

    def _step(self, hyper: StepHyper | None = None) -> bool:
        opt = self.optimizer
        opt.beside.step_begins()
        if self.zero.enabled:
            self.excluded.average_grads(self.zero)
        inv_scale = 1.0 / self.scaler.scale
        clip = self.config.gradient_clipping if hyper is None else hyper.max_grad_norm
        coef = 1.0
        if self.scaler.enabled or clip is not None:
            opt.fold_grads()  # without a norm, each chunk's at its Adam moment
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
        opt.step(inv_scale * coef, hyper)
        self.excluded.step(inv_scale * coef, opt.lr_scale, hyper)
        self.scaler.update(overflow=False)
        self.global_step += 1
        opt.lr_scale = lr_factor(self.config.scheduler, self.global_step)
        self._end_iteration()
        return True

    def _end_iteration(self) -> None:
        self.manager.phase = TrainingPhase.IDLE
        self.zero.end_step()
        self.manager.end_iteration()
        self.manager.end_pass()
        self._freed.maybe_return()

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
        self._guard.abandon(RuntimeError("abandon_iteration() was called"))

    def close(self) -> None:
        """Free every chunk (all tiers), close the spill file and remove the hooks. The
        engine cannot be used afterwards; closing twice is harmless. Also `with engine:`."""
        if self._closed:
            return
        if (
            self.manager.phase is not TrainingPhase.IDLE
            or self.manager.tracer.mode is not Mode.IDLE
        ):
            self._guard.abandon(RuntimeError("the engine was closed inside an iteration"))
        for h in self._hooks:
            h.remove()
        self.optimizer.beside.close()
        self.manager.close()
        self._closed = True

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this engine was closed: build a new one with initialize()")
        if self.optimizer.beside.torn is not None:
            raise RuntimeError(self.optimizer.beside.torn)

    def train(self, mode: bool = True) -> Engine:
        self.module.train(mode)
        return self

    def eval(self) -> Engine:
        return self.train(False)

    @property
    def lr(self) -> float:
        """The current learning rate of the base optimizer group."""
        return self.config.optimizer.lr * self.optimizer.lr_scale

    def stats(self) -> dict[str, Any]:
        """Measured numbers: chunks per list and tier, bytes, utilization, bytes moved."""
        out = stats.engine_stats(
            self.manager,
            self.excluded,
            self.precision,
            self.scaler,
            load_peak_bytes=self.load_peak_bytes,
            global_step=self.global_step,
            lr=self.lr,
        )
        # chunks whose host Adam ran beside the last step's backward (backward_and_step)
        out["adam_beside_backward_chunks"] = self.optimizer.beside.last_step_chunks
        return out

    # -- state (see `tensors` and `checkpoint`) -------------------------------------------

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The model's state dict under its own names; trainable weights are fp32 masters.
        Every tensor is a host copy, wherever its chunk is (the device may not hold the
        whole model)."""
        return self.tensors.state_dict()

    def load_state_dict(self, state: dict[str, torch.Tensor], strict: bool = True) -> None:
        """Load weights by name (the masters at full precision; optimizer states kept)."""
        self._require_no_pending_grads("load_state_dict")
        self.tensors.load_state_dict(state, strict)

    def read_tensor(self, name: str) -> torch.Tensor:
        """A view of one state-dict entry: the fp32 master of a trainable parameter."""
        return self.tensors.read_tensor(name)

    def load_tensor(self, name: str, value: torch.Tensor, own: torch.Tensor) -> None:
        """Write one state-dict entry (any dtype) into its slot, or into a plain tensor."""
        self.tensors.load_tensor(name, value, own)

    def forget_gathered(self) -> None:
        """Drop the chunk cached by `read_tensor` under ZeRO."""
        self.tensors.forget_gathered()

    @property
    def source_dir(self) -> Path | None:
        """The Hugging Face model directory the weights came from, if any."""
        return self.tensors.source_dir

    @property
    def frozen_from_source(self) -> bool:
        """The frozen chunks hold exactly what `source_dir` holds (checkpoints leave them
        out)."""
        return self.tensors.frozen_from_source

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
        self._require_no_pending_grads("export_hf")
        return hf.export_hf(self.tensors, Path(directory), dtype, max_shard_bytes, variant)

    @property
    def pending_grads(self) -> bool:
        """Whether a backward's gradients wait for `step()` (saving or exporting now would
        leave them out)."""
        return bool(
            any(s.state is not TensorState.HOLD for s in self.slots.values())
            or self.manager.grad_accum
        )

    def _require_no_pending_grads(self, what: str) -> None:
        if self.pending_grads:
            raise RuntimeError(
                f"{what}: there are gradients not yet applied; call step() first "
                "(or load before the first backward)"
            )

    def save_checkpoint(self, directory: str | Path, shared: bool = True) -> Path:
        """Write this rank's chunks and the training state to `directory`.

        With `shared` (one filesystem for all ranks) the directory is replaced atomically;
        otherwise each rank fills its own directory (see `pstar_core.checkpoint`).
        """
        self._require_no_pending_grads("save_checkpoint")
        return checkpoint.save_checkpoint(self, Path(directory), shared)

    def load_checkpoint(self, directory: str | Path, optimizer: bool = True) -> None:
        """Restore a checkpoint written by `save_checkpoint` for the same model and config.
        Without `optimizer`, only the weights: Adam's moments, the step count, the learning
        rate's schedule and the RNG stay as they are (a fresh engine's: training starts
        again from these weights)."""
        self._require_no_pending_grads("load_checkpoint")
        checkpoint.load_checkpoint(self, Path(directory), optimizer)
        self.optimizer.beside.torn = None

    def training_state(self) -> TrainingState:
        """What a checkpoint keeps beside the chunks (see `pstar_core.checkpoint`)."""
        return TrainingState(
            global_step=self.global_step,
            lr_scale=self.optimizer.lr_scale,
            scaler=self.scaler.state_dict(),
            rng=rng_state(self.device),
            excluded=self.excluded.state_dict(),
            placement=self.manager.placement_state(),
        )

    def load_excluded_weights(self, excluded: dict[str, Any]) -> None:
        self.excluded.load_masters(excluded)

    def load_training_state(self, state: TrainingState) -> None:
        """Continue from a checkpoint's training state (its chunks are loaded already)."""
        set_rng_state(state.rng, self.device)
        self.excluded.load_state_dict(state.excluded)
        self.manager.restore_placement(state.placement)
        self.global_step = state.global_step
        self.optimizer.lr_scale = state.lr_scale
        self.scaler.load_state_dict(state.scaler)
        self.optimizer.beside.torn = None


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


def _add_slots(
    chunked: list[tuple[tuple[str, ...], nn.Parameter]],
    plan: Plan,
    group_by_id: dict[int, int],
    manager: ChunkManager,
) -> tuple[dict[int, TensorSlot], dict[int, Span]]:
    """A slot for each chunked parameter where the plan puts it, added to the manager, by
    the parameter's id; for a parameter larger than a chunk, a slot for each piece (by its
    stand-in's id) and the `Span` that joins them (by the parameter's id)."""
    slots: dict[int, TensorSlot] = {}
    spans: dict[int, Span] = {}
    index = {True: 0, False: 0}  # the next tensor's index in each list
    for names, p in chunked:
        trainable = p.requires_grad
        layout = plan.trainable if trainable else plan.frozen
        i, index[trainable] = index[trainable], index[trainable] + 1
        pieces = layout.spans.get(i)
        if pieces is None:
            place = layout.placements[i]
            slot = TensorSlot(
                names[0], names, p, p.shape, place.chunk_index, place.offset, p.numel(),
                trainable, group_by_id[id(p)],
            )  # fmt: skip
            manager.add_slot(slot)
            slots[id(p)] = slot
            continue
        span = Span(names[0], names, p, p.shape, trainable)
        piece_slots = []
        for k, place in enumerate(pieces):
            slot = TensorSlot(
                f"{names[0]}[piece {k + 1} of {len(pieces)}]",
                names,  # a tied weight's pieces are used once per name, as it is
                stand_in(manager.device, manager.dtype),
                torch.Size([place.numel]),
                place.chunk_index,
                place.offset,
                place.numel,
                trainable,
                group_by_id[id(p)],
                span=span,
            )
            manager.add_slot(slot)
            slots[id(slot.param)] = slot
            piece_slots.append(slot)
        span.pieces = tuple(piece_slots)
        spans[id(p)] = span
    return slots, spans


def _unique_params(module: nn.Module) -> list[tuple[tuple[str, ...], nn.Parameter]]:
    """Parameters in registration (= initialization) order, each with all its names."""
    seen: dict[int, tuple[list[str], nn.Parameter]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        seen.setdefault(id(p), ([], p))[0].append(name)
    return [(tuple(names), p) for names, p in seen.values()]


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
