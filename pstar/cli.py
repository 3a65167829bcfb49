"""The `pstar` command line: train, plan, models, bench, and the service's serve, run,
files and jobs (`pstar/cli_service.py`). Progress and tables live here."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from pstar.cli_service import register as register_service_commands
from pstar_core.config import ConfigError

app = typer.Typer(help="PatrickStar Service: chunk-based training of models larger than memory.")
bench_app = typer.Typer(help="Measured claims; each prints a table and, last, one JSON line.")
app.add_typer(bench_app, name="bench")
console = Console()


def _fail(msg: str) -> None:
    console.print(f"[red]error:[/red] {msg}")
    raise typer.Exit(2)


@app.command()
def train(
    spec_path: Annotated[Path, typer.Argument(help="a job spec YAML (see examples/)")],
    steps: Annotated[int | None, typer.Option(help="override train.steps")] = None,
    workers: Annotated[
        int, typer.Option(help="Ray Train workers (chunk ZeRO across them); 0: in this process")
    ] = 0,
    max_failures: Annotated[int, typer.Option(help="worker-group restarts Ray may do")] = 2,
    gpu: Annotated[bool, typer.Option(help="one GPU per Ray worker, NCCL between them")] = False,
    cpus_per_worker: Annotated[float, typer.Option(help="CPUs per Ray worker")] = 1.0,
) -> None:
    """Train a model as the spec says, locally or on Ray Train workers."""
    from service.spec import TrainSpec
    from service.train_local import run_training

    logging.basicConfig(level=logging.WARNING)
    try:
        spec = TrainSpec.load(spec_path)
    except ConfigError as e:
        _fail(str(e))
    if steps is not None:
        spec = spec.model_copy(update={"train": spec.train.model_copy(update={"steps": steps})})
    if workers > 0:
        from service.ray_train import run_ray

        try:
            result = run_ray(
                spec,
                workers,
                max_failures,
                phase=console.print,
                use_gpu=gpu,
                cpus_per_worker=cpus_per_worker,
            )
        except ConfigError as e:
            _fail(str(e))
        if result["error"]:
            _fail(f"training failed: {result['error']}")
        m = result["metrics"]
        console.print(
            f"step {m.get('step')}: loss {m.get('train_loss', float('nan')):.3f}, "
            f"{m.get('tokens_per_second', 0):.0f} tok/s; checkpoint {result['checkpoint']}"
        )
        return
    progress = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
    )
    task = progress.add_task("training", total=spec.train.steps, info="")

    def on_step(step: int, m: dict) -> None:
        info = f"loss {m['train_loss']:.3f}  {m['tokens_per_second']:.0f} tok/s  lr {m['lr']:.2e}"
        progress.update(task, completed=step, info=info)

    def on_phase(msg: str) -> None:
        progress.console.print(f"[dim]{time.strftime('%H:%M:%S')}[/dim] {msg}")

    try:
        with progress:
            summary = run_training(spec, on_step=on_step, on_phase=on_phase)
    except ConfigError as e:
        _fail(str(e))
    before, after = summary["heldout_ppl_before"], summary["heldout_ppl_after"]
    console.print(
        f"held-out perplexity {'(resumed)' if before is None else f'{before:.2f}'} -> "
        f"{after:.2f}; checkpoint {summary['checkpoint']}"
    )


@app.command()
def plan(
    model: Annotated[
        str | None, typer.Argument(help="a zoo name, or a HF config.json / model dir")
    ] = None,
    dtype: Annotated[
        str, typer.Option(help="auto (what this machine computes fast), fp32, bf16 or fp16")
    ] = "auto",
    chunk_size: Annotated[str, typer.Option(help="elements per chunk, or auto")] = "auto",
    nproc: Annotated[int, typer.Option(help="ZeRO ranks the chunks are sharded over")] = 1,
    gpus: Annotated[
        int | None, typer.Option(help="capacity plan: GPUs of one node (one rank each)")
    ] = None,
    gpu_memory: Annotated[float, typer.Option(help="GiB of each GPU")] = 40.0,
    host_memory: Annotated[float, typer.Option(help="GiB of the node's host memory")] = 256.0,
    disk: Annotated[float, typer.Option(help="GiB of the node's spill disk")] = 0.0,
    batch: Annotated[int, typer.Option(help="sequences per GPU per step")] = 8,
    seq: Annotated[int | None, typer.Option(help="tokens per sequence (default: model's)")] = None,
    activation_checkpointing: Annotated[
        bool, typer.Option(help="recompute blocks in backward (as the paper's runs)")
    ] = True,
    largest: Annotated[
        bool, typer.Option("--largest", help="the largest of the paper's GPT family that fits")
    ] = False,
    json_out: Annotated[bool, typer.Option("--json", help="print one JSON line last")] = False,
) -> None:
    """Chunk plan of a model, computed on the meta device (no memory is allocated); with
    --gpus (or --largest), the capacity plan for a node that need not be this one."""
    if gpus is not None or largest:
        _plan_capacity(
            model, gpus or 1, gpu_memory, host_memory, disk, batch, seq,
            activation_checkpointing, largest, json_out,
        )  # fmt: skip
        return
    if model is None:
        _fail("name a model (a zoo name, or a HF config.json / model dir), or give --largest")
    from service.planning import plan_model

    try:
        result = plan_model(model, dtype, chunk_size, nproc)
    except (ConfigError, ValueError, OSError) as e:
        _fail(str(e))
    table = Table(title=f"chunk plan: {model} ({result['dtype']})")
    for col in ("list", "chunks", "GiB", "utilization"):
        table.add_column(col, justify="right" if col != "list" else "left")
    for name, row in result["lists"].items():
        if row["chunks"]:
            table.add_row(
                name, str(row["chunks"]), f"{row['bytes'] / 2**30:.3f}", f"{row['utilization']:.1%}"
            )
    console.print(table)
    if nproc > 1:
        ranks = Table(title=f"per rank with chunk ZeRO over {nproc} ranks (padding included)")
        for col in ("rank", "chunks", "chunk GiB", "model data GiB", "share of model data"):
            ranks.add_column(col, justify="right")
        total = max(1, result["model_data_bytes"])
        for r, row in enumerate(result["per_rank"]):
            ranks.add_row(
                str(r),
                str(row["chunks"]),
                f"{row['chunk_bytes'] / 2**30:.3f}",
                f"{row['model_data_bytes'] / 2**30:.3f}",
                f"{row['model_data_bytes'] / total:.1%}",
            )
        console.print(ranks)
    console.print(
        f"params {result['params']:,} ({result['trainable_params']:,} trainable); "
        f"chunk size {result['chunk_size']:,} elements; utilization {result['utilization']:.1%}; "
        f"model data {result['model_data_bytes'] / 2**30:.2f} GiB "
        f"({result['model_data_bytes'] / max(1, result['params']):.1f} B/param); "
        f"planned in {result['plan_s']:.2f} s"
    )
    if json_out:
        print(json.dumps(result))


@app.command("calibrate-activations")
def calibrate_activations() -> None:
    """Measure the tracer's non-model peak of zoo GPT steps on this machine and rewrite the
    capacity planner's calibration data (pstar_core/data/activation_calibration.json)."""
    from pstar_core.plan_check import calibrate

    err = calibrate()
    console.print(
        f"activation model vs {err['points']} measured steps: median error "
        f"{err['median']:.1%}, largest {err['max']:.1%}"
    )
    print(json.dumps(err))


