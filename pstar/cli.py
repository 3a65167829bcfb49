"""The `pstar` command line: train, plan, models, bench, and the service's serve, run,
files and jobs (`pstar/cli_service.py`). Progress and tables live here."""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from pstar.cli_bench import bench_app
from pstar.cli_service import register as register_service_commands
from pstar_core.config import ConfigError

app = typer.Typer(
    # a traceback's frame locals would print settings, the store's URL and password in them
    pretty_exceptions_show_locals=False,
    help="PatrickStar Service: chunk-based training of models larger than memory.",
)
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
    from service.spec.train import TrainSpec
    from service.worker.train_local import run_training

    logging.basicConfig(level=logging.WARNING)
    try:
        spec = TrainSpec.load(spec_path)
    except ConfigError as e:
        _fail(str(e))
    if steps is not None:
        spec = spec.model_copy(update={"train": spec.train.model_copy(update={"steps": steps})})
    if workers > 0:
        from service.worker.ray_train import run_ray

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
    gpu: Annotated[
        str, typer.Option(help="capacity plan: the GPU (v100, a100, h100) the step time is of")
    ] = "a100",
    gpu_memory: Annotated[
        float | None, typer.Option(help="GiB of each GPU (default: the --gpu's)")
    ] = None,
    tflops: Annotated[
        float | None, typer.Option(help="the GPU's dense fp16/bf16 peak (default: the --gpu's)")
    ] = None,
    gpu_efficiency: Annotated[
        float | None, typer.Option(help="share of the peak the model's matmuls reach (0.6)")
    ] = None,
    link_gbps: Annotated[
        float | None, typer.Option(help="host<->GPU GB/s each way (default: the --gpu's PCIe)")
    ] = None,
    collective_gbps: Annotated[
        float | None, typer.Option(help="a rank's all-gather GB/s (default: the --gpu's NVLink)")
    ] = None,
    host_adam_gparams: Annotated[
        float | None, typer.Option(help="the node's Adam on the host, billions of params/s (4)")
    ] = None,
    min_tflops: Annotated[
        float | None,
        typer.Option(help="with --largest: only models forecast at this many TFLOPS/GPU or more"),
    ] = None,
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
    lora: Annotated[
        bool, typer.Option("--lora", help="capacity plan: train LoRA adapters, the base frozen")
    ] = False,
    lora_r: Annotated[int, typer.Option(help="the adapters' rank, with --lora")] = 16,
    json_out: Annotated[bool, typer.Option("--json", help="print one JSON line last")] = False,
) -> None:
    """Chunk plan of a model, computed on the meta device (no memory is allocated); with
    --gpus (or --largest), the capacity plan for a node that need not be this one."""
    if gpus is not None or largest:
        speed = _speed(gpu, tflops, gpu_efficiency, link_gbps, collective_gbps, host_adam_gparams)
        if gpu_memory is None:
            from pstar_core.capacity import GPU_MEMORY_GIB

            gpu_memory = float(GPU_MEMORY_GIB[speed.name])
        if min_tflops is not None and (not largest or min_tflops <= 0):
            _fail("--min-tflops is a bar for --largest, and positive")
        _plan_capacity(
            model, gpus or 1, gpu_memory, host_memory, disk, batch, seq,
            activation_checkpointing, largest, json_out, lora_r if lora else None,
            speed, min_tflops,
        )  # fmt: skip
        return
    if model is None:
        _fail("name a model (a zoo name, or a HF config.json / model dir), or give --largest")
    from service.tools.planning import plan_model

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
    for row in result["spanning"]:
        console.print(f"{row['tensor']} is larger than a chunk: it spans {row['chunks']} chunks")
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
    capacity planner's calibration data (benchmarks/data/activation_calibration.json)."""
    from benchmarks.plan_check import calibrate

    err = calibrate()
    console.print(
        f"activation model vs {err['points']} measured steps: median error "
        f"{err['median']:.1%}, largest {err['max']:.1%}"
    )
    print(json.dumps(err))


