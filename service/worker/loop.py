"""The one worker loop: every training run here is `run_loop` over prepared rows.

A service job (`service.worker.finetune.train_func` on N Ray Train workers) and `pstar train`
(one process, or N Ray Train workers: `service.worker.train_local`,
`service.worker.ray_train`) differ
only in what they hand it: where the rows come from (`run.data_file`, written by
`service.data.rows`, mapped), whom it tells (a `Sink`: the store's `Reporter`, or
`service.worker.runlog.RunLog` for files and the CLI) and where checkpoints go (a `Checkpoints`:
Ray Train's registry, or a directory). The data path, the metrics (names and meanings),
the FLOPs formula, evaluation, checkpoint contents and resume are this module's, once.

Batches are drawn from a seeded permutation per epoch, so step s of a run always sees the
same rows, also after a resume; every rank takes an equal share of each global batch (the
chunks are sharded over the ranks with chunk ZeRO).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from service import methods
from service.adapters import adapter_dir
from service.data.rows import load_rows
from service.methods.objectives import Split, all_sum
from service.spec.run_plan import RunPlan
from service.worker.early_stopping import EarlyStopping
from service.worker.eta import Eta

log = logging.getLogger(__name__)

VALID_SAMPLE_BATCHES = 2  # global batches of the validation file behind each valid_loss


class Sink(Protocol):
    """Whom the loop tells what happens (rank 0 writes; every rank may export gauges)."""

    attempt: int
    run: RunPlan

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
    def early_stopping(self, view: dict[str, Any]) -> None: ...
    def pause_requested(self) -> bool: ...
    def paused(self, step: int) -> None: ...
    def finished(self, final: dict[str, Any]) -> None: ...
    def flush(self) -> bool: ...


class Checkpoints(Protocol):
    """Where a run's checkpoints go and where a restarted run finds its newest one."""

    def restore(self, engine: Any, sink: Sink) -> dict[str, Any] | None:
        """Load the newest checkpoint into the engine, if there is one: the loop's state
        kept with it ({} if none), or None when there was nothing to load."""
        ...

    def save(
        self,
        engine: Any,
        sink: Sink,
        values: dict[str, Any],
        step: int,
        final: bool,
        state: dict[str, Any] | None = None,
    ) -> None:
        """Keep the engine's state at `step` and the loop's `state` (every rank calls it:
        shards are per rank), and tell `sink` where it went."""
        ...


LOOP_STATE = "loop_state.json"  # beside a checkpoint's chunks: what the loop itself keeps


def write_checkpoint(
    engine: Any,
    directory: Path,
    lora: bool,
    shared: bool = False,
    state: dict[str, Any] | None = None,
) -> None:
    """What a checkpoint holds: this rank's chunks, for a LoRA run the PEFT adapter (every
    rank takes part: the adapters may be sharded; rank 0 writes it), and the loop's state
    (early stopping's; rank 0 writes it). `shared`: one directory all ranks see, replaced
    whole (`Engine.save_checkpoint`)."""
    engine.save_checkpoint(directory, shared=shared)
    if lora:
        engine.export_hf(adapter_dir(directory), variant="adapter")
    if state is not None and this_rank() == 0:
        (directory / LOOP_STATE).write_text(json.dumps(state))


def this_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def read_loop_state(directory: Path) -> dict[str, Any]:
    """The loop's state a checkpoint kept ({} for one written before there was any)."""
    f = Path(directory) / LOOP_STATE
    return json.loads(f.read_text()) if f.is_file() else {}


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


def objective_for(run: RunPlan) -> Any:
    """The training method's objective (`service.methods.objectives`)."""
    return methods.get(run.method).objective(run)


def agreed(flag: bool, device: torch.device) -> bool:
    """Rank 0's `flag`, on every rank (what it read from the store the others cannot)."""
    return bool(all_sum([float(flag)], device)[0])


def run_loop(
    run: RunPlan,
    engine: Any,
    rank: int,
    world: int,
    rep: Sink,
    checkpoints: Checkpoints,
    name: str = "",
) -> dict[str, Any]:
    """Train `engine` on the run's rows to `run.total_steps` (or until early stopping
    ends it), then checkpoint and export; the final values (trained tokens, full
    validation) are returned and told to `rep`. A pause asked for through `rep` ends the
    loop at a step boundary with a checkpoint and no export (`{"paused_at_step": s}`)."""
    return RunLoop(run, engine, rank, world, rep, checkpoints, name).run()