def _plan_capacity(
    model: str | None,
    gpus: int,
    gpu_memory: float,
    host_memory: float,
    disk: float,
    batch: int,
    seq: int | None,
    checkpointing: bool,
    find_largest: bool,
    json_out: bool,
) -> None:
    from pstar_core import capacity as cap

    if gpus < 1 or gpu_memory <= 0 or host_memory <= 0 or disk < 0 or batch < 1:
        _fail("--gpus and --batch must be at least 1, the memories positive and --disk >= 0")
    hw = cap.Hardware(gpus, int(gpu_memory * cap.GiB), int(host_memory * cap.GiB),
                      int(disk * cap.GiB))  # fmt: skip
    work = cap.Workload(batch=batch, seq=seq, activation_checkpointing=checkpointing)
    node = f"{gpus} x {gpu_memory:g} GiB GPU, {host_memory:g} GiB host, {disk:g} GiB disk"
    if find_largest:
        result = cap.largest(hw, work)
        console.print(
            f"largest that fits {node}: [bold]{result['largest_model']}[/bold] "
            f"({result['params'] / 1e9:.2f}B parameters)"
        )
        if result["next_model"]:
            console.print(f"{result['next_model']} does not: {result['next_why']}")
        if json_out:
            print(json.dumps(result))
        return
    if model is None:
        _fail("name a zoo model, or give --largest")
    try:
        p = cap.plan_capacity(model, hw, work)
    except (ConfigError, ValueError) as e:
        _fail(str(e))
    table = Table(title=f"{model} ({p.params / 1e9:.2f}B) on {node}: one rank at start")
    for col in ("list", "GiB", "host", "device", "disk", "over"):
        table.add_column(col, justify="right" if col != "list" else "left")
    for name, row in p.at_start.items():
        table.add_row(
            name,
            f"{p.lists[name] / cap.GiB:.2f}",
            *(f"{row.get(t, 0) / cap.GiB:.2f}" for t in ("host", "device", "disk", "over")),
        )
    console.print(table)
    gib = cap.GiB
    console.print(
        f"chunk {p.chunk_size:,} elements ({p.utilization:.1%} used); non-model peak "
        f"{p.non_model_peak_bytes / gib:.2f} GiB (activation model calibrated on the tracer: "
        "pstar_core/plan_check.py); GPU margin "
        f"{p.gpu_margin_bytes / gib:.2f} GiB holds {p.os_chunks_on_gpu} of "
        f"{p.os_chunks} optimizer-state chunks\n"
        f"an iteration: GPU peak {p.device_peak_bytes / gib:.1f} GiB (it runs in "
        f"{p.least_device_bytes / gib:.1f} GiB at least), host peak "
        f"{p.host_peak_bytes / gib:.1f} GiB; moves {p.host_to_device_bytes_per_iter / gib:.1f} "
        f"GiB host->GPU and {p.device_to_host_bytes_per_iter / gib:.1f} GiB GPU->host, "
        f"{p.collective_bytes_per_iter / gib:.1f} GiB in collectives"
    )
    verdict = "[green]fits[/green]" if p.fits else f"[red]does not fit[/red]: {p.why}"
    console.print(f"{verdict} (the paper's rule: {'fits' if p.fits_paper_rule else 'does not'})")
    if json_out:
        print(json.dumps(p.to_json()))


