"""`pstar bench ...`: the measured claims. Each benchmark prints a readable table and,
last, one JSON line (with --json); the work is in `benchmarks/`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from pstar_core.config import ConfigError

bench_app = typer.Typer(
    pretty_exceptions_show_locals=False,
    help="Measured claims; each prints a table and, last, one JSON line.",
)
console = Console()


def _fail(msg: str) -> None:
    console.print(f"[red]error:[/red] {msg}")
    raise typer.Exit(2)


def _need_hf_dir(model_dir: Path) -> None:
    if not (model_dir / "config.json").is_file():
        _fail(f"{model_dir} is not a HF model directory (run scripts/setup.sh for SmolLM2)")


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
    device: Annotated[
        str, typer.Option(help="cpu, or fakegpu: a device with streams, as a GPU")
    ] = "cpu",
    layers: Annotated[int, typer.Option(help="its layers (0: the zoo's)")] = 0,
    chunk_size: Annotated[
        int,
        typer.Option(help="also an engine with chunks of this many elements (tensors span)"),
    ] = 0,
    json_out: Annotated[bool, typer.Option("--json", help="print one JSON line last")] = False,
) -> None:
    """Engine step time / plain PyTorch step time (same dtype), runs interleaved."""
    from benchmarks.overhead import run

    try:
        run(
            model=model, steps=steps, warmup=warmup, batch=batch, seq=seq, dtype=dtype,
            json_out=json_out, device=device, layers=layers, chunk_size=chunk_size,
        )  # fmt: skip
    except ValueError as e:
        _fail(str(e))


@bench_app.command("overlap")
def bench_overlap(
    model: Annotated[str, typer.Option(help="zoo model")] = "gpt-small",
    layers: Annotated[int, typer.Option(help="its layers (0: the zoo's)")] = 8,
    vocab: Annotated[int, typer.Option(help="its vocabulary (0: the zoo's)")] = 2048,
    steps: Annotated[int, typer.Option(help="timed steps with the link, and without")] = 4,
    warmup: Annotated[int, typer.Option(help="untimed steps first")] = 2,
    batch: Annotated[int, typer.Option(help="sequences per step")] = 4,
    seq: Annotated[int, typer.Option(help="tokens per sequence")] = 128,
    gbps: Annotated[
        float | None,
        typer.Option(help="link GB/s each way (default: a chunk's copy takes a layer's forward)"),
    ] = None,
    dtype: Annotated[str, typer.Option(help=_DTYPE_HELP)] = "auto",
    beside: Annotated[
        bool,
        typer.Option(
            "--adam-beside/--no-adam-beside",
            help="train with backward_and_step (host Adam beside backward), or backward then step",
        ),
    ] = True,
    json_out: Annotated[bool, typer.Option("--json", help="print one JSON line last")] = False,
) -> None:
    """Copy time issued, exposed and hidden per phase on the fake device with a modeled
    host<->device link, under a budget that evicts params and one that splits Adam."""
    from benchmarks.overlap import run

    try:
        run(
            model=model, layers=layers or None, vocab=vocab or None, steps=steps,
            warmup=warmup, batch=batch, seq=seq, gbps=gbps, dtype=dtype, beside=beside,
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

    _need_hf_dir(model_dir)
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
    agree_per_collective: Annotated[
        bool,
        typer.Option(help="a flag exchange before every collective, not per agreed section"),
    ] = False,
    json_out: Annotated[bool, typer.Option("--json", help="print one JSON line last")] = False,
) -> None:
    """Chunk ZeRO-DP step time and bytes sent: ours 1/2 ranks vs FSDP2, DeepSpeed (CPU, gloo)."""
    from benchmarks.zero import run_zero

    try:
        run_zero(
            model=model, global_batch=global_batch, seq=seq, steps=steps, warmup=warmup,
            json_out=json_out, peers=peers, chunk_size=chunk_size, dtype=dtype,
            agree_per_collective=agree_per_collective,
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

    _need_hf_dir(model_dir)
    try:
        run(
            model_dir, rounds=rounds, batch=batch, seq=seq, cap_gib=cap_gib, disk_gib=disk_gib,
            max_layers=max_layers, dtype=dtype, json_out=json_out,
        )  # fmt: skip
    except ValueError as e:
        _fail(str(e))


@bench_app.command("rft")
def bench_rft(
    model_dir: Annotated[Path, typer.Argument(help="a HF chat model directory")] = Path(
        ".cache/models/SmolLM2-135M-Instruct"
    ),
    steps: Annotated[int, typer.Option(help="optimizer steps")] = 30,
    batch: Annotated[int, typer.Option(help="prompts per step")] = 4,
    group: Annotated[int, typer.Option(help="answers sampled per prompt")] = 4,
    max_tokens: Annotated[int, typer.Option(help="the longest answer, in tokens")] = 6,
    lr_multiplier: Annotated[float, typer.Option(help="learning_rate_multiplier")] = 3.0,
    full: Annotated[bool, typer.Option(help="train every weight instead of LoRA")] = False,
    sampler: Annotated[
        str, typer.Option(help="what samples the answers: auto, server or engine")
    ] = "auto",
    valid_prompts: Annotated[int, typer.Option(help="held-out prompts")] = 32,
    eval_samples: Annotated[int, typer.Option(help="answers per held-out prompt")] = 2,
    dtype: Annotated[str, typer.Option(help="the job's engine dtype")] = "fp32",
    json_out: Annotated[bool, typer.Option("--json", help="print one JSON line last")] = False,
) -> None:
    """Reinforcement fine-tuning: held-out pass rate before and after, the step's parts."""
    from benchmarks.rft import run

    _need_hf_dir(model_dir)
    try:
        run(
            model_dir, steps=steps, batch=batch, group=group, max_tokens=max_tokens,
            lr_multiplier=lr_multiplier, lora=not full, sampler=sampler,
            valid_prompts=valid_prompts, eval_samples=eval_samples, dtype=dtype,
            json_out=json_out,
        )  # fmt: skip
    except (ValueError, RuntimeError) as e:
        _fail(str(e))


