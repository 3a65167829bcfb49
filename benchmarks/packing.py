"""Packing benchmark: the main job's data trained packed and padded, on the same model.

The main job's model (SmolLM2-135M-Instruct) and data (WordNet chat pairs), tokenized as a
job does (`service.data.datasets.tokenize` with the model's chat template, `seq_len` auto), are
laid out twice: one example per row, right-padded (`datasets.to_rows`), and packed
(`service.data.packing.pack`). One engine (the job's engine config: `dtype` auto, chunks auto)
trains on a batch of `--batch` rows of each layout in turn, interleaved (padded, packed,
packed, padded, ...), after one warm-up step of each; each step is timed on its own.

Reported per layout: rows per epoch, fill (real tokens over slots), examples per row, the
median step time and slots/s (batch x seq_len over the step time: the compute rate), and
over an epoch (its steps x the median step time; an epoch trains every example once, so
both layouts train the same tokens in it) the real tokens/s, trained (labelled) tokens/s
and examples/s. Every batch has the same shape, so a step's time does not depend on which
examples it holds; the tokens a step trains do (a sampled batch of padded rows holds
anywhere from 6 to 30 trained tokens a row), so per-step token rates of a few sampled
batches are noisy where the epoch's are not (they are reported too, as `sampled_*`).
The speedup in trained tokens/s is the ratio of the epochs' steps divided by the median
over interleaved pairs of packed ÷ padded step time.

Loss equality: `--check-examples` examples, each one's mean loss in a packed row against
its loss in a row of its own, in fp32 on the same weights (the largest relative
difference is reported; the test holds it to 1e-5).

    pstar bench packing --json
"""

from __future__ import annotations

import gc
import itertools
import math
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from benchmarks.report import bench_dtype, finish, load_avg, machine, median
from pstar_core.hf import load_causal_lm

__all__ = ["run"]

PADDED, PACKED = "padded", "packed"


def _layouts(model_dir: Path, data: Path, seq_len: int | None):
    """(tokenizer, seq_len, {layout: Encoded}) of the data as a job lays it out."""
    from transformers import AutoTokenizer

    from service.data.datasets import read_examples
    from service.data.packing import pack
    from service.data.rows import to_rows
    from service.data.tokens import tokenize
    from service.spec import auto

    tok = AutoTokenizer.from_pretrained(model_dir)
    fmt, examples = read_examples(data)
    if fmt not in ("chat", "completion"):
        raise ValueError(f"{data}: packing applies to chat or completion examples, not {fmt}")
    tokenized = tokenize(tok, fmt, examples)
    if seq_len is None:
        seq_len = auto.seq_len(tokenized.longest, 1 << 15)
    return (
        tok,
        seq_len,
        {PADDED: to_rows(tok, tokenized, seq_len), PACKED: pack(tok, tokenized, seq_len)},
    )