@app.command()
def doctor(
    gpu: Annotated[
        bool, typer.Option("--gpu", help="the GPU acceptance run (the only doctor so far)")
    ] = False,
    device: Annotated[
        str, typer.Option(help="device to check; 'cpu' runs the script's own code paths")
    ] = "cuda",
    json_out: Annotated[bool, typer.Option("--json", help="print one JSON line last")] = True,
) -> None:
    """Check the GPU paths on this machine: placement, CPU parity, tracer, budget, pinned
    pool, copy/compute overlap, Adam, NCCL. Exit 0 all passed, 1 one failed, 2 no GPU."""
    if not gpu:
        _fail("say --gpu: `pstar doctor --gpu` is the GPU acceptance run")
    from benchmarks.doctor import run as run_doctor

    result = run_doctor(device=device, json_out=json_out)
    if result.get("error"):
        raise typer.Exit(2)
    if result["failed"]:
        raise typer.Exit(1)


@app.command()
def kernels(
    threads: Annotated[
        list[int] | None,
        typer.Option(help="thread counts to measure at (default: 1 and this process's)"),
    ] = None,
    json_out: Annotated[bool, typer.Option("--json", help="print one JSON line last")] = False,
) -> None:
    """Build the AdamW kernel for this CPU and choose the faster host kernel (ours or
    torch's fused) per chunk dtype and thread count, once per CPU type: set-up and the
    image build run it, so no job compiles or measures inside its first step."""
    from pstar_core.kernels.adam import prepare

    result = prepare(threads)
    built = f"built in {result['build_s']:.1f} s" if result["built"] else "could not be built"
    table = Table(title=f"host AdamW on this CPU ({result['capability']}): C++ kernel {built}")
    for col in ("chunks / threads", "C++ G elem/s", "fused G elem/s", "default"):
        table.add_column(col, justify="right" if col != "chunks / threads" else "left")
    for key, entry in result["choices"].items():
        rates = entry["elems_per_s"]
        cpp = f"{rates['cpp'] / 1e9:.2f}" if "cpp" in rates else "-"
        table.add_row(key, cpp, f"{rates['fused'] / 1e9:.2f}", entry["backend"])
    console.print(table)
    console.print(f"kept in {result['path']}")
    if json_out:
        print(json.dumps(result))


