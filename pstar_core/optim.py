"""Chunked AdamW: parameter groups, learning-rate schedule, loss scaler, clipping, step.

Adam runs once per trainable chunk on whole contiguous buffers: one kernel call reads
each gradient from the param slot (or the fp32 accum chunk), updates the fp32 master,
momentum and variance, and writes the new value back into the param slot in the
compute dtype. Parameters without a gradient this step are left out of the call, so
they are not updated and their step count does not advance (as in torch.optim.AdamW).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from pstar_core.beside import AdamBesideBackward
from pstar_core.chunk import Chunk, ChunkType, TensorSlot, TensorState
from pstar_core.config import EngineConfig, LossScaleConfig, SchedulerConfig
from pstar_core.kernels import AdamSegment, adamw_, grad_sq_norm, grad_sq_norm_device
from pstar_core.manager import ChunkManager
from pstar_core.tracer import profiled


@dataclass(frozen=True)
class GroupHyper:
    """Resolved hyper-parameters of one optimizer group."""

    lr: float
    weight_decay: float
    decays: bool = True  # False where a no-decay rule holds (a `StepHyper`'s decay skips it)

    def at(self, base_lr: float, hyper: StepHyper | None, lr_scale: float) -> tuple[float, float]:
        """(lr, weight decay) for a step: the config's under its schedule, or `hyper`'s,
        this group keeping its ratio to the base learning rate `base_lr`."""
        if hyper is None:
            return self.lr * lr_scale, self.weight_decay
        return hyper.lr * self.lr / base_lr, hyper.weight_decay if self.decays else 0.0


@dataclass(frozen=True)
class StepHyper:
    """One step's AdamW settings given by the caller, in place of the config's and its
    schedule's: a user's own loop that sets them per step (Tinker's `optim_step` with its
    `AdamParams`). `lr` is the base group's (others keep their ratio to it); the weight
    decay applies where the config's no-decay rules do not exclude it; `max_grad_norm`
    clips this step's global gradient norm (None: no clipping, whatever the config says)."""

    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float = 0.0
    max_grad_norm: float | None = None

    def __post_init__(self) -> None:
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be > 0 (None: no clipping), got {self}")
        if not (self.lr >= 0 and self.eps > 0 and self.weight_decay >= 0):
            raise ValueError(f"AdamW settings out of range: {self}")
        if not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"AdamW betas must each be in [0, 1), got {self.betas}")


def resolve_groups(
    names: list[str], ndims: list[int], cfg: EngineConfig
) -> tuple[list[GroupHyper], list[int]]:
    """Group index of each parameter: first matching `param_groups` entry, then decay rules."""
    opt = cfg.optimizer
    groups: list[GroupHyper] = []
    index: dict[GroupHyper, int] = {}
    no_decay = [re.compile(p) for p in opt.no_decay_patterns]
    overrides = [(re.compile(g.pattern), g) for g in opt.param_groups]
    assignment = []
    for name, ndim in zip(names, ndims, strict=True):
        lr, wd, decays = opt.lr, opt.weight_decay, True
        if (opt.no_decay_1d and ndim < 2) or any(p.search(name) for p in no_decay):
            wd, decays = 0.0, False
        for pat, g in overrides:
            if pat.search(name):
                lr = g.lr if g.lr is not None else lr
                if g.weight_decay is not None:
                    wd, decays = g.weight_decay, g.weight_decay > 0
                break
        h = GroupHyper(lr, wd, decays)
        if h not in index:
            index[h] = len(groups)
            groups.append(h)
        assignment.append(index[h])
    return groups, assignment


def lr_factor(sched: SchedulerConfig, step: int) -> float:
    """Multiplier of each group's lr at optimizer step `step` (0-based)."""
    if step < sched.warmup_steps:
        return (step + 1) / sched.warmup_steps
    if sched.kind == "constant":
        return 1.0
    total = sched.total_steps or 1
    progress = min(1.0, (step - sched.warmup_steps) / max(1, total - sched.warmup_steps))
    decay = 1.0 - progress if sched.kind == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return sched.min_lr_ratio + (1.0 - sched.min_lr_ratio) * decay


class LossScaler:
    """Dynamic loss scaling for fp16: back off on overflow, grow after a run of good steps."""

    def __init__(self, cfg: LossScaleConfig, enabled: bool) -> None:
        self.cfg = cfg
        self.enabled = enabled
        self.scale = cfg.init_scale if enabled else 1.0
        self.good_steps = 0
        self.overflows = 0

    def update(self, overflow: bool) -> None:
        if not self.enabled:
            return
        if overflow:
            self.overflows += 1
            self.scale = max(self.cfg.min_scale, self.scale * self.cfg.backoff_factor)
            self.good_steps = 0
            return
        self.good_steps += 1
        if self.good_steps >= self.cfg.growth_interval:
            self.scale *= self.cfg.growth_factor
            self.good_steps = 0

    def state_dict(self) -> dict[str, float | int]:
        return {"scale": self.scale, "good_steps": self.good_steps, "overflows": self.overflows}

    def load_state_dict(self, sd: dict[str, float | int]) -> None:
        self.scale = float(sd["scale"])
        self.good_steps = int(sd["good_steps"])
        self.overflows = int(sd["overflows"])


