"""LoRA benchmark: the engine's LoRA against full fine-tuning and against peft + plain torch.

Every recipe runs in one dtype (``--dtype``, default auto: what the engine picks on this
CPU); each reports the dtype its first linear layer was seen computing in.

Part 1, step and model data, on a real pretrained directory (SmolLM2-135M): three recipes
with the same base weights and the same token batches, interleaved one step each per
round with the order alternating (A B C, C B A, ...):

- ``engine lora``: ``pstar_core.initialize(dir, {"lora": ...})``: the base in frozen
  chunks of the dtype, adapters in param chunks of the dtype with fp32 masters and Adam
  state;
- ``engine full``: the same engine training every weight;
- ``peft + torch``: ``from_pretrained(dtype=...)`` + ``get_peft_model`` (peft keeps the
  adapters in fp32) + ``torch.optim.AdamW`` over the adapters: the usual recipe.

Part 2, scale under a fixed cap: pretrained Llama directories (hidden 512, random bf16
weights written as safetensors shards, loaded in the dtype) of growing depth, each loaded
and trained with LoRA for two steps by each recipe in a fresh process that is killed when
its resident memory passes the cap (`pstar bench scale`'s trials: doubling, then a binary
search). Ours streams the base into frozen chunks with a disk tier behind host memory;
peft + torch holds the whole base in memory. Reported: the largest base per recipe, and the ratio.

    pstar bench lora --json
"""

from __future__ import annotations

import gc
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from benchmarks.report import (
    bench_dtype,
    finish,
    load_avg,
    machine,
    median,
    torch_dtype,
    watch_compute_dtype,
)
from pstar_core.hf import load_causal_lm

__all__ = ["run"]

LORA = {"r": 16, "alpha": 32, "target_modules": "all-linear"}
ENGINE_LORA, ENGINE_FULL, PEFT = "engine lora", "engine full", "peft + torch"
SCALE_OURS, SCALE_PEFT = "ours_lora", "peft_lora"  # trial systems of benchmarks.scale
_LR = 1e-4


def _engine(model_dir: Path, lora: bool, dtype: str) -> tuple[Any, Any]:
    import pstar_core

    cfg: dict[str, Any] = {"dtype": dtype, "optimizer": {"lr": _LR}}
    if lora:
        cfg["lora"] = LORA
    engine = pstar_core.initialize(model_dir, cfg)

    def step(x: torch.Tensor) -> float:
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        return loss.item()

    return engine, step


def _peft(model_dir: Path, dtype: str) -> tuple[Any, Any]:
    import peft

    base = load_causal_lm(model_dir, dtype=torch_dtype(dtype))
    model = peft.get_peft_model(
        base,
        peft.LoraConfig(
            r=LORA["r"], lora_alpha=LORA["alpha"], target_modules=LORA["target_modules"]
        ),
    )
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=_LR, weight_decay=0.0)

    def step(x: torch.Tensor) -> float:
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    return model, step


def _allocated(engine: Any) -> dict[str, dict[str, float]]:
    """What the engine's chunks really allocate, measured from their payloads' storages
    (each storage counted once), for the frozen list and the trainable lists apart:
    bytes per parameter (padding in the chunks included) and per chunk element. Part 1
    has no disk tier, so every chunk is in memory once a step has made its optimizer
    states."""
    from pstar_core.chunk import TRAINABLE_LISTS, ChunkType

    st = engine.stats()
    params = {"frozen": st["params"] - st["trainable_params"], "trainable": st["trainable_params"]}
    kinds = {"frozen": (ChunkType.FROZEN,), "trainable": TRAINABLE_LISTS}
    per_param: dict[str, float] = {}
    per_elem: dict[str, float] = {}
    for part, lists in kinds.items():
        chunks = [c for kind in lists for c in engine.manager.lists[kind]]
        if not chunks or not params[part]:
            continue
        held = {s.data_ptr(): s.nbytes() for s in (c.payload.untyped_storage() for c in chunks)}
        per_param[part] = sum(held.values()) / params[part]
        # the elements of one list's chunks: the same in each of the trainable lists
        elems = len(engine.manager.lists[lists[0]]) * st["chunk_size"]
        per_elem[part] = sum(held.values()) / elems
    return {"per_param": per_param, "per_chunk_elem": per_elem}