@app.command()
def models() -> None:
    """The model zoo with real parameter counts."""
    from pstar_core.models import list_models

    table = Table(title="model zoo")
    for col in ("name", "layers", "hidden", "heads", "vocab", "seq", "params"):
        table.add_column(col, justify="left" if col == "name" else "right")
    for name, cfg, n in list_models():
        size = f"{n / 1e9:.3f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"
        cols = (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.vocab_size, cfg.seq_len)
        table.add_row(name, *map(str, cols), size)
    console.print(table)


_DTYPE_HELP = (
    "auto (what the engine picks on this CPU), fp32, bf16 or fp16: the engine's and every "
    "peer's dtype"
)


@bench_app.command("adam")
def bench_adam(
    numel: Annotated[int, typer.Option(help="elements updated per run")] = 100_000_000,
    repeats: Annotated[int, typer.Option(help="interleaved rounds of every variant")] = 7,
    threads: Annotated[
        list[str] | None,
        typer.Option(help="thread counts, repeatable or comma-separated (default: 1,N)"),
    ] = None,
    dtype: Annotated[
        str, typer.Option(help="the engine's dtype here (its chunks are the headline)")
    ] = "auto",
    json_out: Annotated[bool, typer.Option("--json", help="print one JSON line last")] = False,
) -> None:
    """The engine's host AdamW kernels (ours vs torch's fused, as the engine calls them)
    per chunk dtype and thread count, and torch's AdamW(fused) as a reference."""
    from benchmarks.adam import run

    try:
        run(numel=numel, repeats=repeats, threads=threads, dtype=dtype, json_out=json_out)
    except ValueError as e:
        _fail(str(e))


@bench_app.command("precision")
def bench_precision(
    model: Annotated[str, typer.Option(help="zoo model")] = "gpt-small",
    batch: Annotated[int, typer.Option(help="sequences per step")] = 2,
    seq: Annotated[int, typer.Option(help="tokens per sequence")] = 128,
    steps: Annotated[int, typer.Option(help="timed steps of each dtype")] = 3,
    warmup: Annotated[int, typer.Option(help="untimed steps first")] = 1,
    json_out: Annotated[bool, typer.Option("--json", help="print one JSON line last")] = False,
) -> None:
    """Step time with dtype bf16 vs fp32 vs auto, interleaved; what auto picked here and
    auto_vs_best (its time over the faster fixed choice's)."""
    from benchmarks.precision import run

    run(model=model, batch=batch, seq=seq, steps=steps, warmup=warmup, json_out=json_out)