class ChunkAdamW:
    """AdamW over the manager's trainable chunks."""

    def __init__(self, manager: ChunkManager, cfg: EngineConfig, groups: list[GroupHyper]):
        self.manager = manager
        self.cfg = cfg
        self.groups = groups
        self.lr_scale = lr_factor(cfg.scheduler, 0)
        self.beside = AdamBesideBackward(manager, self)
        self._folded: set[int] = set()  # accum chunks this step's gradients were added to

    def _grad_source(self, index: int):
        acc = self.manager.grad_accum.get(index)
        return acc if acc is not None else self.manager.lists[ChunkType.PARAM][index]

    def fold_grads(self) -> None:
        """With accumulation, add the grads still in param slots into the accum chunks
        (all of them now: the global norm reads them; without a norm each chunk's are
        added at its Adam moment instead, where the trace then has their use)."""
        for index, acc in self.manager.grad_accum.chunks.items():
            chunk = self.manager.lists[ChunkType.PARAM][index]
            tier = self.manager.grad_accum.tier_for(chunk)
            self.manager.residency.make_resident([chunk, acc], tier)
            self._fold(index)

    def to_fold(self, index: int) -> list[TensorSlot]:
        """The slots of param chunk `index` whose gradients, still in the chunk, are to be
        added into its accum chunk (none without one, or once added): marked added."""
        if index in self._folded or self.manager.grad_accum.get(index) is None:
            return []
        self._folded.add(index)
        slots = [
            s
            for s in self.manager.lists[ChunkType.PARAM][index].slots
            if s.state is TensorState.HOLD_AFTER_BWD
        ]
        for s in slots:
            s.grad_in_accum = True
        return slots

    def _fold(self, index: int) -> None:
        acc = self.manager.grad_accum.get(index)
        chunk = self.manager.lists[ChunkType.PARAM][index]
        for s in self.to_fold(index):
            acc.flat(s).add_(chunk.flat(s))

    @staticmethod
    def _has_grad(slot: TensorSlot) -> bool:
        return slot.state is TensorState.HOLD_AFTER_BWD or slot.grad_in_accum

    def grad_norm_sq(self) -> float:
        """Sum of squared (still scaled) gradients over all trainable chunks."""
        total = 0.0
        on_device = None  # chunks on the device add up there: one host sync, at the end
        for chunk in self.manager.own_chunks([ChunkType.PARAM]):
            segs = [
                AdamSegment(s.offset, s.numel, 0, 0.0, 0.0)
                for s in chunk.slots
                if self._has_grad(s)
            ]
            if not segs:
                continue
            grad = self.manager.residency.in_memory(self._grad_source(chunk.index)).payload
            if grad.device.type == "cpu":
                total += grad_sq_norm(grad, segs)
            else:
                part = grad_sq_norm_device(grad, segs)
                on_device = part if on_device is None else on_device.add_(part)
        if on_device is not None:
            total += float(on_device.item())
        return total

    def step(self, grad_scale: float, hyper: StepHyper | None = None) -> None:
        """Update every slot that has a gradient; `grad_scale` multiplies each gradient;
        `hyper` replaces the config's settings for this step."""
        beside = self.beside
        for chunk in self.manager.own_chunks([ChunkType.PARAM]):
            i = chunk.index
            if beside.started(i):  # its Adam ran beside backward: its moment, its result
                self.manager.prepare_adam(i)
                with profiled("pstar::wait adam beside backward"):
                    beside.finish(i)
                self.manager.adam_done(i)
                continue
            segs = self.segments(chunk, hyper)
            if not segs:
                continue
            self.manager.prepare_adam(i)
            beside.quiet(i)  # one Adam at a time on the host's cores
            self._fold(i)
            with profiled("pstar::adam"):
                self.adam(i, chunk, segs, grad_scale, hyper)
            self.manager.adam_done(i)
        self.end_step()

    def segments(self, chunk: Chunk, hyper: StepHyper | None) -> list[AdamSegment]:
        """The regions of `chunk` this step updates (those with a gradient), each with its
        step count (counted here), learning rate and weight decay."""
        segs = []
        for s in chunk.slots:
            if self._has_grad(s):
                s.step += 1
                lr, wd = self.groups[s.group].at(self.cfg.optimizer.lr, hyper, self.lr_scale)
                segs.append(AdamSegment(s.offset, s.numel, s.step, lr, wd))
        return segs

    def adam(
        self,
        i: int,
        chunk: Chunk,
        segs: list[AdamSegment],
        grad_scale: float,
        hyper: StepHyper | None = None,
    ) -> None:
        opt, lists = hyper or self.cfg.optimizer, self.manager.lists
        adamw_(
            lists[ChunkType.PARAM_FP32][i].payload,
            lists[ChunkType.MOMENTUM][i].payload,
            lists[ChunkType.VARIANCE][i].payload,
            self._grad_source(i).payload,
            chunk.payload,
            segs,
            beta1=opt.betas[0],
            beta2=opt.betas[1],
            eps=opt.eps,
            grad_scale=grad_scale,
        )

    def drop_grads(self) -> None:
        """Skip this step (fp16 overflow): restore params from the master, drop the grads."""
        lists = self.manager.lists
        for chunk in self.manager.own_chunks([ChunkType.PARAM]):
            if not any(s.state is TensorState.HOLD_AFTER_BWD for s in chunk.slots):
                continue
            master = lists[ChunkType.PARAM_FP32][chunk.index]
            self.manager.residency.colocate([chunk, master])
            for s in chunk.slots:
                if s.state is TensorState.HOLD_AFTER_BWD:
                    chunk.flat(s).copy_(master.flat(s))
        self.end_step()

    def end_step(self) -> None:
        for s in self.manager.slots:
            if s.state is TensorState.HOLD_AFTER_BWD:
                s.set_state(TensorState.HOLD)
        self._folded.clear()
        self.beside.step_done()
        self.manager.free_grad_accum()