def _batches(n_rows: int, batch: int, count: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(n_rows, generator=g)
    return [perm[(torch.arange(batch) + i * batch) % n_rows] for i in range(count)]


def loss_agreement(model_dir: Path, packed: Any, examples: int) -> dict[str, Any]:
    """The largest relative difference between an example's mean loss in its packed row
    and alone in a row of its own, over the first `examples` examples of the packed rows,
    in fp32 (transformers' model, SDPA attention)."""

    from service.data.datasets import IGNORE

    model = load_causal_lm(model_dir, dtype=torch.float32).eval()
    worst, seen = 0.0, 0
    with torch.no_grad():
        for r in range(packed.input_ids.shape[0]):
            if seen >= examples:
                break
            n = int(packed.lengths[r])
            pos = packed.position_ids[r, :n].tolist()
            starts = [i for i, p in enumerate(pos) if p == 0] + [n]
            # rows are stored int32 (`service.data.rows`); the model takes int64
            row = {k: getattr(packed, k)[r : r + 1].long() for k in ("input_ids", "position_ids")}
            logits = model(**row, use_cache=False).logits[0]
            for a, b in itertools.pairwise(starts):
                if seen >= examples:
                    break
                tg = packed.labels[r, a + 1 : b].long()
                keep = tg != IGNORE
                if not keep.any():
                    continue
                alone = model(input_ids=packed.input_ids[r : r + 1, a:b].long()).logits[0, :-1]
                ce = torch.nn.functional.cross_entropy
                got = ce(logits[a : b - 1][keep].double(), tg[keep]).item()
                want = ce(alone[keep].double(), tg[keep]).item()
                worst = max(worst, abs(got - want) / abs(want))
                seen += 1
    return {"examples_checked": seen, "max_rel_diff": worst}


def run(
    model_dir: Path,
    data: Path,
    steps: int = 20,
    batch: int = 8,
    seq_len: int | None = None,
    dtype: str = "auto",
    check_examples: int = 32,
    json_out: bool = False,
) -> dict[str, Any]:
    import pstar_core
    from service.methods.objectives import Rows, Supervised

    if steps < 1 or batch < 1:
        raise ValueError("--steps and --batch must be at least 1")
    console = Console()
    load_before = load_avg()
    dtype = bench_dtype(dtype)
    _tok, seq_len, layouts = _layouts(model_dir, data, seq_len)
    reports = {k: v.report() for k, v in layouts.items()}
    batches = {
        k: _batches(reports[k]["rows"], batch, steps + 1, seed=i) for i, k in enumerate(layouts)
    }
    torch.manual_seed(0)
    engine = pstar_core.initialize(model_dir, {"dtype": dtype, "optimizer": {"lr": 1e-5}})
    objective = Supervised()
    times: dict[str, list[float]] = {k: [] for k in layouts}
    counts: dict[str, list[dict[str, float]]] = {k: [] for k in layouts}
    try:
        for i in range(steps + 1):  # the first of each layout is the warm-up
            order = [PADDED, PACKED] if i % 2 == 0 else [PACKED, PADDED]
            for name in order:
                enc, idx = layouts[name], batches[name][i]
                pos = enc.position_ids[idx].long() if enc.position_ids is not None else None
                rows = Rows(enc.input_ids[idx].long(), enc.labels[idx].long(), pos)
                gc.collect()
                t0 = time.perf_counter()
                sums = objective.train_step(engine, rows, micro_batches=1)
                dt = time.perf_counter() - t0
                if i == 0:
                    continue
                times[name].append(dt)
                kept = (pos == 0).sum().item() - _pad_blocks(enc, idx) if pos is not None else batch
                counts[name].append(
                    {
                        "real": float(enc.lengths[idx].sum()),
                        "trained": sums["count"],
                        "examples": float(kept),
                        "loss": sums["loss_sum"] / max(1.0, sums["count"]),
                    }
                )
        engine_dtype = engine.stats()["compute_dtype"]
    finally:
        engine.close()
    per: dict[str, dict[str, float]] = {}
    for name in layouts:
        ts, cs, rep = times[name], counts[name], reports[name]
        step_s = median(ts)
        steps_per_epoch = math.ceil(rep["rows"] / batch)
        epoch_s = steps_per_epoch * step_s
        per[name] = {
            "rows": rep["rows"],
            "fill_ratio": rep["fill_ratio"],
            "examples_per_row": rep["examples_per_row"],
            "steps_per_epoch": steps_per_epoch,
            "s_per_step": step_s,
            "slots_per_s": median([batch * seq_len / t for t in ts]),
            "epoch_s": epoch_s,
            "real_tokens_per_s": rep["tokens"] / epoch_s,
            "trained_tokens_per_s": rep["loss_tokens"] / epoch_s,
            "examples_per_s": (rep["examples"] - rep["dropped_examples"]) / epoch_s,
            "sampled_trained_tokens_per_s": median(
                [c["trained"] / t for c, t in zip(cs, ts, strict=True)]
            ),
            "sampled_examples_per_s": median(
                [c["examples"] / t for c, t in zip(cs, ts, strict=True)]
            ),
        }
    step_ratio = median([a / b for a, b in zip(times[PACKED], times[PADDED], strict=True)])
    steps_ratio = per[PADDED]["steps_per_epoch"] / per[PACKED]["steps_per_epoch"]
    agreement = None
    if check_examples:
        agreement = loss_agreement(model_dir, layouts[PACKED], check_examples)
    result = {
        "model": model_dir.name,
        "data": data.name,
        "examples": reports[PADDED]["examples"],
        "trained_tokens_per_epoch": reports[PADDED]["loss_tokens"],
        "seq_len": seq_len,
        "batch_rows": batch,
        "steps_per_layout": steps,
        **machine(engine_dtype),
        "layouts": per,
        "step_times_s": times,
        "step_time_ratio_packed_vs_padded": step_ratio,
        "steps_per_epoch_ratio_padded_vs_packed": steps_ratio,
        "loss_agreement": agreement,
        "speedup_trained_tokens_per_s": steps_ratio / step_ratio,
    }
    _table(console, result)
    return finish(console, result, load_before, load_avg(), json_out)


def _pad_blocks(enc: Any, idx: torch.Tensor) -> int:
    """How many of the rows `idx` end in a padding block (its positions also start at 0)."""
    return int((enc.lengths[idx] < enc.input_ids.shape[1]).sum())


def _table(console: Console, r: dict[str, Any]) -> None:
    t = Table(
        title=f"Packing on {r['model']} / {r['data']}: {r['batch_rows']} rows of {r['seq_len']} "
        f"tokens per step, {r['steps_per_layout']} timed steps each, interleaved"
    )
    cols = ("layout", "rows", "fill", "ex/row", "s/step", "slots/s", "epoch")
    cols += ("real tok/s", "trained tok/s", "examples/s")
    for c in cols:
        t.add_column(c, justify="right")
    for name, v in r["layouts"].items():
        t.add_row(
            name,
            str(v["rows"]),
            f"{v['fill_ratio']:.1%}",
            f"{v['examples_per_row']:.2f}",
            f"{v['s_per_step']:.3f}",
            f"{v['slots_per_s']:.0f}",
            f"{v['steps_per_epoch']} x {v['s_per_step']:.2f} s = {v['epoch_s']:.0f} s",
            f"{v['real_tokens_per_s']:.0f}",
            f"{v['trained_tokens_per_s']:.1f}",
            f"{v['examples_per_s']:.2f}",
        )
    console.print(t)
    agree = r["loss_agreement"]
    console.print(
        f"packed ÷ padded step time, median of interleaved pairs: "
        f"{r['step_time_ratio_packed_vs_padded']:.3f}x; steps per epoch padded ÷ packed "
        f"{r['steps_per_epoch_ratio_padded_vs_packed']:.3f}; trained tokens/s over an epoch "
        f"{r['speedup_trained_tokens_per_s']:.2f}x ({r['trained_tokens_per_epoch']} trained "
        "tokens an epoch in either layout)"
    )
    if agree:
        console.print(
            f"loss of {agree['examples_checked']} examples packed vs alone (fp32): largest "
            f"relative difference {agree['max_rel_diff']:.2e}"
        )