def _speed(
    gpu: str,
    tflops: float | None,
    efficiency: float | None,
    link: float | None,
    collective: float | None,
    host_adam: float | None,
):
    """The `--gpu` preset's figures, with those given on the command line instead."""
    from dataclasses import replace

    from pstar_core.capacity import GPUS

    if gpu not in GPUS:
        _fail(f"--gpu must be one of {', '.join(GPUS)}, got {gpu!r}")
    given = {
        "peak_tflops": tflops,
        "efficiency": efficiency,
        "link_gbps": link,
        "collective_gbps": collective,
        "host_adam_gparams": host_adam,
    }
    bad = [k for k, v in given.items() if v is not None and v <= 0]
    if bad or (efficiency is not None and efficiency > 1):
        _fail("the speed figures must be positive, and --gpu-efficiency at most 1")
    return replace(GPUS[gpu], **{k: v for k, v in given.items() if v is not None})


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
    lora_r: int | None,
    speed,
    min_tflops: float | None,
) -> None:
    from pstar_core import capacity as cap
    from pstar_core.config import LoraConfig

    if gpus < 1 or gpu_memory <= 0 or host_memory <= 0 or disk < 0 or batch < 1:
        _fail("--gpus and --batch must be at least 1, the memories positive and --disk >= 0")
    if lora_r is not None and lora_r < 1:
        _fail("--lora-r must be at least 1")
    lora = LoraConfig(r=lora_r) if lora_r is not None else None
    hw = cap.node(gpus, gpu_memory, host_memory, disk, speed)
    work = cap.Workload(batch=batch, seq=seq, activation_checkpointing=checkpointing)
    node = (
        f"{gpus} x {gpu_memory:g} GiB GPU, {host_memory:g} GiB host, {disk:g} GiB disk "
        f"({speed.name}: {speed.peak_tflops:g} TFLOPS x {speed.efficiency:g}, link "
        f"{speed.link_gbps:g} GB/s, host Adam {speed.host_adam_gparams:g} G params/s)"
    )
    if find_largest:
        result = cap.largest(hw, work, lora=lora, min_tflops=min_tflops)
        bar = f" at {min_tflops:g} TFLOPS per GPU or more" if min_tflops else ""
        console.print(
            f"largest that fits {node}{bar}: [bold]{result['largest_model']}[/bold] "
            f"({result['params'] / 1e9:.2f}B parameters)"
        )
        if result["plan"]:
            p = result["plan"]
            console.print(
                f"its step: {p['step_seconds']:.2f} s forecast ({p['compute_seconds']:.2f} s "
                f"with copies free), {p['tflops_per_gpu']:.0f} TFLOPS per GPU"
            )
        if result["next_model"]:
            console.print(f"{result['next_model']} does not: {result['next_why']}")
        if json_out:
            print(json.dumps(result))
        return
    if model is None:
        _fail("name a zoo model, or give --largest")
    try:
        p = cap.plan_capacity(model, hw, work, lora)
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
        "benchmarks/plan_check.py); GPU margin "
        f"{p.gpu_margin_bytes / gib:.2f} GiB holds {p.os_chunks_on_gpu} of "
        f"{p.os_chunks} optimizer-state chunks\n"
        f"an iteration: GPU peak {p.device_peak_bytes / gib:.1f} GiB (it runs in "
        f"{p.least_device_bytes / gib:.1f} GiB at least), host peak "
        f"{p.host_peak_bytes / gib:.1f} GiB; moves {p.host_to_device_bytes_per_iter / gib:.1f} "
        f"GiB host->GPU and {p.device_to_host_bytes_per_iter / gib:.1f} GiB GPU->host, "
        f"{p.collective_bytes_per_iter / gib:.1f} GiB in collectives"
    )
    console.print(
        f"a step: {p.step_seconds:.2f} s forecast ({p.compute_seconds:.2f} s of compute "
        f"and host Adam beside backward, the rest copies and collectives not hidden), "
        f"[bold]{p.tflops_per_gpu:.0f} TFLOPS per GPU[/bold] (model FLOPs, recompute "
        "counted)"
    )
    verdict = "[green]fits[/green]" if p.fits else f"[red]does not fit[/red]: {p.why}"
    console.print(f"{verdict} (the paper's rule: {'fits' if p.fits_paper_rule else 'does not'})")
    out = p.to_json()
    if not p.fits:

        def plan_for(o: cap.Options) -> cap.RankPlan:
            w = cap.Workload(batch=o.batch, seq=seq, activation_checkpointing=o.checkpointing)
            h = dataclasses.replace(hw, gpus=o.workers)
            return cap.plan_capacity(model, h, w, lora or (LoraConfig() if o.lora else None))

        now = cap.Options(gpus, batch, checkpointing, lora is not None)
        out["smallest_change"] = change = cap.smallest_change(plan_for, now, max_workers=64)
        if change:
            others = "; ".join(a["text"] for a in change["alternatives"])
            console.print(f"smallest change that fits: {change['text']}" + (
                f" (also: {others})" if others else ""))  # fmt: skip
        else:
            console.print("no single change fits (more GPUs, checkpointing, batch, LoRA)")
    if json_out:
        print(json.dumps(out))


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


@app.command("plot-trace")
def plot_trace_cmd(
    run_dir: Annotated[Path, typer.Argument(help="a run directory written by pstar train")],
    out: Annotated[Path | None, typer.Option(help="PNG path (default RUN_DIR/trace.png)")] = None,
) -> None:
    """Plot the warm-up memory trace of a run (non-model, chunk bytes, budget per moment)."""
    from service.tools.plot_trace import plot_run_dir

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
