"""The one worker loop: every training run here is `run_loop` over prepared rows.

A service job (`service.finetune.train_func` on N Ray Train workers) and `pstar train`
(one process, or N Ray Train workers: `service.train_local`, `service.ray_train`) differ
only in what they hand it: where the rows come from (`run["data_file"]`, written by
`service.prepare.save_rows`), whom it tells (a `Sink`: the store's `Reporter`, or
`service.runlog.RunLog` for files and the CLI) and where checkpoints go (a `Checkpoints`:
Ray Train's registry, or a directory). The data path, the metrics (names and meanings),
the FLOPs formula, evaluation, checkpoint contents and resume are this module's, once.

Batches are drawn from a seeded permutation per epoch, so step s of a run always sees the
same rows, also after a resume; every rank takes an equal share of each global batch (the
chunks are sharded over the ranks with chunk ZeRO).
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from service.lora import adapter_dir

log = logging.getLogger(__name__)

VALID_SAMPLE_BATCHES = 2  # global batches of the validation file behind each valid_loss


class Sink(Protocol):
    """Whom the loop tells what happens (rank 0 writes; every rank may export gauges)."""

    attempt: int
    run: dict[str, Any]

    def phase(self, detail: str) -> None: ...
    def event(self, message: str, **data: Any) -> None: ...
    def runtime(self, values: dict[str, Any]) -> None: ...
    def running(self) -> None: ...
    def resumed(self, step: int) -> None: ...
    def metrics(
        self, step: int, values: dict[str, Any], note: str = "", total: int | None = None
    ) -> None: ...
    def values_at(self, step: int) -> dict[str, Any]: ...
    def last_values(self) -> dict[str, Any]: ...
    def stats(self, stats: dict[str, Any]) -> None: ...
    def checkpoint(self, step: int, values: dict[str, Any], final: bool, dir_name: str) -> None: ...
    def finished(self, final: dict[str, Any]) -> None: ...
    def flush(self) -> bool: ...


class Checkpoints(Protocol):
    """Where a run's checkpoints go and where a restarted run finds its newest one."""

    def restore(self, engine: Any, sink: Sink) -> bool:
        """Load the newest checkpoint into the engine, if there is one; True if loaded."""
        ...

    def save(self, engine: Any, sink: Sink, values: dict[str, Any], step: int, final: bool) -> None:
        """Keep the engine's state at `step` (every rank calls it: shards are per rank),
        and tell `sink` where it went."""
        ...


def write_checkpoint(engine: Any, directory: Path, lora: bool, shared: bool = False) -> None:
    """What a checkpoint holds: this rank's chunks and, for a LoRA run, the PEFT adapter
    (every rank takes part: the adapters may be sharded; rank 0 writes it). `shared`: one
    directory all ranks see, replaced whole (`Engine.save_checkpoint`)."""
    engine.save_checkpoint(directory, shared=shared)
    if lora:
        engine.export_hf(adapter_dir(directory), variant="adapter")


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


def flops_per_token(engine: Any, seq_len: int) -> float:
    """Training FLOPs per token, from the model as the engine holds it: 6 per trainable
    parameter (forward, input gradient, weight gradient), 4 per frozen one (no weight
    gradient: a LoRA base), plus attention's 12 * layers * hidden * seq_len. Activation
    recomputation is not counted (model FLOPs, as MFU is defined)."""
    st = engine.stats()
    trainable, frozen = st["trainable_params"], st["params"] - st["trainable_params"]
    cfg = engine.module.config  # a transformers config, or a zoo GPT's GPTConfig
    layers = next(getattr(cfg, k) for k in ("num_hidden_layers", "n_layer", "num_layers")
                  if getattr(cfg, k, None))  # fmt: skip
    hidden = next(getattr(cfg, k) for k in ("hidden_size", "n_embd") if getattr(cfg, k, None))
    return 6 * trainable + 4 * frozen + 12 * layers * hidden * seq_len


def worker_log() -> logging.Logger:
    """The worker's own log lines (to stderr, which Ray forwards into the job's log)."""
    wl = logging.getLogger("pstar.worker")
    if not wl.handlers:
        h = logging.StreamHandler()
        h.setFormatter(logging.Formatter("%(asctime)s %(name)s: %(message)s"))
        wl.addHandler(h)
        wl.setLevel(logging.INFO)
        wl.propagate = False
    return wl


