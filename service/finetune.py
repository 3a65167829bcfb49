"""The Ray Train worker loop of a fine-tuning job (`train_func`), run by `TorchTrainer`.

Every worker builds the engine on the process group Ray made (gloo on CPU, NCCL on GPU),
so the chunks are sharded with chunk ZeRO, and takes an equal share of each global batch.
Rank 0 writes what happens to the store as it happens: status and phase, one metrics
point and event per step, the tracer timeline after the warm-up step, checkpoints. Every
rank exports its measurements as Ray metrics (`ray_pstar_*`, tagged job, attempt, rank).

Batches are drawn from a seeded permutation per epoch, so step s of a run always sees the
same rows, also after a resume. Checkpoints go through `ray.train.report`, so a lost
worker (Ray restarts the group) and a new attempt (same run name and storage) both resume
from the last one. A LoRA job also writes each checkpoint's adapter beside its chunks,
and exports both the merged model and the adapter at the end (layout: `service.lora`).
"""

from __future__ import annotations

import json
import logging
import math
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from service.lora import adapter_dir

log = logging.getLogger(__name__)

VALID_SAMPLE_BATCHES = 2  # global batches of the validation file behind each valid_loss


class Batches:
    """Rows of step s: a seeded permutation per epoch, wrapped to fill the last batch."""

    def __init__(self, rows: int, batch_size: int, steps_per_epoch: int, seed: int) -> None:
        self.rows, self.batch, self.per_epoch, self.seed = rows, batch_size, steps_per_epoch, seed

    def indices(self, step: int) -> torch.Tensor:
        epoch, i = divmod(step, self.per_epoch)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        perm = torch.randperm(self.rows, generator=g)
        pos = torch.arange(i * self.batch, (i + 1) * self.batch) % self.rows
        return perm[pos]


def token_stats(logits: torch.Tensor, labels: torch.Tensor) -> tuple[float, int]:
    """(correct next-token predictions, tokens counted) where labels are not ignored."""
    pred = logits[:, :-1].argmax(-1)
    tgt = labels[:, 1:].to(pred.device)
    mask = tgt != -100
    return float((pred == tgt)[mask].sum()), int(mask.sum())


