"""A fine-tuning job's worker (`train_func`), run by `TorchTrainer` on N Ray Train workers.

It is the one worker loop (`service.worker.loop.run_loop`) with the job's parts: the engine
built on the process group Ray made (gloo on CPU, NCCL on GPU, the GPU Ray gave this
worker), the store's `Reporter` (rank 0 writes status and phase, one metrics point and
event per step, the tracer timeline, checkpoints; every rank exports Ray metrics
`ray_pstar_*` tagged job, attempt and rank), and checkpoints through `ray.train.report`,
so a lost worker (Ray restarts the group) and a new attempt (same run name and storage)
both resume from the last one (`RayCheckpoints`, also used by `pstar train --workers`).
"""

from __future__ import annotations

import json
import logging
import tempfile
from pathlib import Path
from typing import Any

from service.spec.run_plan import RunPlan
from service.worker.loop import (
    Sink,
    prepare_kernels,
    read_loop_state,
    run_loop,
    write_checkpoint,
)

log = logging.getLogger(__name__)


def train_func(config: dict[str, Any]) -> None:
    import ray.train
    import torch

    from service.worker.reporting import Reporter

    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    run = config["run"]
    rep = Reporter.for_rank(config, rank, world)
    prepare_kernels(rep)
    rep.phase("loading model")
    torch.manual_seed(run.seed)
    engine = build_job_engine(run)
    run_loop(run, engine, rank, world, rep, RayCheckpoints(run), name=f"job {config['job_id']}")


class RayCheckpoints:
    """Checkpoints through Ray Train: `ray.train.report` persists each one under the run's
    storage (named `checkpoint_dir_name`), and the sink records it (the store, for a job);
    a restarted worker group or a new attempt resumes from the newest (`resume`)."""

    def __init__(self, run: RunPlan) -> None:
        self.run = run
        self._names: set[str] = set()  # reported by this worker in this attempt

    def restore(self, engine: Any, sink: Sink) -> dict[str, Any] | None:
        return resume_state(engine, self.run, sink)

    def save(
        self,
        engine: Any,
        sink: Sink,
        values: dict[str, Any],
        step: int,
        final: bool,
        state: dict[str, Any] | None = None,
    ) -> None:
        name = checkpoint_dir_name(step, sink.attempt)
        if name in self._names:  # the best model of an early stop, at a step saved before
            name += "_final"
        self._names.add(name)
        report_checkpoint(engine, values, sink, step, final, state=state, name=name)


def resume(engine: Any, run: RunPlan, rep: Any) -> bool:
    """Load the newest checkpoint of the job, if there is one; True if one was loaded
    (`resume_state`)."""
    return resume_state(engine, run, rep) is not None


def resume_state(engine: Any, run: RunPlan, rep: Any) -> dict[str, Any] | None:
    """Load the newest checkpoint of the job, if there is one: the loop's state kept with
    it, or None when there was none.

    Two places know checkpoints. Ray Train's own registry (`get_checkpoint`) is what a
    restarted worker group of this attempt resumes from. A new attempt (its driver or the
    head was lost, or the job was paused) reads the same registry from storage, but Ray
    persists it a moment after `report` returns: a driver killed in that moment leaves it
    one checkpoint behind, or empty. The store records each checkpoint's directory once
    every rank has written it (`run.resume_from`, set by the driver), so the newer of
    the two wins.
    """
    import ray.train

    from pstar_core.checkpoint import META

    def step_of(d: Path) -> int:
        return int(json.loads((d / META).read_text())["global_step"])

    checkpoint = ray.train.get_checkpoint()
    stored = Path(run.resume_from) if run.resume_from else None
    if stored is not None and not (stored / META).is_file():
        stored = None  # deleted with its run directory, or never complete
    if checkpoint is None and stored is None:
        return None
    rep.phase("recovering")
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            if stored is None or step_of(Path(d)) >= step_of(stored):
                engine.load_checkpoint(Path(d))
                return read_loop_state(Path(d))
    assert stored is not None  # neither is None, or Ray's was newer
    log.info("resuming from the store's newest checkpoint %s", stored)
    engine.load_checkpoint(stored)
    return read_loop_state(stored)


def checkpoint_dir_name(step: int, attempt: int) -> str:
    """Where Ray Train puts the checkpoint of `step` under the run directory: named, so
    the store records exactly that directory (sortable by step; the attempt keeps a
    restarted run from writing into an older attempt's directory)."""
    return f"checkpoint_step{step:09d}_a{attempt}"


def report_checkpoint(
    engine: Any,
    values: dict[str, Any],
    rep: Any,
    step: int,
    final: bool,
    state: dict[str, Any] | None = None,
    name: str | None = None,
) -> None:
    import ray.train

    name = name or checkpoint_dir_name(step, rep.attempt)
    with tempfile.TemporaryDirectory() as d:
        # rank 0's adapter directory and loop state go into the checkpoint with the
        # others' shards
        write_checkpoint(engine, Path(d) / "ckpt", lora=rep.run.lora, state=state)
        ray.train.report(
            {**values, "step": step},
            checkpoint=ray.train.Checkpoint.from_directory(Path(d) / "ckpt"),
            checkpoint_dir_name=name,
        )
    rep.checkpoint(step, values, final, name)


def build_job_engine(run: RunPlan):
    import pstar_core
    from service.data.prepare import model_fn

    fn = model_fn(run.model, run.seq_len, run.vocab_size)
    cfg = dict(run.engine)
    if cfg.get("device", "cpu") != "cpu":
        import ray.train.torch

        # the GPU Ray gave this worker (it narrows CUDA_VISIBLE_DEVICES per worker)
        cfg["device"] = str(ray.train.torch.get_device())
    return pstar_core.initialize(fn, cfg)