@bench_app.command("overhead")
def bench_overhead(
    model: Annotated[str, typer.Option(help="zoo model")] = "gpt-100m",
    steps: Annotated[int, typer.Option(help="timed steps per side")] = 5,
    warmup: Annotated[int, typer.Option(help="untimed steps per side first")] = 2,
    batch: Annotated[int, typer.Option(help="sequences per step")] = 1,
    seq: Annotated[int, typer.Option(help="tokens per sequence")] = 320,
    dtype: Annotated[str, typer.Option(help=_DTYPE_HELP)] = "auto",
    json_out: Annotated[bool, typer.Option("--json", help="print one JSON line last")] = False,
) -> None:
    """Engine step time / plain PyTorch step time (same dtype), runs interleaved."""
    from benchmarks.overhead import run

    try:
        run(
            model=model, steps=steps, warmup=warmup, batch=batch, seq=seq, dtype=dtype,
            json_out=json_out,
        )  # fmt: skip
    except ValueError as e:
        _fail(str(e))


@bench_app.command("load")
def bench_load(
    model_dir: Annotated[Path, typer.Argument(help="a HF model directory")] = Path(
        ".cache/models/SmolLM2-135M-Instruct"
    ),
    dtype: Annotated[str, typer.Option(help=_DTYPE_HELP)] = "auto",
    repeats: Annotated[int, typer.Option(help="interleaved loads of each loader")] = 2,
    json_out: Annotated[bool, typer.Option("--json", help="print one JSON line last")] = False,
) -> None:
    """Peak host memory and time of loading a pretrained directory: ours vs transformers."""
    from benchmarks.load import run

    if not (model_dir / "config.json").is_file():
        _fail(f"{model_dir} is not a HF model directory (run scripts/setup.sh for SmolLM2)")
    try:
        run(model_dir, dtype=dtype, repeats=repeats, json_out=json_out)
    except ValueError as e:
        _fail(str(e))


@bench_app.command("eviction")
def bench_eviction(
    model: Annotated[str, typer.Option(help="zoo model")] = "gpt-small",
    layers: Annotated[int, typer.Option(help="override the model's layer count")] = 8,
    vocab: Annotated[
        int, typer.Option(help="vocabulary override (0 keeps the model's), so chunks can be small")
    ] = 1024,
    batch: Annotated[int, typer.Option(help="sequences per iteration")] = 4,
    seq: Annotated[int, typer.Option(help="tokens per sequence")] = 128,
    chunk_size: Annotated[
        int | None, typer.Option(help="elements per chunk (default: ~12-20 param chunks)")
    ] = None,
    iters: Annotated[int, typer.Option(help="iterations per run (>= 3; 3+ are measured)")] = 4,
    disk: Annotated[
        bool,
        typer.Option(
            "--disk", help="instead: model data spilled to disk, step time prefetch off vs on"
        ),
    ] = False,
    trials: Annotated[int, typer.Option(help="--disk: interleaved off/on pairs")] = 3,
    dtype: Annotated[str, typer.Option(help=_DTYPE_HELP)] = "auto",
    json_out: Annotated[bool, typer.Option("--json", help="print one JSON line last")] = False,
) -> None:
    """Bytes moved host<->device per iteration: eviction policies opt/lru/static vs budgets
    (or, with --disk, the step time with the disk tier, prefetch off vs on)."""
    from benchmarks.dmm import run_disk_prefetch, run_eviction

    try:
        if disk:
            run_disk_prefetch(
                model=model, layers=layers, batch=batch, seq=seq, chunk_size=chunk_size,
                iters=max(iters, 5), trials=trials, json_out=json_out, vocab=vocab or None,
                dtype=dtype,
            )  # fmt: skip
            return
        run_eviction(
            model=model, layers=layers, batch=batch, seq=seq, chunk_size=chunk_size,
            iters=iters, json_out=json_out, vocab=vocab or None, dtype=dtype,
        )  # fmt: skip
    except (ConfigError, ValueError) as e:
        _fail(str(e))