def all_sum(values: list[float], device: torch.device) -> list[float]:
    """Sum across ranks (on the engine's device: NCCL takes no CPU tensors)."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)
    return t.tolist()


@torch.no_grad()
def evaluate(
    engine: Any, ids: torch.Tensor, labels: torch.Tensor, rank: int, world: int, batch: int
):
    """(mean loss per token, token accuracy) over the rows, split evenly over the ranks
    (every rank runs the same number of forwards: ZeRO gathers are collective)."""
    n = ids.shape[0]
    per_rank = math.ceil(n / world)
    rounds = math.ceil(per_rank / batch)
    loss_sum = correct = count = 0.0
    engine.eval()
    for r in range(rounds):
        idx = (torch.arange(batch) + r * batch) * world + rank
        real = idx < n
        idx = idx % n
        x, y = ids[idx].to(engine.device), labels[idx].clone()
        y[~real] = -100  # wrapped rows keep the shapes equal but count nothing
        out = engine(input_ids=x, labels=y.to(engine.device))
        c, k = token_stats(out.logits, y)
        if k:
            loss_sum += float(out.loss) * k
        correct += c
        count += k
    engine.train()
    loss_sum, correct, count = all_sum([loss_sum, correct, count], engine.device)
    return (loss_sum / count, correct / count) if count else (float("nan"), float("nan"))


def _worker_log() -> logging.Logger:
    """The worker's own log lines (to stderr, which Ray forwards into the job's log)."""
    wl = logging.getLogger("pstar.worker")
    if not wl.handlers:
        h = logging.StreamHandler()
        h.setFormatter(logging.Formatter("%(asctime)s %(name)s: %(message)s"))
        wl.addHandler(h)
        wl.setLevel(logging.INFO)
        wl.propagate = False
    return wl


def _full_validation(engine: Any, ids, labels, rank: int, world: int, batch: int):
    loss, acc = evaluate(engine, ids, labels, rank, world, batch)
    return {"full_valid_loss": loss, "full_valid_mean_token_accuracy": acc}


def train_func(config: dict[str, Any]) -> None:
    import ray.train

    from service.reporting import Reporter

    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    attempt = config["attempt"]
    run = config["run"]
    rep = Reporter.for_rank(config, rank, world)
    data = torch.load(run["data_file"], weights_only=True)
    train_ids, train_labels = data["train_ids"], data["train_labels"]
    lengths = data["train_lengths"]
    valid_ids, valid_labels = data.get("valid_ids"), data.get("valid_labels")
    hp = run["hyperparameters"]
    batch, total, per_epoch = hp["batch_size"], run["total_steps"], run["steps_per_epoch"]
    local = batch // world

    _prepare_kernels(rep)
    rep.phase("loading model")
    torch.manual_seed(run["seed"])
    engine = _build_engine(run)
    if _resume(engine, run, rep):
        rep.event(f"Attempt {attempt} resumed from the checkpoint at step {engine.global_step}")
    st = engine.stats()
    if rank == 0:
        rep.runtime(_runtime(st))
    _worker_log().info(
        "job %s attempt %d, rank %d of %d: %d chunks of %d elements, model data %.1f MiB on "
        "this rank, from step %d of %d",
        config["job_id"],
        attempt,
        rank,
        world,
        sum(v["count"] for v in st["chunks"].values()),
        st["chunk_size"],
        st["model_data_bytes"] / 2**20,
        engine.global_step,
        total,
    )
    rep.running()
    eval_every = hp.get("eval_every") or max(1, total // 10)
    ckpt_every = run["checkpoint_every"]
    if valid_ids is not None and engine.global_step == 0:
        rep.phase("evaluating")
        vl, va = evaluate(engine, valid_ids, valid_labels, rank, world, local)
        before = {"full_valid_loss": vl, "full_valid_mean_token_accuracy": va}
        rep.metrics(
            0, {"valid_loss": vl, "valid_mean_token_accuracy": va, **before}, "before training"
        )
    sampler = Batches(train_ids.shape[0], batch, per_epoch, run["seed"])
    flops_tok = run["flops_per_token"]
    trained_tokens = int(rep.values_at(engine.global_step).get("trained_tokens", 0))
    comm_before = engine.stats()["comm_bytes_sent"]
    rep.phase("training")
    first = engine.global_step
    full_eval: dict[str, float] | None = None
    for step in range(first, total):
        t0 = time.perf_counter()
        idx = sampler.indices(step)
        mine = idx[rank * local : (rank + 1) * local]
        x, y = train_ids[mine].to(engine.device), train_labels[mine].to(engine.device)
        out = engine(input_ids=x, labels=y)
        c, k = token_stats(out.logits.detach(), y)
        loss = out.loss
        del out  # the logits (batch x seq x vocab) are not kept through backward and step
        engine.backward(loss)
        engine.step()
        real = int(lengths[mine].sum())  # tokens that are not padding
        loss_sum, correct, count, real_sum = all_sum(
            [float(loss.detach()) * k, c, k, float(real)], engine.device
        )
        dt = time.perf_counter() - t0
        trained_tokens += int(real_sum)
        stats = engine.stats()
        values = {
            "train_loss": loss_sum / max(count, 1),
            "train_mean_token_accuracy": correct / max(count, 1),
            "lr": engine.lr,
            "step_time_s": dt,
            "tokens_per_second": batch * x.shape[1] / dt,
            "tflops": flops_tok * batch * x.shape[1] / dt / 1e12,
            "trained_tokens": trained_tokens,
            **_memory_values(stats),
            "comm_bytes_sent": stats["comm_bytes_sent"] - comm_before,
        }
        comm_before = stats["comm_bytes_sent"]
        done = step + 1
        if valid_ids is not None and (done % eval_every == 0) and done < total:
            rep.phase("evaluating")
            # the interval loss on a fixed sample (as OpenAI's valid_loss); the whole
            # file is evaluated before training and at the end (full_valid_loss)
            n = min(valid_ids.shape[0], VALID_SAMPLE_BATCHES * batch)
            values["valid_loss"], values["valid_mean_token_accuracy"] = evaluate(
                engine, valid_ids[:n], valid_labels[:n], rank, world, local
            )
            rep.phase("training")
        if done == total and valid_ids is not None:
            # the whole validation file, as OpenAI's last metrics event carries it
            rep.phase("evaluating")
            full_eval = _full_validation(engine, valid_ids, valid_labels, rank, world, local)
            values.update(full_eval)
        rep.metrics(done, values, total=total)
        if step == first:  # the warm-up step of this attempt: the trace exists now
            rep.stats(stats)
        if done % ckpt_every == 0 and done < total:
            rep.phase("checkpointing")
            _report_checkpoint(engine, values, rep, done, final=False)
            rep.phase("training")
    # the end: full validation, the final checkpoint, the export
    final: dict[str, Any] = {"trained_tokens": trained_tokens}
    if valid_ids is not None:
        if full_eval is None:  # resumed from the final checkpoint: no step ran
            rep.phase("evaluating")
            full_eval = _full_validation(engine, valid_ids, valid_labels, rank, world, local)
        final.update(full_eval)
    last = rep.last_values()
    rep.phase("checkpointing")
    _report_checkpoint(engine, {**last, **final}, rep, engine.global_step, final=True)
    rep.phase("exporting")
    out_dir = Path(run["export_dir"])
    if _is_lora(run):
        # the merged model first: its directory replaces the export as a whole, the
        # adapter then goes inside it (the layout is in service.lora)
        engine.export_hf(out_dir, variant="merged")
        engine.export_hf(adapter_dir(out_dir), variant="adapter")
    else:
        engine.export_hf(out_dir)
    if rank == 0 and run["model"]["kind"] == "zoo":
        from transformers import PreTrainedTokenizerFast

        PreTrainedTokenizerFast.from_pretrained(run["tokenizer_dir"]).save_pretrained(str(out_dir))
    rep.stats(engine.stats())
    rep.finished(final)
    rep.flush()  # what an outage of the store held back goes in before the driver finishes


def _prepare_kernels(rep: Any) -> None:
    """The host AdamW kernel for this CPU, built and measured before the job trains (set-up
    and the image build do it once per CPU type; a node with a new CPU type pays it here,
    and the job's events say so, with the time it took)."""
    from pstar_core.kernels.adam import prepare, prepared

    if prepared():
        return
    capability = torch.backends.cpu.get_cpu_capability()
    threads = torch.get_num_threads()
    rep.phase("preparing kernels")
    note = (
        f"The host AdamW kernel is not prepared for this CPU ({capability}, {threads} "
        "threads): building and measuring it before training (`pstar kernels` does it once "
        "per CPU type at set-up or in the image)"
    )
    rep.event(note)
    _worker_log().info(note)
    t0 = time.perf_counter()
    result = prepare([threads])
    choice = ", ".join(f"{k}: {v['backend']}" for k, v in result["choices"].items())
    built = "built" if result["built"] else "could not be built (torch's fused AdamW runs)"
    done = f"Host AdamW kernel {built}, measured in {time.perf_counter() - t0:.1f} s ({choice})"
    rep.event(done)
    _worker_log().info(done)


def _runtime(stats: dict[str, Any]) -> dict[str, Any]:
    """What the engine decided on this hardware (`dtype: auto` and the rest), for the job
    object and the dashboard."""
    from pstar_core.kernels.adam import kernel_backend

    p = stats["precision"]
    return {
        "compute_dtype": stats["compute_dtype"],
        "dtype_requested": p["requested"],
        "dtype_reason": p["reason"],
        "cpu_capability": p["cpu_capability"],
        "threads": torch.get_num_threads(),
        "host_adam": kernel_backend(torch.float32 if p["dtype"] == "fp32" else torch.bfloat16),
        "device": stats.get("device", "cpu"),
        "world_size": stats["world_size"],
    }


def _memory_values(stats: dict[str, Any]) -> dict[str, Any]:
    device = stats["tiers"]["device"]
    moved = stats.get("bytes_moved_last_iteration") or {}
    return {
        **{f"model_data_bytes_{t}": v["used"] for t, v in stats["tiers"].items()},
        **{f"bytes_moved_{k.replace('->', '_to_')}": v for k, v in moved.items()},
        "peak_non_model_bytes": stats["tracer"]["peak_non_model_bytes"],
        # the device's peak in the last iteration, moment by moment (chunks + non-model)
        "memory_utilization": stats["tracer"]["peak_device_bytes_last_iteration"]
        / max(1, device["budget"]),
    }


def _resume(engine: Any, run: dict[str, Any], rep: Any) -> bool:
    """Load the newest checkpoint of the job, if there is one; True if one was loaded.

    Two places know checkpoints. Ray Train's own registry (`get_checkpoint`) is what a
    restarted worker group of this attempt resumes from. A new attempt (its driver or the
    head was lost) reads the same registry from storage, but Ray persists it a moment
    after `report` returns: a driver killed in that moment leaves it one checkpoint
    behind, or empty. The store records each checkpoint's directory once every rank has
    written it (`run["resume_from"]`, set by the driver), so the newer of the two wins.
    """
    import ray.train

    from pstar_core.checkpoint import META

    def step_of(d: Path) -> int:
        return int(json.loads((d / META).read_text())["global_step"])

    checkpoint = ray.train.get_checkpoint()
    stored = Path(run["resume_from"]) if run.get("resume_from") else None
    if stored is not None and not (stored / META).is_file():
        stored = None  # deleted with its run directory, or never complete
    if checkpoint is None and stored is None:
        return False
    rep.phase("recovering")
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            if stored is None or step_of(Path(d)) >= step_of(stored):
                engine.load_checkpoint(Path(d))
                return True
    log.info("resuming from the store's newest checkpoint %s", stored)
    engine.load_checkpoint(stored)
    return True


def checkpoint_dir_name(step: int, attempt: int) -> str:
    """Where Ray Train puts the checkpoint of `step` under the run directory: named, so
    the store records exactly that directory (sortable by step; the attempt keeps a
    restarted run from writing into an older attempt's directory)."""
    return f"checkpoint_step{step:09d}_a{attempt}"


def _report_checkpoint(
    engine: Any, values: dict[str, Any], rep: Any, step: int, final: bool
) -> None:
    import ray.train

    name = checkpoint_dir_name(step, rep.attempt)
    with tempfile.TemporaryDirectory() as d:
        engine.save_checkpoint(Path(d) / "ckpt", shared=False)
        if _is_lora(rep.run):
            # every rank takes part (the adapters may be sharded), rank 0 writes: its
            # directory goes into the checkpoint with the others' (the adapter download)
            engine.export_hf(adapter_dir(Path(d) / "ckpt"), variant="adapter")
        ray.train.report(
            {**values, "step": step},
            checkpoint=ray.train.Checkpoint.from_directory(Path(d) / "ckpt"),
            checkpoint_dir_name=name,
        )
    rep.checkpoint(step, values, final, name)


def _is_lora(run: dict[str, Any]) -> bool:
    return run.get("method") == "lora"


def _build_engine(run: dict[str, Any]):
    import pstar_core
    from service.prepare import model_fn

    fn = model_fn(run["model"], run["seq_len"], run["vocab_size"])
    cfg = dict(run["engine"])
    if cfg.get("device", "cpu") != "cpu":
        import ray.train.torch

        # the GPU Ray gave this worker (it narrows CUDA_VISIBLE_DEVICES per worker)
        cfg["device"] = str(ray.train.torch.get_device())
    return pstar_core.initialize(fn, cfg)