class RunLoop:
    """One run of the loop (`run_loop`): its settings, the rows, and what it keeps between
    steps (trained tokens, the early-stopping state, the estimate of the finish)."""

    def __init__(
        self,
        run: RunPlan,
        engine: Any,
        rank: int,
        world: int,
        rep: Sink,
        checkpoints: Checkpoints,
        name: str = "",
    ) -> None:
        self.run_, self.engine, self.rank, self.world = run, engine, rank, world
        self.rep, self.checkpoints, self.name = rep, checkpoints, name
        data = load_rows(run.data_file)
        self.train, self.valid = Split.of(data, "train"), Split.of(data, "valid")
        self.batch, self.total = run.hyperparameters.batch_size, run.total_steps
        self.micro_batches = run.hyperparameters.micro_batches
        self.local = self.batch // world
        self.eval_every = run.eval_every
        self.lora = run.lora
        self.objective = objective_for(run)
        self.eta = Eta(self.total)
        self.best_dir = Path(run.best_dir) if run.best_dir else None
        self.stopper: EarlyStopping | None = None
        self.trained_tokens = 0

    # -- the run ------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        engine, rep, total = self.engine, self.rep, self.total
        self._start()
        sampler = Batches(len(self.train), self.batch, self.run_.steps_per_epoch, self.run_.seed)
        flops_tok = flops_per_token(engine, self.train.seq_len)
        self.trained_tokens = int(rep.values_at(engine.global_step).get("trained_tokens", 0))
        comm_before = engine.stats()["comm_bytes_sent"]
        ckpt_every = self.run_.checkpoint_every
        rep.phase("training")
        first = engine.global_step
        full_eval: dict[str, float] | None = None
        for step in range(first, total):
            values, stats = self._step(sampler.indices(step), flops_tok, comm_before)
            comm_before = stats["comm_bytes_sent"]
            done = step + 1
            if self._evaluates(done):
                self._interval_evaluation(done, values)
            stopping = self.stopper is not None and self.stopper.stopped
            if done == total and self.valid is not None:
                # the whole validation file, as OpenAI's last metrics event carries it
                rep.phase("evaluating")
                full_eval = self._full_validation()
                values.update(full_eval)
            if (finish := self.eta.step_done(total if stopping else done)) is not None:
                values["estimated_finish"] = finish
            rep.metrics(done, values, total=total)
            if step == first:  # the warm-up step of this attempt: the trace exists now
                rep.stats(stats)
            if stopping:
                break
            if done < total and agreed(rep.pause_requested(), engine.device):
                return self._pause(done, values)
            if ckpt_every and done % ckpt_every == 0 and done < total:
                rep.phase("checkpointing")
                t0 = time.perf_counter()
                self.checkpoints.save(engine, rep, values, done, final=False, state=self._state())
                self.eta.checkpoint(time.perf_counter() - t0)
                rep.phase("training")
        return self._finish(full_eval)

    def _start(self) -> None:
        """Resume (the engine and the loop's own state), say where the run starts, run the
        objective's preparation (DPO's reference pass) and the evaluation before training."""
        engine, rep = self.engine, self.rep
        restored = self.checkpoints.restore(engine, rep)
        if restored is not None:
            rep.resumed(engine.global_step)
        self.stopper = EarlyStopping.of(
            self.run_.early_stopping,
            (restored or {}).get("early_stopping"),
            methods.get(self.run_.method).watched,
        )
        if self.stopper is not None and self.best_dir is None:
            raise ValueError("early stopping needs the run's best_dir for the best model")
        st = engine.stats()
        if self.rank == 0:
            rep.runtime(runtime_values(st))
        worker_log().info(
            "%s attempt %d, rank %d of %d: %d chunks of %d elements, model data %.1f MiB on "
            "this rank, from step %d of %d",
            self.name,
            rep.attempt,
            self.rank,
            self.world,
            sum(v["count"] for v in st["chunks"].values()),
            st["chunk_size"],
            st["model_data_bytes"] / 2**20,
            engine.global_step,
            self.total,
        )
        rep.running()
        splits = {"train": self.train, **({"valid": self.valid} if self.valid is not None else {})}
        self.objective.prepare(engine, splits, self.rank, self.world, self.local, rep)
        if self.valid is not None and engine.global_step == 0:
            rep.phase("evaluating")
            before = self._full_validation()
            interval = {k.removeprefix("full_"): v for k, v in before.items()}
            rep.metrics(0, {**interval, **before}, "before training")

    def _step(self, idx: torch.Tensor, flops_tok: float, comm_before: int):
        """One optimizer step on this rank's share of the global batch `idx`: its metrics
        (summed over the ranks) and the engine's stats after it."""
        engine, rank, local = self.engine, self.rank, self.local
        t0 = time.perf_counter()
        mine = idx[rank * local : (rank + 1) * local]
        rows = self.train.rows(mine, engine.device)
        sums = self.objective.train_step(engine, rows, self.micro_batches)
        real = int(self.train.lengths[mine].sum())  # tokens that are not padding
        *summed, real_sum = all_sum([*sums.values(), float(real)], engine.device)
        dt = time.perf_counter() - t0
        self.trained_tokens += int(real_sum)
        stats = engine.stats()
        slots = self.batch * self.train.seq_len
        values = {
            **self.objective.values(dict(zip(sums, summed, strict=True))),
            "lr": engine.lr,
            "step_time_s": dt,
            "tokens_per_second": slots / dt,
            "tflops": flops_tok * slots / dt / 1e12,
            "trained_tokens": self.trained_tokens,
            **memory_values(stats),
            "comm_bytes_sent": stats["comm_bytes_sent"] - comm_before,
        }
        return values, stats

    def _evaluates(self, done: int) -> bool:
        """Whether an interval evaluation follows step `done` (eval_every 0: never)."""
        every = self.eval_every
        return self.valid is not None and bool(every) and done % every == 0 and done < self.total

    def _interval_evaluation(self, done: int, values: dict[str, Any]) -> None:
        """The interval loss on a fixed sample (as OpenAI's valid_loss; the whole file is
        evaluated before training and at the end), and early stopping's verdict on it."""
        assert self.valid is not None
        self.rep.phase("evaluating")
        sample = self.valid.head(min(len(self.valid), VALID_SAMPLE_BATCHES * self.batch))
        values.update(
            self.objective.evaluate(self.engine, sample, self.rank, self.world, self.local)
        )
        if self.stopper is not None:
            # what early stopping watches, lower being better: the validation loss, or an
            # objective's own (the reinforcement reward, negated)
            key, sign = self.stopper.watched
            if self.stopper.observe(done, sign * values[key]) == "improved":
                # the model to export if the run stops early
                self.rep.phase("keeping the best checkpoint")
                write_checkpoint(
                    self.engine, self.best_dir, self.lora, shared=True, state=self._state()
                )
            self.rep.early_stopping(self.stopper.view())
        self.rep.phase("training")

    def _full_validation(self) -> dict[str, float]:
        t0 = time.perf_counter()
        got = self.objective.evaluate(self.engine, self.valid, self.rank, self.world, self.local)
        self.eta.full_eval(time.perf_counter() - t0)
        out = {f"full_{k}": v for k, v in got.items()}
        for ours, theirs in getattr(self.objective, "full_names", {}).items():
            if ours in out:  # OpenAI's name too (a reinforcement job's full_valid_mean_reward)
                out[theirs] = out[ours]
        return out

    def _state(self) -> dict[str, Any]:
        """What the loop keeps in a checkpoint beside the engine's state."""
        return {"early_stopping": self.stopper.state()} if self.stopper is not None else {}

    def _pause(self, done: int, values: dict[str, Any]) -> dict[str, Any]:
        """A checkpoint at this step boundary, then the job is paused and the loop ends."""
        self.rep.phase("pausing")
        # the flag tells the driver the run paused (Ray Train hands it the last report)
        paused = {**values, "paused_at_step": done}
        self.checkpoints.save(self.engine, self.rep, paused, done, final=False, state=self._state())
        self.rep.paused(done)
        self.rep.flush()
        return {"paused_at_step": done}

    def _finish(self, full_eval: dict[str, float] | None) -> dict[str, Any]:
        """The end: early stopping's best model, full validation, the final checkpoint and
        the export."""
        engine, rep, stopper = self.engine, self.rep, self.stopper
        final: dict[str, Any] = {"trained_tokens": self.trained_tokens}
        if stopper is not None and stopper.stopped:
            rep.phase("restoring the best checkpoint")
            engine.load_checkpoint(self.best_dir)
            rep.event(
                f"Early stopping at step {stopper.stopped_at_step}: {stopper.reason()}. The "
                f"model of step {stopper.best_step} is the fine-tuned model.",
                **stopper.view(),
            )
            full_eval = None  # of the best model, below
            final["early_stopping"] = stopper.view()
        if self.valid is not None:
            if full_eval is None:  # resumed from the final checkpoint, or the best model
                rep.phase("evaluating")
                full_eval = self._full_validation()
            final.update(full_eval)
        last = rep.last_values()
        rep.phase("checkpointing")
        self.checkpoints.save(
            engine, rep, {**last, **final}, engine.global_step, final=True, state=self._state()
        )
        if self.run_.export_dir:
            rep.phase("exporting")
            _export(engine, self.run_, self.rank, self.lora)
        rep.stats(engine.stats())
        rep.finished(final)
        rep.flush()  # what an outage of the store held back goes in before the run ends
        return final


def _export(engine: Any, run: RunPlan, rank: int, lora: bool) -> None:
    """A Hugging Face directory of the trained model (a LoRA run: the merged model, with the
    adapter inside it; the layout is in service.adapters), and the tokenizer beside it."""
    assert run.export_dir is not None
    out_dir = Path(run.export_dir)
    if lora:
        # the merged model first: its directory replaces the export as a whole
        engine.export_hf(out_dir, variant="merged")
        engine.export_hf(adapter_dir(out_dir), variant="adapter")
    else:
        engine.export_hf(out_dir)
    if rank == 0 and run.tokenizer_dir:
        from transformers import PreTrainedTokenizerFast

        tok = PreTrainedTokenizerFast.from_pretrained(run.tokenizer_dir)
        tok.save_pretrained(str(out_dir))