@bench_app.command("scale")
def bench_scale(
    cap_gib: Annotated[float, typer.Option(help="memory cap per trial process, GiB")] = 2.0,
    disk_gib: Annotated[float, typer.Option(help="disk tier for ours_disk, GiB")] = 16.0,
    hidden: Annotated[int, typer.Option(help="hidden size (fixed; layers are grown)")] = 512,
    seq: Annotated[int, typer.Option(help="tokens per sequence")] = 64,
    batch: Annotated[int, typer.Option(help="sequences per step")] = 1,
    steps: Annotated[int, typer.Option(help="training steps per trial (>= 2)")] = 2,
    start_layers: Annotated[int, typer.Option(help="layers of the first trial")] = 4,
    max_layers: Annotated[int, typer.Option(help="the most layers tried")] = 128,
    systems: Annotated[
        str, typer.Option(help="comma-separated: ours, ours_disk, deepspeed, fsdp2")
    ] = "ours,ours_disk,deepspeed,fsdp2",
    dtype: Annotated[str, typer.Option(help=_DTYPE_HELP)] = "auto",
    json_out: Annotated[bool, typer.Option("--json", help="print one JSON line last")] = False,
) -> None:
    """Largest GPT each system trains under one memory cap: ours (host; host + disk),
    DeepSpeed ZeRO-3 CPU offload, FSDP2 CPU offload, each really run."""
    from benchmarks.scale import run_scale

    try:
        run_scale(
            cap_gib=cap_gib, disk_gib=disk_gib, hidden=hidden, seq=seq, batch=batch,
            steps=steps, start_layers=start_layers, max_layers=max_layers,
            systems=tuple(x.strip() for x in systems.split(",") if x.strip()),
            dtype=dtype, json_out=json_out,
        )  # fmt: skip
    except ValueError as e:
        _fail(str(e))


@bench_app.command("zero")
def bench_zero(
    model: Annotated[str, typer.Option(help="zoo model")] = "gpt-45m",
    global_batch: Annotated[int, typer.Option(help="sequences per step over all ranks")] = 4,
    seq: Annotated[int, typer.Option(help="tokens per sequence")] = 256,
    steps: Annotated[int, typer.Option(help="timed steps per run")] = 4,
    warmup: Annotated[int, typer.Option(help="untimed steps first")] = 1,
    peers: Annotated[bool, typer.Option(help="also run FSDP2 and DeepSpeed ZeRO-3")] = True,
    chunk_size: Annotated[
        int | None, typer.Option(help="elements per chunk for ours (default: auto)")
    ] = None,
    dtype: Annotated[str, typer.Option(help=_DTYPE_HELP)] = "auto",
    json_out: Annotated[bool, typer.Option("--json", help="print one JSON line last")] = False,
) -> None:
    """Chunk ZeRO-DP step time and bytes sent: ours 1/2 ranks vs FSDP2, DeepSpeed (CPU, gloo)."""
    from benchmarks.zero import run_zero

    try:
        run_zero(
            model=model, global_batch=global_batch, seq=seq, steps=steps, warmup=warmup,
            json_out=json_out, peers=peers, chunk_size=chunk_size, dtype=dtype,
        )  # fmt: skip
    except (ValueError, RuntimeError) as e:
        _fail(str(e))


@bench_app.command("collectives")
def bench_collectives(
    model: Annotated[str, typer.Option(help="zoo model whose params are gathered")] = "gpt-45m",
    repeats: Annotated[int, typer.Option(help="interleaved rounds of each pattern")] = 5,
    dtype: Annotated[
        str, typer.Option(help="dtype of the gathered params: " + _DTYPE_HELP)
    ] = "auto",
    json_out: Annotated[bool, typer.Option("--json", help="print one JSON line last")] = False,
) -> None:
    """All-gather throughput: engine-sized chunks vs one all-gather per parameter tensor."""
    from benchmarks.zero import run_collectives

    try:
        run_collectives(model=model, repeats=repeats, dtype=dtype, json_out=json_out)
    except (ValueError, RuntimeError) as e:
        _fail(str(e))