def prepare_kernels(rep: Sink) -> None:
    """The host AdamW kernel for this CPU, built and measured before the run trains (set-up
    and the image build do it once per CPU type; a node with a new CPU type pays it here,
    and the run's events say so, with the time it took)."""
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
    worker_log().info(note)
    t0 = time.perf_counter()
    result = prepare([threads])
    choice = ", ".join(f"{k}: {v['backend']}" for k, v in result["choices"].items())
    built = "built" if result["built"] else "could not be built (torch's fused AdamW runs)"
    done = f"Host AdamW kernel {built}, measured in {time.perf_counter() - t0:.1f} s ({choice})"
    rep.event(done)
    worker_log().info(done)


def runtime_values(stats: dict[str, Any]) -> dict[str, Any]:
    """What the engine decided on this hardware (`dtype: auto` and the rest), for the job
    object, the dashboard and a run's summary."""
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


def memory_values(stats: dict[str, Any]) -> dict[str, Any]:
    """Model data per tier now, bytes moved per direction in the last iteration, the
    non-model peak and the device's peak share of its budget."""
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


class Supervised:
    """The objective of supervised and LoRA fine-tuning and of `pstar train`: next-token
    cross-entropy on the labelled tokens (the model's own loss).

    A training method is an objective the loop calls, not a copy of the loop: it says
    what one optimizer step does with this rank's rows (`train_step`) and what a held-out
    evaluation measures (`evaluate`); the loop keeps batching, metrics, checkpoints and
    resume the same for every method."""

    name = "supervised"

    def train_step(self, engine: Any, x: torch.Tensor, y: torch.Tensor, micro_batches: int):
        """Forward and backward over `micro_batches` slices of this rank's rows, then the
        optimizer step: (loss summed over tokens, correct predictions, tokens counted).
        With more than one slice each slice's mean loss is weighted by its share of the
        tokens, so the gradient is that of the whole batch at once."""
        parts = list(zip(x.chunk(micro_batches), y.chunk(micro_batches), strict=True))
        if len(parts) == 1:
            shares, total = [1], 1
        else:
            shares = [int((py[:, 1:] != -100).sum()) for _px, py in parts]
            total = max(1, sum(shares))
        loss_sum = correct = count = 0.0
        for (px, py), share in zip(parts, shares, strict=True):
            out = engine(input_ids=px, labels=py)
            c, k = token_stats(out.logits.detach(), py)
            loss = out.loss
            if len(parts) > 1:
                # a slice with no labelled token has a NaN mean loss; it still takes part
                # in backward (ZeRO's reductions are collective), with a zero gradient
                weighted = loss * (share / total) if share else out.logits.sum() * 0.0
            del out  # the logits (batch x seq x vocab) are not kept through backward, step
            engine.backward(loss if len(parts) == 1 else weighted)
            if k:
                loss_sum += float(loss.detach()) * k
            correct += c
            count += k
        engine.step()
        return loss_sum, correct, count

    def evaluate(self, engine: Any, ids, labels, rank: int, world: int, batch: int):
        """(mean loss per token, token accuracy) over the rows (see `evaluate`)."""
        return evaluate(engine, ids, labels, rank, world, batch)


OBJECTIVES = {"supervised": Supervised, "lora": Supervised}  # by the run's method


