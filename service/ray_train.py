"""Ray Train: the worker loop (`train_func`) and the driver that runs a spec on N workers.

Every worker builds the engine on the process group Ray created (gloo on CPU, NCCL on
GPU), so the chunks are sharded with chunk ZeRO; it takes its share of each global
batch, and every `report_every` steps all ranks call `ray.train.report` with metrics and
a checkpoint holding this rank's shard files (names carry the rank, so they never
collide in the run's checkpoint directory). On a lost worker, Ray restarts the group
(`FailureConfig(max_failures)`) and `train_func` resumes from `ray.train.get_checkpoint()`.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from service.data import BatchSampler, encode, read_text, split
from service.spec import TrainSpec
from service.train_local import build_engine, ensure_tokenizer


def step_metrics(engine: Any, loss: float, dt: float, tokens: int, flops_per_tok: float) -> dict:
    """What workers report: measured by the engine, never constants."""
    stats = engine.stats()
    device = stats["tiers"]["device"]
    return {
        "step": engine.global_step,
        "loss": loss,
        "lr": engine.lr,
        "step_time_s": dt,
        "tokens_per_s": tokens / dt,
        "tflops": flops_per_tok * tokens / dt / 1e12,
        **{f"model_data_bytes_{t}": v["used"] for t, v in stats["tiers"].items()},
        **{f"bytes_moved_{k.replace('->', '_to_')}": v for k, v in stats["bytes_moved"].items()},
        "peak_non_model_bytes": stats["tracer"]["peak_non_model_bytes"],
        # the device's peak in the last iteration, moment by moment (chunks + non-model)
        "memory_utilization": stats["tracer"]["peak_device_bytes_last_iteration"]
        / max(1, device["budget"]),
        "comm_bytes_sent": stats["comm_bytes_sent"],
        "world_size": stats["world_size"],
    }


def with_ray_device(spec: TrainSpec) -> TrainSpec:
    """The spec with the engine on the device Ray gave this worker (its GPU with use_gpu)."""
    import ray.train.torch

    device = ray.train.torch.get_device()
    if device.type != "cuda":
        return spec
    return spec.model_copy(update={"engine": {**spec.engine, "device": str(device)}})


def train_func(config: dict[str, Any]) -> None:
    """The per-worker loop run by `TorchTrainer`."""
    import ray.train

    spec = TrainSpec.model_validate_json(config["spec_json"])
    spec = with_ray_device(spec)
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    run_dir = spec.output_dir / spec.name
    text = read_text(spec.data.path, spec.data.max_chars)
    torch.manual_seed(spec.train.seed)
    engine, tok, eos, flops_tok = build_engine(spec, run_dir, text)
    seqs, _held = split(encode(tok, text, eos), spec.data.seq_len, spec.data.heldout_fraction)
    attempt = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            engine.load_checkpoint(Path(d))
        attempt = 1
    loop = spec.train
    sampler = BatchSampler(seqs, loop.batch_size, loop.seed)
    report_every = config.get("report_every", loop.log_every)
    tokens = loop.batch_size * spec.data.seq_len
    for step in range(engine.global_step, loop.steps):
        t0 = time.perf_counter()
        part = sampler.batch(step).chunk(world)[rank]
        loss_sum = torch.zeros((), dtype=torch.float64, device=engine.device)  # NCCL: no CPU
        for mb in part.chunk(loop.micro_batches):
            loss = engine(input_ids=mb, labels=mb).loss / loop.micro_batches
            engine.backward(loss)
            loss_sum += loss.detach().double()
        engine.step()
        if world > 1:
            dist.all_reduce(loss_sum)
        if (step + 1) % report_every == 0 or step + 1 == loop.steps:
            metrics = step_metrics(
                engine, loss_sum.item() / world, time.perf_counter() - t0, tokens, flops_tok
            )
            metrics["attempt_resumed"] = attempt
            with tempfile.TemporaryDirectory() as d:
                engine.save_checkpoint(Path(d) / "ckpt", shared=False)
                ray.train.report(
                    metrics, checkpoint=ray.train.Checkpoint.from_directory(Path(d) / "ckpt")
                )
            if rank == 0:
                with (run_dir / "metrics.jsonl").open("a") as f:
                    f.write(json.dumps(metrics) + "\n")


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
    `train_loop` is the per-worker loop (`train_func`, or one that wraps it)."""
    import ray
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    run_dir = spec.output_dir / spec.name
    run_dir.mkdir(parents=True, exist_ok=True)
    if not spec.is_path_model:  # train the tokenizer once, before the workers need it
        ensure_tokenizer(spec, run_dir, read_text(spec.data.path, spec.data.max_chars), phase)
    started = not ray.is_initialized()
    if started:
        phase("starting a local Ray")
        ray.init(address=os.environ.get("RAY_ADDRESS"), log_to_driver=False)
    trainer = TorchTrainer(
        train_loop,
        train_loop_config={"spec_json": spec.model_dump_json()},
        torch_config=TorchConfig(backend="nccl" if use_gpu else "gloo"),
        scaling_config=ScalingConfig(
            num_workers=workers,
            use_gpu=use_gpu,
            resources_per_worker={"CPU": cpus_per_worker},
        ),
        run_config=RunConfig(
            name=spec.name,
            storage_path=str(run_dir / "ray"),
            failure_config=FailureConfig(max_failures=max_failures),
            checkpoint_config=CheckpointConfig(num_to_keep=2),
        ),
    )
    phase(f"training on {workers} Ray workers")
    result = trainer.fit()
    out = {
        "metrics": dict(result.metrics or {}),
        "checkpoint": result.checkpoint.path if result.checkpoint else None,
        "error": repr(result.error) if result.error else None,
    }
    (run_dir / "summary.json").write_text(json.dumps(out, indent=1, default=str))
    return out