@bench_app.command("lora")
def bench_lora(
    model_dir: Annotated[Path, typer.Argument(help="a HF model directory")] = Path(
        ".cache/models/SmolLM2-135M-Instruct"
    ),
    rounds: Annotated[int, typer.Option(help="timed interleaved rounds")] = 5,
    batch: Annotated[int, typer.Option(help="sequences per step")] = 2,
    seq: Annotated[int, typer.Option(help="tokens per sequence")] = 128,
    cap_gib: Annotated[float, typer.Option(help="memory cap per scale trial process")] = 2.0,
    disk_gib: Annotated[float, typer.Option(help="the engine's disk tier in scale trials")] = 6.0,
    max_layers: Annotated[int, typer.Option(help="deepest base tried in the scale part")] = 512,
    dtype: Annotated[str, typer.Option(help=_DTYPE_HELP)] = "auto",
    json_out: Annotated[bool, typer.Option("--json", help="print one JSON line last")] = False,
) -> None:
    """LoRA: step and model data vs full fine-tuning and peft + torch; largest base per cap."""
    from benchmarks.lora import run

    if not (model_dir / "config.json").is_file():
        _fail(f"{model_dir} is not a HF model directory (run scripts/setup.sh for SmolLM2)")
    try:
        run(
            model_dir, rounds=rounds, batch=batch, seq=seq, cap_gib=cap_gib, disk_gib=disk_gib,
            max_layers=max_layers, dtype=dtype, json_out=json_out,
        )  # fmt: skip
    except ValueError as e:
        _fail(str(e))


@bench_app.command("serve")
def bench_serve(
    model_dir: Annotated[Path, typer.Argument(help="a HF model directory")] = Path(
        ".cache/models/SmolLM2-135M-Instruct"
    ),
    concurrency: Annotated[str, typer.Option(help="comma-separated stream counts")] = "1,4,16",
    max_tokens: Annotated[int, typer.Option(help="tokens each stream asks for")] = 32,
    rounds: Annotated[int, typer.Option(help="interleaved rounds of every case")] = 3,
    adapters: Annotated[int, typer.Option(help="LoRA adapters on the shared base")] = 8,
    json_out: Annotated[bool, typer.Option("--json", help="print one JSON line last")] = False,
) -> None:
    """Serving: time to first token and tokens/s through the API and Ray Serve, for the
    base, one LoRA adapter and N adapters on one base, against transformers' generate."""
    from benchmarks.serve import run

    if not (model_dir / "config.json").is_file():
        _fail(f"{model_dir} is not a HF model directory (run scripts/setup.sh for SmolLM2)")
    try:
        levels = tuple(int(x) for x in concurrency.split(",") if x.strip())
    except ValueError:
        _fail(f"--concurrency must be comma-separated whole numbers, got {concurrency!r}")
    if not levels or min(levels) < 1 or adapters < 1 or rounds < 1 or max_tokens < 1:
        _fail("--concurrency, --adapters, --rounds and --max-tokens must be at least 1")
    run(
        model_dir, concurrency=levels, max_tokens=max_tokens, rounds=rounds,
        adapters=adapters, json_out=json_out,
    )  # fmt: skip


@bench_app.command("packing")
def bench_packing(
    model_dir: Annotated[Path, typer.Argument(help="a HF model directory")] = Path(
        ".cache/models/SmolLM2-135M-Instruct"
    ),
    data: Annotated[Path, typer.Option(help="chat or completion JSONL")] = Path(
        ".cache/data/wordnet-train.jsonl"
    ),
    steps: Annotated[int, typer.Option(help="timed steps per layout, interleaved")] = 20,
    batch: Annotated[int, typer.Option(help="rows per step (the main job's batch)")] = 8,
    seq_len: Annotated[
        int | None, typer.Option(help="row length; default: as a job's auto")
    ] = None,
    check_examples: Annotated[
        int, typer.Option(help="examples whose packed loss is checked against alone")
    ] = 32,
    dtype: Annotated[str, typer.Option(help=_DTYPE_HELP)] = "auto",
    json_out: Annotated[bool, typer.Option("--json", help="print one JSON line last")] = False,
) -> None:
    """Packing: the main job's data packed vs one example per row, trained tokens per second."""
    from benchmarks.packing import run

    if not (model_dir / "config.json").is_file():
        _fail(f"{model_dir} is not a HF model directory (run scripts/setup.sh for SmolLM2)")
    if not data.is_file():
        _fail(f"{data} does not exist (scripts/setup.sh writes the WordNet data)")
    try:
        run(
            model_dir, data, steps=steps, batch=batch, seq_len=seq_len, dtype=dtype,
            check_examples=check_examples, json_out=json_out,
        )  # fmt: skip
    except ValueError as e:
        _fail(str(e))