@bench_app.command("tools")
def bench_tools(
    model_dir: Annotated[Path, typer.Argument(help="a HF chat model directory")] = Path(
        ".cache/models/SmolLM2-135M-Instruct"
    ),
    steps: Annotated[int, typer.Option(help="LoRA fine-tuning steps")] = 40,
    batch: Annotated[int, typer.Option(help="lines per step")] = 8,
    lr_multiplier: Annotated[float, typer.Option(help="learning_rate_multiplier")] = 3.0,
    held_out: Annotated[int, typer.Option(help="held-out asks")] = 40,
    dtype: Annotated[str, typer.Option(help="the job's engine dtype")] = "fp32",
    json_out: Annotated[bool, typer.Option("--json", help="print one JSON line last")] = False,
) -> None:
    """Function calling: held-out call accuracy of the base model and the fine-tuned one."""
    from benchmarks.tools import run

    _need_hf_dir(model_dir)
    try:
        run(
            model_dir, steps=steps, batch=batch, lr_multiplier=lr_multiplier,
            held_out=held_out, dtype=dtype, json_out=json_out,
        )  # fmt: skip
    except (ValueError, RuntimeError) as e:
        _fail(str(e))


@bench_app.command("prefix")
def bench_prefix(
    model_dir: Annotated[Path, typer.Argument(help="a HF model directory")] = Path(
        ".cache/models/SmolLM2-135M-Instruct"
    ),
    system_tokens: Annotated[int, typer.Option(help="the shared system prompt's length")] = 1024,
    questions: Annotated[int, typer.Option(help="chats sharing the system prompt")] = 8,
    turns: Annotated[int, typer.Option(help="turns of the conversation")] = 6,
    rounds: Annotated[int, typer.Option(help="interleaved rounds")] = 3,
    json_out: Annotated[bool, typer.Option("--json", help="print one JSON line last")] = False,
) -> None:
    """Prefix caching: time to first token of chats sharing a long system prompt (one by one
    and all at once) and of a conversation's turns, a replica keeping prompts' keys and
    values against one keeping none, and whether their greedy answers are the same."""
    from benchmarks.prefix import run

    _need_hf_dir(model_dir)
    if min(system_tokens, questions - 1, turns, rounds) < 1:
        _fail("--system-tokens, --turns and --rounds must be at least 1, --questions 2")
    run(
        model_dir, system_tokens=system_tokens, questions=min(questions, 16),
        turns=min(turns, 16), rounds=rounds, json_out=json_out,
    )  # fmt: skip


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

    _need_hf_dir(model_dir)
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

    _need_hf_dir(model_dir)
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


