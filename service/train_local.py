"""The training loop of a job in one process: data, engine, steps, evaluation, outputs.

Progress goes to a callback (the CLI draws it); metrics go to `metrics.jsonl` in the run
directory; a checkpoint is written at the end (and resumed from if present).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

import pstar_core
from pstar_core.config import ConfigError
from pstar_core.models import GPT, flops_per_token, get_config
from service.data import BatchSampler, encode, read_text, split, train_tokenizer
from service.spec import TrainSpec

StepCallback = Callable[[int, dict[str, Any]], None]


@torch.no_grad()
def evaluate(engine: pstar_core.Engine, seqs: torch.Tensor, batches: int, batch_size: int) -> float:
    """Held-out perplexity: exp of the mean token loss over the first `batches` batches."""
    engine.eval()
    losses = []
    for i in range(min(batches, math.ceil(seqs.shape[0] / batch_size))):
        x = seqs[i * batch_size : (i + 1) * batch_size]
        losses.append(engine(input_ids=x, labels=x).loss.float().item())
    engine.train()
    return math.exp(sum(losses) / len(losses))


def run_training(
    spec: TrainSpec,
    on_step: StepCallback | None = None,
    on_phase: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    phase = on_phase or (lambda _msg: None)
    run_dir = spec.output_dir / spec.name
    run_dir.mkdir(parents=True, exist_ok=True)
    phase(f"reading {spec.data.path}")
    text = read_text(spec.data.path, spec.data.max_chars)
    engine_cfg = spec.engine_config()
    engine, tok, eos, cfg_flops = build_engine(spec, run_dir, text, phase)
    train_seqs, held_seqs = split(
        encode(tok, text, eos), spec.data.seq_len, spec.data.heldout_fraction
    )
    ckpt = run_dir / "checkpoint"
    if (ckpt / "pstar_checkpoint.json").exists():
        phase(f"resuming from {ckpt}")
        engine.load_checkpoint(ckpt)

    loop = spec.train
    phase("held-out perplexity before training")
    ppl_before = evaluate(engine, held_seqs, loop.eval_batches, loop.batch_size)
    sampler = BatchSampler(train_seqs, loop.batch_size, loop.seed)
    tokens_per_step = loop.batch_size * spec.data.seq_len
    flops_per_step = cfg_flops * tokens_per_step
    if engine_cfg.activation_checkpointing:
        flops_per_step = flops_per_step * 4 // 3  # one more forward: 8N instead of 6N
    metrics_file = (run_dir / "metrics.jsonl").open("a")
    last: dict[str, Any] = {}
    for step in range(engine.global_step, loop.steps):
        t0 = time.perf_counter()
        x = sampler.batch(step)
        loss_sum = 0.0
        for mb in x.chunk(loop.micro_batches):
            loss = engine(input_ids=mb, labels=mb).loss / loop.micro_batches
            engine.backward(loss)
            loss_sum += loss.item()
        applied = engine.step()
        dt = time.perf_counter() - t0
        last = {
            "step": step + 1,
            "loss": loss_sum,
            "lr": engine.lr,
            "step_applied": applied,
            "step_time_s": dt,
            "tokens_per_s": tokens_per_step / dt,
            "tflops": flops_per_step / dt / 1e12,
        }
        if (step + 1) % loop.log_every == 0 or step + 1 == loop.steps:
            stats = engine.stats()
            last["model_data_bytes"] = stats["model_data_bytes"]
            last["bytes_moved"] = stats["bytes_moved"]
            metrics_file.write(json.dumps(last) + "\n")
            metrics_file.flush()
        if on_step:
            on_step(step + 1, last)
    metrics_file.close()
    phase("held-out perplexity after training")
    ppl_after = evaluate(engine, held_seqs, loop.eval_batches, loop.batch_size)
    phase(f"saving checkpoint to {ckpt}")
    engine.save_checkpoint(ckpt)
    export = None
    if spec.is_path_model:
        export = run_dir / "hf"
        phase(f"exporting a Hugging Face model directory to {export}")
        engine.export_hf(export)
    summary = {
        "run_dir": str(run_dir),
        "model": spec.model,
        "params": engine.stats()["params"],
        "steps": loop.steps,
        "final_loss": last.get("loss"),
        "heldout_ppl_before": ppl_before,
        "heldout_ppl_after": ppl_after,
        "checkpoint": str(ckpt),
        "hf_export": str(export) if export else None,
        "model_data_bytes_per_param": engine.stats()["model_data_bytes_per_param"],
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    # The engine's measured stats (tiers, moves, tracer moments) for `pstar plot-trace`.
    (run_dir / "trace.json").write_text(json.dumps(engine.stats()))
    return summary


def ensure_tokenizer(spec: TrainSpec, run_dir: Path, text: str, phase=lambda _m: None):
    """The run's BPE tokenizer for a zoo model: trained on the text once, then reused."""
    tok_path = run_dir / "tokenizer.json"
    if tok_path.exists():
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(tok_path))
    phase("training the tokenizer")
    return train_tokenizer(text, spec.data.vocab_size, tok_path)


def build_engine(spec: TrainSpec, run_dir: Path, text: str, phase=lambda _m: None):
    """(engine, tokenizer, eos id, FLOPs per token) for a spec; ZeRO if distributed is up."""
    engine_cfg = spec.engine_config()
    if spec.is_path_model:
        return _pretrained(spec, engine_cfg, phase)
    return _from_zoo(spec, engine_cfg, run_dir, text, phase)


def _from_zoo(spec: TrainSpec, engine_cfg, run_dir: Path, text: str, phase):
    """A zoo GPT trained from scratch with a BPE tokenizer learned on the text."""
    tok = ensure_tokenizer(spec, run_dir, text, phase)
    cfg = replace(
        get_config(spec.model),
        vocab_size=tok.get_vocab_size(),
        seq_len=spec.data.seq_len,
        **spec.model_overrides,
    )
    torch.manual_seed(spec.train.seed)
    phase(f"building {spec.model} in chunks")
    engine = pstar_core.initialize(lambda: GPT(cfg), engine_cfg)
    return engine, tok, tok.token_to_id("<|endoftext|>"), flops_per_token(cfg)


def _pretrained(spec: TrainSpec, engine_cfg, phase):
    """A pretrained HF model directory, streamed into chunks, with its own tokenizer."""
    from transformers import AutoTokenizer

    from pstar_core.hf import HFLoadError, is_hf_dir

    path = Path(spec.model)
    if not is_hf_dir(path):
        raise ConfigError(
            f"model: {path} is not a Hugging Face model directory (no config.json); "
            "run scripts/setup.sh to prepare SmolLM2, or name a zoo model"
        )
    phase(f"loading {path.name} into chunks")
    try:
        engine = pstar_core.initialize(path, engine_cfg)
    except HFLoadError as e:
        raise ConfigError(f"model: {e}") from None
    hf_tok = AutoTokenizer.from_pretrained(str(path))
    n_params = engine.stats()["params"]
    n_layers = engine.module.config.num_hidden_layers
    hidden = engine.module.config.hidden_size
    # 6N per token for the matmuls plus the attention term, as for the zoo models.
    flops = 6 * n_params + 12 * n_layers * hidden * spec.data.seq_len
    return engine, hf_tok.backend_tokenizer, hf_tok.eos_token_id, flops
