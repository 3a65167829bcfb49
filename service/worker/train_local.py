"""`pstar train`: a spec (`service.spec.train.TrainSpec`) run by the one worker loop
(`service.worker.loop.run_loop`) in this process; `service.worker.ray_train` runs it on N Ray Train
workers.

The front's own part is what a spec says and a job does not: a text file cut into rows
(every token trained on; the last `heldout_fraction` held out, the first `eval_batches`
batches of those evaluated before and after), a zoo model built natively with a BPE
tokenizer learned on the text, and a run directory with `metrics.jsonl`, the checkpoint
(resumed from if present), `summary.json` and `trace.json` (for `pstar plot-trace`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

import pstar_core
from pstar_core.checkpoint import META
from pstar_core.config import ConfigError
from pstar_core.models import GPT, get_config
from service import methods
from service.data.datasets import Encoded
from service.data.prepare import encode
from service.data.rows import save_rows
from service.data.text import read_text, train_tokenizer
from service.spec import auto
from service.spec.run_plan import RunHyperparameters, RunPlan
from service.spec.train import TrainSpec
from service.worker.loop import (
    Sink,
    prepare_kernels,
    read_loop_state,
    run_loop,
    write_checkpoint,
)
from service.worker.runlog import RunLog, StepCallback


def prepare_spec_run(spec: TrainSpec, phase: Callable[[str], None] = lambda _m: None):
    """(run, tokenizer) for a spec: the rows written where the loop reads them."""
    run_dir = spec.output_dir / spec.name
    run_dir.mkdir(parents=True, exist_ok=True)
    phase(f"reading {spec.data.path}")
    text = read_text(spec.data.path, spec.data.max_chars)
    tok = load_tokenizer(spec, run_dir, text, phase)
    rows = encode(tok, "text", [{"text": line} for line in text.splitlines()], spec.data.seq_len)
    n = rows.input_ids.shape[0]
    n_held = max(1, int(n * spec.data.heldout_fraction))
    if n - n_held < 1:
        raise ConfigError(f"data: only {n} sequences of {spec.data.seq_len} tokens; use more text")
    loop = spec.train
    train = _cut(rows, 0, n - n_held)
    valid = _cut(rows, n - n_held, min(n, n - n_held + loop.eval_batches * loop.batch_size))
    data_file = run_dir / "data" / "rows"
    save_rows(data_file, train, valid)
    run = RunPlan(
        model={"spec": spec.model, "vocab_size": len(tok)},
        method=methods.DEFAULT,
        lora=bool(spec.engine.get("lora")),  # adapters from the engine's own `lora` section
        hyperparameters=RunHyperparameters(
            batch_size=loop.batch_size,
            micro_batches=loop.micro_batches,
            eval_every=loop.eval_every or 0,  # 0: held-out loss before and after only
        ),
        engine=spec.engine,
        seq_len=spec.data.seq_len,
        total_steps=loop.steps,
        steps_per_epoch=math.ceil((n - n_held) / loop.batch_size),
        checkpoint_every=auto.checkpoint_every(loop.checkpoint_every, loop.steps, False),
        seed=loop.seed,
        data_file=str(data_file),
        export_dir=str(run_dir / "hf") if spec.is_path_model else None,
    )
    return run, tok


def _cut(rows: Encoded, start: int, stop: int) -> Encoded:
    return Encoded(rows.input_ids[start:stop], rows.labels[start:stop], rows.lengths[start:stop])


def load_tokenizer(spec: TrainSpec, run_dir: Path, text: str, phase=lambda _m: None):
    """The model's own tokenizer (a HF directory), or for a zoo model a byte-level BPE
    tokenizer trained on the text once and reused (`<run dir>/tokenizer.json`)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if spec.is_path_model:
        return AutoTokenizer.from_pretrained(spec.model)
    tok_path = run_dir / "tokenizer.json"
    if tok_path.exists():
        from tokenizers import Tokenizer

        raw = Tokenizer.from_file(str(tok_path))
    else:
        phase("training the tokenizer")
        raw = train_tokenizer(text, spec.data.vocab_size, tok_path)
    return PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|endoftext|>")


def build_engine(spec: TrainSpec, run: RunPlan, phase=lambda _m: None):
    """The engine for a spec's model (ZeRO over the ranks if distributed is up)."""
    from pstar_core.hf import HFLoadError, is_hf_dir

    engine_cfg = spec.engine_config()
    torch.manual_seed(spec.train.seed)
    if not spec.is_path_model:
        cfg = replace(
            get_config(spec.model),
            vocab_size=run.model["vocab_size"],
            seq_len=spec.data.seq_len,
            **spec.model_overrides,
        )
        phase(f"building {spec.model} in chunks")
        return pstar_core.initialize(lambda: GPT(cfg), engine_cfg)
    path = Path(spec.model)
    if not is_hf_dir(path):
        raise ConfigError(
            f"model: {path} is not a Hugging Face model directory (no config.json); "
            "run scripts/setup.sh to prepare SmolLM2, or name a zoo model"
        )
    phase(f"loading {path.name} into chunks")
    try:
        return pstar_core.initialize(path, engine_cfg)
    except HFLoadError as e:
        raise ConfigError(f"model: {e}") from None


class DirCheckpoints:
    """The run's one checkpoint directory, replaced whole at each save, resumed from."""

    def __init__(self, directory: Path, lora: bool) -> None:
        self.directory, self.lora = directory, lora

    def restore(self, engine: Any, sink: Sink) -> dict[str, Any] | None:
        if not (self.directory / META).is_file():
            return None
        sink.phase(f"resuming from {self.directory}")
        engine.load_checkpoint(self.directory)
        return read_loop_state(self.directory)

    def save(
        self,
        engine: Any,
        sink: Sink,
        values: dict[str, Any],
        step: int,
        final: bool,
        state: dict[str, Any] | None = None,
    ) -> None:
        write_checkpoint(engine, self.directory, self.lora, shared=True, state=state)


def run_training(
    spec: TrainSpec,
    on_step: StepCallback | None = None,
    on_phase: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Train a spec in this process; the run's summary (also in `summary.json`)."""
    phase = on_phase or (lambda _msg: None)
    run_dir = spec.output_dir / spec.name
    run, _tok = prepare_spec_run(spec, phase)
    rep = RunLog(run, run_dir, spec.train.log_every, on_step=on_step, on_phase=phase)
    prepare_kernels(rep)
    engine = build_engine(spec, run, phase)
    ckpt = run_dir / "checkpoint"
    final = run_loop(run, engine, 0, 1, rep, DirCheckpoints(ckpt, run.lora))
    stats = rep.latest_stats

    def ppl(values: dict[str, Any]) -> float | None:
        loss = values.get("full_valid_loss")
        return math.exp(loss) if loss is not None else None

    summary = {
        "run_dir": str(run_dir),
        "model": spec.model,
        "params": stats["params"],
        "steps": spec.train.steps,
        "final_loss": rep.last.get("train_loss"),
        "heldout_ppl_before": ppl(rep.before),  # None when resumed past the start
        "heldout_ppl_after": ppl(final),
        "checkpoint": str(ckpt),
        "hf_export": run.export_dir,
        "model_data_bytes_per_param": stats["model_data_bytes_per_param"],
        "trained_tokens": final["trained_tokens"],
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    # The engine's measured stats (tiers, moves, tracer moments) for `pstar plot-trace`.
    (run_dir / "trace.json").write_text(json.dumps(stats))
    return summary