@bench_app.command("primitives")
def bench_primitives(
    model_dir: Annotated[Path, typer.Argument(help="a HF model directory")] = Path(
        ".cache/models/SmolLM2-135M-Instruct"
    ),
    batch: Annotated[int, typer.Option(help="sequences per forward_backward")] = 8,
    seq: Annotated[int, typer.Option(help="tokens per sequence")] = 128,
    rank: Annotated[int, typer.Option(help="the LoRA's rank (Tinker's default: 32)")] = 32,
    rounds: Annotated[int, typer.Option(help="interleaved rounds of every case")] = 3,
    prompts: Annotated[int, typer.Option(help="concurrent sample requests")] = 16,
    samples: Annotated[int, typer.Option(help="samples per request")] = 8,
    max_tokens: Annotated[int, typer.Option(help="tokens per sample")] = 32,
    dtype: Annotated[str, typer.Option(help="the engine's compute dtype")] = "auto",
    json_out: Annotated[bool, typer.Option("--json", help="print one JSON line last")] = False,
) -> None:
    """Tinker's primitives through the unmodified SDK at our API: a training step against
    the engine called directly, save-to-sample latency, sampled tokens/s against generate,
    time to first token at 1 and N concurrent requests."""
    from benchmarks.primitives import run

    _need_hf_dir(model_dir)
    if min(batch, seq, rank, rounds, prompts, samples, max_tokens) < 1:
        _fail("--batch, --seq, --rank, --rounds, --prompts, --samples, --max-tokens: >= 1")
    run(
        model_dir, batch=batch, seq=seq, rank=rank, rounds=rounds, prompts=prompts,
        samples=samples, max_tokens=max_tokens, dtype=dtype, json_out=json_out,
    )  # fmt: skip


@bench_app.command("prep")
def bench_prep(
    mb: Annotated[int, typer.Option(help="MiB of chat examples to upload and prepare")] = 1024,
    prep_timeout: Annotated[
        float, typer.Option(help="seconds to follow the job's data preparation, then cancel")
    ] = 240.0,
    seed: Annotated[int, typer.Option(help="seed of the generated examples")] = 0,
    json_out: Annotated[bool, typer.Option("--json", help="print one JSON line last")] = False,
) -> None:
    """A large training file uploaded, dry-run and prepared by a job: how much the API's
    and the Ray head's processes grow, and the preparing task."""
    from benchmarks.prep import run

    try:
        run(mb=mb, prep_timeout_s=prep_timeout, seed=seed, json_out=json_out)
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


@bench_app.command("plan")
def bench_plan(
    models: Annotated[
        str, typer.Option(help="comma-separated zoo models whose forecast is checked")
    ] = "gpt-tiny,gpt-small,gpt-45m,gpt-100m",
    json_out: Annotated[bool, typer.Option("--json", help="print one JSON line last")] = False,
) -> None:
    """The capacity planner: the paper's four configurations and chunk-size table next to
    the planner's answers, and its forecast of an iteration against the engine's figures."""
    from benchmarks.plan import BENCH_MODELS, run

    chunks = dict(BENCH_MODELS)
    names = [m.strip() for m in models.split(",") if m.strip()]
    unknown = [m for m in names if m not in chunks]
    if not names or unknown:
        _fail(f"--models: one or more of {', '.join(chunks)} (not {', '.join(unknown)})")
    run(tuple((m, chunks[m]) for m in names), json_out=json_out)
