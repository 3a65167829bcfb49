"""`pstar train --workers N`: a spec run by the one worker loop (`service.worker.loop`) on N Ray
Train workers.

The rows are prepared once here, before the workers start (`train_local.prepare_spec_run`);
every worker builds the engine on the process group Ray created (gloo on CPU, NCCL on
GPU), so the chunks are sharded with chunk ZeRO, and takes its share of each global batch.
Checkpoints go through `ray.train.report` (`finetune.RayCheckpoints`, as a job's do),
every `checkpoint_every` steps (default: every quarter of the run, as a job's): on a lost
worker Ray restarts the group (`FailureConfig(max_failures)`) and the loop resumes from
the newest one. Rank 0 writes `metrics.jsonl` (`service.worker.runlog`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

from pstar_core.config import ConfigError
from service.spec import auto
from service.spec.resources import Resources
from service.spec.train import TrainSpec
from service.worker.finetune import RayCheckpoints
from service.worker.loop import prepare_kernels, run_loop
from service.worker.runlog import RunLog
from service.worker.train_local import build_engine, prepare_spec_run


def with_ray_device(spec: TrainSpec) -> TrainSpec:
    """The spec with the engine on the device Ray gave this worker (its GPU with use_gpu)."""
    import ray.train.torch

    device = ray.train.torch.get_device()
    if device.type != "cuda":
        return spec
    return spec.model_copy(update={"engine": {**spec.engine, "device": str(device)}})


def train_func(config: dict[str, Any]) -> None:
    """The per-worker function run by `TorchTrainer`: the one loop on this rank's share."""
    import ray.train

    spec = with_ray_device(TrainSpec.model_validate_json(config["spec_json"]))
    run = config["run"]
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    rep = RunLog(run, spec.output_dir / spec.name, spec.train.log_every, rank=rank)
    prepare_kernels(rep)
    engine = build_engine(spec, run)
    run_loop(run, engine, rank, world, rep, RayCheckpoints(run), name=spec.name)


def run_ray(
    spec: TrainSpec,
    workers: int,
    max_failures: int = 2,
    phase: Callable[[str], None] = lambda _m: None,
    train_loop: Callable[[dict[str, Any]], None] = train_func,
    use_gpu: bool = False,
    cpus_per_worker: float = 1.0,
) -> dict[str, Any]:
    """Run a spec on `workers` Ray Train workers (a local Ray is started if none), each
    with `cpus_per_worker` CPUs (host Adam and loading use them, GPU workers included)
    and, with `use_gpu`, one GPU that its engine computes on (NCCL between them).
    `train_loop` is the per-worker function (`train_func`, or one that wraps it)."""
    import ray

    from service.worker.trainer import fit_on_workers

    if spec.train.batch_size % workers:
        raise ConfigError(
            f"train.batch_size {spec.train.batch_size} does not split evenly over {workers} "
            "workers; make it a multiple of --workers"
        )
    run_dir = spec.output_dir / spec.name
    run, _tok = prepare_spec_run(spec, phase)  # once, before the workers need the rows
    run = run.model_copy(
        update={
            # Ray restarts a lost worker group: it resumes from the newest checkpoint
            "checkpoint_every": auto.checkpoint_every(
                spec.train.checkpoint_every, run.total_steps, True
            ),
            "storage_path": str(run_dir / "ray"),
        }
    )
    started = not ray.is_initialized()
    if started:
        phase("starting a local Ray")
        ray.init(address=os.environ.get("RAY_ADDRESS"), log_to_driver=False)
    phase(f"training on {workers} Ray workers")
    result = fit_on_workers(
        train_loop,
        {"spec_json": spec.model_dump_json(), "run": run},
        name=spec.name,
        storage_path=str(run_dir / "ray"),
        resources=Resources(num_workers=workers, use_gpu=use_gpu, cpus_per_worker=cpus_per_worker),
        max_failures=max_failures,
    )
    out = {
        "metrics": dict(result.metrics or {}),
        "checkpoint": result.checkpoint.path if result.checkpoint else None,
        "error": repr(result.error) if result.error else None,
    }
    (run_dir / "summary.json").write_text(json.dumps(out, indent=1, default=str))
    return out