def _peft_model_bytes(model: Any) -> int:
    """Weights + fp32 gradients + two Adam moments of the trainable ones."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return total + trainable * 4 * 3


def step_and_memory(
    model_dir: Path,
    rounds: int,
    warmup: int,
    batch: int,
    seq: int,
    console: Console,
    dtype: str = "auto",
) -> dict[str, Any]:
    dtype = bench_dtype(dtype)
    torch.manual_seed(0)
    eng_lora, step_lora = _engine(model_dir, lora=True, dtype=dtype)
    eng_full, step_full = _engine(model_dir, lora=False, dtype=dtype)
    peft_model, step_peft = _peft(model_dir, dtype)
    steps = {ENGINE_LORA: step_lora, ENGINE_FULL: step_full, PEFT: step_peft}
    seen = {
        ENGINE_LORA: watch_compute_dtype(eng_lora.module),
        ENGINE_FULL: watch_compute_dtype(eng_full.module),
        PEFT: watch_compute_dtype(peft_model),
    }
    times: dict[str, list[float]] = {k: [] for k in steps}
    losses: dict[str, list[float]] = {k: [] for k in steps}
    vocab = peft_model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    order = list(steps)
    for i in range(warmup + rounds):
        x = torch.randint(0, vocab, (batch, seq), generator=g)
        for name in order if i % 2 == 0 else order[::-1]:
            gc.collect()
            t0 = time.perf_counter()
            losses[name].append(steps[name](x))
            if i >= warmup:
                times[name].append(time.perf_counter() - t0)
    st_lora, st_full = eng_lora.stats(), eng_full.stats()
    alloc_lora, alloc_full = _allocated(eng_lora), _allocated(eng_full)
    out = {
        "s_per_step": {k: median(v) for k, v in times.items()},
        "ratio_step_vs_peft": median(
            [a / b for a, b in zip(times[ENGINE_LORA], times[PEFT], strict=True)]
        ),
        "ratio_step_lora_vs_full": median(
            [a / b for a, b in zip(times[ENGINE_LORA], times[ENGINE_FULL], strict=True)]
        ),
        "model_data_bytes": {
            ENGINE_LORA: st_lora["model_data_bytes"],
            ENGINE_FULL: st_full["model_data_bytes"],
            PEFT: _peft_model_bytes(peft_model),
        },
        "params": st_lora["params"],
        "adapter_params": st_lora["trainable_params"],
        "bytes_per_param_lora": st_lora["model_data_bytes_per_param"],
        "bytes_per_param_split": st_lora["bytes_per_param"],
        "bytes_per_param_full": st_full["model_data_bytes_per_param"],
        # measured: the chunks' storage per parameter (padding included) and per chunk
        # element, frozen and trainable lists apart
        "allocated_bytes_per_param_split": alloc_lora["per_param"],
        "allocated_bytes_per_param_full": alloc_full["per_param"]["trainable"],
        "allocated_bytes_per_chunk_elem_split": alloc_lora["per_chunk_elem"],
        "allocated_bytes_per_chunk_elem_full": alloc_full["per_chunk_elem"]["trainable"],
        "first_losses": {k: v[0] for k, v in losses.items()},
        "compute_dtype_seen": {k: f() for k, f in seen.items()},
        "engine_dtype": st_lora["precision"]["dtype"],
    }
    table = Table(
        title=f"LoRA r={LORA['r']} on {model_dir.name}: {batch}x{seq} tokens per step, {dtype}"
    )
    for col in ("recipe", "s/step (median)", "model data", "bytes/param", "computed in"):
        table.add_column(col, justify="right")
    n = out["params"]
    params = {ENGINE_LORA: n, ENGINE_FULL: st_full["params"], PEFT: n}  # full: no adapters
    for k in steps:
        b = out["model_data_bytes"][k]
        per = b / params[k]
        table.add_row(
            k,
            f"{out['s_per_step'][k]:.3f}",
            f"{b / 2**20:.0f} MiB",
            f"{per:.2f}",
            out["compute_dtype_seen"][k] or "-",
        )
    console.print(table)
    split = out["bytes_per_param_split"]
    console.print(
        f"engine lora: base {split['frozen']:.2f} B/param, adapters {split['trainable']:.2f} "
        f"B/param ({out['adapter_params']:,} of {n:,} params), allocated with the chunks' "
        f"padding {alloc_lora['per_param'].get('frozen', 0):.2f} and "
        f"{alloc_lora['per_param'].get('trainable', 0):.2f}; step ratio vs peft "
        f"{out['ratio_step_vs_peft']:.2f}, vs full {out['ratio_step_lora_vs_full']:.2f} "
        f"(medians of {rounds} interleaved rounds)"
    )
    for e in (eng_lora, eng_full):
        e.close()
    return out


# -- part 2: the largest base under a cap, with `pstar bench scale`'s trials ---------------

SCALE_SHAPE = {  # a Llama base (what LoRA users start from); part 2 varies the depth
    "vocab_size": 8192,
    "hidden_size": 512,
    "intermediate_size": 1408,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "max_position_embeddings": 256,
    "tie_word_embeddings": True,
}


def write_base_dir(
    directory: Path,
    layers: int,
    shard_bytes: int = 128 * 2**20,
    shape: dict[str, Any] | None = None,
) -> int:
    """A pretrained-looking Llama directory (config + bf16 safetensors shards of random
    weights), written tensor by tensor without building the model; returns its params."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**(shape or SCALE_SHAPE), num_hidden_layers=layers)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in LlamaForCausalLM(config).state_dict().items()}
    shapes.pop("lm_head.weight", None)  # tied to the embeddings
    directory.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(directory))
    g = torch.Generator().manual_seed(layers)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size, weight_map, total = 0, {}, 0
    names = list(shapes)
    for i, name in enumerate(names):
        shape = shapes[name]
        t = (
            torch.ones(shape, dtype=torch.bfloat16)
            if name.endswith("norm.weight")
            else (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16)
        )
        shards[-1][name] = t
        size += t.numel() * 2
        total += t.numel()
        if size >= shard_bytes or i == len(names) - 1:
            fname = f"model-{len(shards):05d}.safetensors"
            save_file(shards[-1], str(directory / fname), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shards[-1], fname))
            shards[-1] = {}
            shards.append({})
            size = 0
    index = {"metadata": {"total_size": total * 2}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    return total


def scale(
    cap_gib: float,
    disk_gib: float,
    max_layers: int,
    console: Console,
    timeout_s: float = 900.0,
    start_layers: int = 4,
    shape: dict[str, Any] | None = None,
    dtype: str = "auto",
) -> dict[str, Any]:
    """The largest pretrained base each LoRA recipe loads and trains for two steps in a
    fresh process killed at the cap: ours with the disk tier, peft + torch in memory."""
    from benchmarks.scale import GIB, largest, trial_logger

    shape = shape or SCALE_SHAPE
    dtype = bench_dtype(dtype)
    results: dict[str, Any] = {}
    with (
        tempfile.TemporaryDirectory(prefix="pstar-bench-lora-") as disk_dir,
        tempfile.TemporaryDirectory(prefix="pstar-bench-lora-bases-") as bases,
    ):
        spec = {
            "hidden": shape["hidden_size"],
            "heads": shape["num_attention_heads"],
            "vocab": shape["vocab_size"],
            "seq": 64,
            "batch": 1,
            "steps": 2,
            "threads": max(1, os.cpu_count() or 1),
            "dtype": dtype,
            "cap_bytes": int(cap_gib * GIB),
            "disk_bytes": int(disk_gib * GIB),
            "disk_dir": disk_dir,
            "lora_r": LORA["r"],
            # ours: device (activations + the chunks in use) and host budgets of 1/4 of
            # the cap each; the rest of the cap is for what the budgets do not count
            # (imports, mapped shard pages, the tracer's profile of the warm-up) and the
            # rest of the model data goes to disk
            "device_bytes": int(cap_gib * GIB) // 4,
            "host_bytes": int(cap_gib * GIB) // 4,
        }
        written: dict[int, tuple[str, int]] = {}

        def prepare(trial: dict[str, Any]) -> dict[str, Any]:
            layers = trial["layers"]
            if layers not in written:  # written here, outside the capped trial
                d = Path(bases) / f"base-{layers}"
                written[layers] = (str(d), write_base_dir(d, layers, shape=shape))
            model_dir, params = written[layers]
            return {**trial, "model_dir": model_dir, "params": params}

        log = trial_logger(console)

        for system in (SCALE_PEFT, SCALE_OURS):
            results[system] = largest(
                {**spec, "system": system}, start_layers, max_layers, timeout_s, log, prepare
            )
    table = Table(
        title=f"largest pretrained base fine-tuned with LoRA under a {cap_gib:g} GiB cap per "
        f"process (Llama, hidden {shape['hidden_size']}), {dtype}; ours with a disk tier of "
        f"{disk_gib:g} GiB"
    )
    for col in ("recipe", "layers", "params", "peak RSS", "init peak", "first failure"):
        table.add_column(col, justify="right")
    for system, r in results.items():
        table.add_row(
            system,
            f"{r['layers']}{'+' if r['at_least'] else ''}",
            f"{r['params']:,}",
            f"{(r['peak_rss_bytes'] or 0) / GIB:.2f} GiB",
            "-" if r["init_peak_bytes"] is None else f"{r['init_peak_bytes'] / GIB:.2f} GiB",
            str(r["failure"] or "-")[:60],
        )
    console.print(table)
    ours, theirs = results[SCALE_OURS]["params"], results[SCALE_PEFT]["params"]
    return {
        "cap_bytes": spec["cap_bytes"],
        "disk_bytes": spec["disk_bytes"],
        "largest_params": {s: r["params"] for s, r in results.items()},
        "at_least": {s: r["at_least"] for s, r in results.items()},
        "scale_init_peak_bytes": {s: r["init_peak_bytes"] for s, r in results.items()},
        "scale_compute_dtype_seen": {s: r["compute_dtype_seen"] for s, r in results.items()},
        "ratio_scale_vs_peft": ours / theirs if theirs else float("nan"),
        "runs": {s: r["trials"] for s, r in results.items()},
    }


def run(
    model_dir: Path,
    rounds: int = 5,
    warmup: int = 2,
    batch: int = 2,
    seq: int = 128,
    cap_gib: float = 2.0,
    disk_gib: float = 6.0,
    max_layers: int = 512,
    json_out: bool = False,
    start_layers: int = 4,
    scale_shape: dict[str, Any] | None = None,
    dtype: str = "auto",
) -> dict[str, Any]:
    dtype = bench_dtype(dtype)
    console = Console()
    before = load_avg()
    part1 = step_and_memory(model_dir, rounds, warmup, batch, seq, console, dtype)
    gc.collect()
    part2 = scale(
        cap_gib,
        disk_gib,
        max_layers,
        console,
        start_layers=start_layers,
        shape=scale_shape,
        dtype=dtype,
    )
    result = {
        "benchmark": "lora",
        "model": model_dir.name,
        "lora": LORA,
        **part1,
        **{k: v for k, v in part2.items() if k != "runs"},
        "scale_runs": part2["runs"],
        **machine(dtype),
        "load_avg": {"before": before, "after": load_avg()},
        "bytes_per_param_lora": part1["bytes_per_param_lora"],
        "ratio_step_vs_peft": part1["ratio_step_vs_peft"],
        "ratio_scale_vs_peft": part2["ratio_scale_vs_peft"],
    }
    return finish(console, result, before, result["load_avg"]["after"], json_out)