@bench_app.command("api")
def bench_api(
    seconds: Annotated[
        float, typer.Option(help="paced seconds per database (split over the rounds)")
    ] = 20.0,
    clients: Annotated[int, typer.Option(help="concurrent clients, one connection each")] = 50,
    db: Annotated[str, typer.Option(help="sqlite, postgres or both")] = "both",
    rate: Annotated[float, typer.Option(help="offered req/s of the paced run, in all")] = 100.0,
    saturation_seconds: Annotated[
        float, typer.Option(help="closed-loop seconds per database (0: none)")
    ] = 10.0,
    rounds: Annotated[int, typer.Option(help="interleaved segments per database")] = 2,
    reconcile_interval: Annotated[
        float, typer.Option(help="the server's reconciler interval, s (0: no reconciler)")
    ] = 1.0,
    profile: Annotated[
        Path | None, typer.Option(help="record the server with py-spy into this directory")
    ] = None,
    json_out: Annotated[bool, typer.Option("--json", help="print one JSON line last")] = False,
) -> None:
    """Job create/get/list p50/p99 and req/s at N clients over loopback; lost creates."""
    from benchmarks.api import run

    try:
        run(
            seconds=seconds, clients=clients, db=db, rate=rate,
            saturation_seconds=saturation_seconds, rounds=rounds, json_out=json_out,
            reconcile_interval_s=reconcile_interval, profile_dir=profile,
        )  # fmt: skip
    except (ValueError, RuntimeError) as e:
        _fail(str(e))


@bench_app.command("faults")
def bench_faults(
    jobs: Annotated[
        int,
        typer.Option(
            help="fine-tuning jobs per database (each a driver, a controller and a worker)"
        ),
    ] = 2,
    steps: Annotated[
        int, typer.Option(help="training steps per job: long enough for the faults to land")
    ] = 600,
    faults: Annotated[int, typer.Option(help="faults injected per database")] = 6,
    db: Annotated[str, typer.Option(help="sqlite, postgres or both")] = "both",
    outage: Annotated[
        float, typer.Option(help="seconds the store is down in a 'store' fault (PostgreSQL)")
    ] = 30.0,
    seed: Annotated[int, typer.Option(help="seed of the fault schedule")] = 0,
    timeout: Annotated[float, typer.Option(help="seconds per database before giving up")] = 1200.0,
    kinds: Annotated[
        str, typer.Option(help="comma-separated fault kinds: control-plane, driver, store")
    ] = "control-plane,driver,store",
    json_out: Annotated[bool, typer.Option("--json", help="print one JSON line last")] = False,
) -> None:
    """Jobs under random SIGKILLs of the control plane and drivers, and store outages:
    lost, duplicated and wrong-state jobs, and the API's p99 meanwhile."""
    from benchmarks.faults import run

    try:
        run(
            jobs=jobs, steps=steps, faults=faults, db=db, outage_s=outage, seed=seed,
            timeout_s=timeout, kinds=tuple(k.strip() for k in kinds.split(",") if k.strip()),
            json_out=json_out,
        )  # fmt: skip
    except (ValueError, RuntimeError) as e:
        _fail(str(e))


@app.command("plot-trace")
def plot_trace_cmd(
    run_dir: Annotated[Path, typer.Argument(help="a run directory written by pstar train")],
    out: Annotated[Path | None, typer.Option(help="PNG path (default RUN_DIR/trace.png)")] = None,
) -> None:
    """Plot the warm-up memory trace of a run (non-model, chunk bytes, budget per moment)."""
    from service.plot_trace import plot_run_dir

    try:
        path = plot_run_dir(run_dir, out)
    except (FileNotFoundError, ValueError) as e:
        _fail(str(e))
    console.print(f"wrote {path}")


register_service_commands(app)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