def run_loop(
    run: dict[str, Any],
    engine: Any,
    rank: int,
    world: int,
    rep: Sink,
    checkpoints: Checkpoints,
    name: str = "",
) -> dict[str, Any]:
    """Train `engine` on the run's rows to `run["total_steps"]`, then checkpoint and export;
    the final values (trained tokens, full validation) are returned and told to `rep`."""
    data = torch.load(run["data_file"], weights_only=True)
    train_ids, train_labels = data["train_ids"], data["train_labels"]
    lengths = data["train_lengths"]
    valid_ids, valid_labels = data.get("valid_ids"), data.get("valid_labels")
    hp = run["hyperparameters"]
    batch, total, per_epoch = hp["batch_size"], run["total_steps"], run["steps_per_epoch"]
    micro_batches = hp.get("micro_batches") or 1
    local = batch // world
    lora = run.get("method") == "lora"
    objective = OBJECTIVES[run.get("method") or "supervised"]()

    def full_validation() -> dict[str, float]:
        loss, acc = objective.evaluate(engine, valid_ids, valid_labels, rank, world, local)
        return {"full_valid_loss": loss, "full_valid_mean_token_accuracy": acc}

    if checkpoints.restore(engine, rep):
        rep.resumed(engine.global_step)
    st = engine.stats()
    if rank == 0:
        rep.runtime(runtime_values(st))
    worker_log().info(
        "%s attempt %d, rank %d of %d: %d chunks of %d elements, model data %.1f MiB on "
        "this rank, from step %d of %d",
        name,
        rep.attempt,
        rank,
        world,
        sum(v["count"] for v in st["chunks"].values()),
        st["chunk_size"],
        st["model_data_bytes"] / 2**20,
        engine.global_step,
        total,
    )
    rep.running()
    eval_every = hp.get("eval_every")
    if eval_every is None:
        eval_every = max(1, total // 10)
    ckpt_every = run["checkpoint_every"]
    if valid_ids is not None and engine.global_step == 0:
        rep.phase("evaluating")
        before = full_validation()
        rep.metrics(
            0,
            {
                "valid_loss": before["full_valid_loss"],
                "valid_mean_token_accuracy": before["full_valid_mean_token_accuracy"],
                **before,
            },
            "before training",
        )
    sampler = Batches(train_ids.shape[0], batch, per_epoch, run["seed"])
    flops_tok = flops_per_token(engine, train_ids.shape[1])
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
        loss_tok, correct, count = objective.train_step(engine, x, y, micro_batches)
        real = int(lengths[mine].sum())  # tokens that are not padding
        loss_sum, correct, count, real_sum = all_sum(
            [loss_tok, correct, count, float(real)], engine.device
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
            **memory_values(stats),
            "comm_bytes_sent": stats["comm_bytes_sent"] - comm_before,
        }
        comm_before = stats["comm_bytes_sent"]
        done = step + 1
        if valid_ids is not None and eval_every and (done % eval_every == 0) and done < total:
            rep.phase("evaluating")
            # the interval loss on a fixed sample (as OpenAI's valid_loss); the whole
            # file is evaluated before training and at the end (full_valid_loss)
            n = min(valid_ids.shape[0], VALID_SAMPLE_BATCHES * batch)
            values["valid_loss"], values["valid_mean_token_accuracy"] = objective.evaluate(
                engine, valid_ids[:n], valid_labels[:n], rank, world, local
            )
            rep.phase("training")
        if done == total and valid_ids is not None:
            # the whole validation file, as OpenAI's last metrics event carries it
            rep.phase("evaluating")
            full_eval = full_validation()
            values.update(full_eval)
        rep.metrics(done, values, total=total)
        if step == first:  # the warm-up step of this attempt: the trace exists now
            rep.stats(stats)
        if ckpt_every and done % ckpt_every == 0 and done < total:
            rep.phase("checkpointing")
            checkpoints.save(engine, rep, values, done, final=False)
            rep.phase("training")
    # the end: full validation, the final checkpoint, the export
    final: dict[str, Any] = {"trained_tokens": trained_tokens}
    if valid_ids is not None:
        if full_eval is None:  # resumed from the final checkpoint: no step ran
            rep.phase("evaluating")
            full_eval = full_validation()
        final.update(full_eval)
    last = rep.last_values()
    rep.phase("checkpointing")
    checkpoints.save(engine, rep, {**last, **final}, engine.global_step, final=True)
    if run.get("export_dir"):
        rep.phase("exporting")
        _export(engine, run, rank, lora)
    rep.stats(engine.stats())
    rep.finished(final)
    rep.flush()  # what an outage of the store held back goes in before the run ends
    return final


def _export(engine: Any, run: dict[str, Any], rank: int, lora: bool) -> None:
    """A Hugging Face directory of the trained model (a LoRA run: the merged model, with the
    adapter inside it; the layout is in service.lora), and the tokenizer beside it."""
    out_dir = Path(run["export_dir"])
    if lora:
        # the merged model first: its directory replaces the export as a whole
        engine.export_hf(out_dir, variant="merged")
        engine.export_hf(adapter_dir(out_dir), variant="adapter")
    else:
        engine.export_hf(out_dir)
    if rank == 0 and run.get("tokenizer_dir"):
        from transformers import PreTrainedTokenizerFast

        tok = PreTrainedTokenizerFast.from_pretrained(run["tokenizer_dir"])
        tok.save_pretrained(str(out_dir))
