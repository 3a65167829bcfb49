"""`pstar bench primitives`: Tinker's training primitives through the unmodified `tinker`
SDK at our API, against the same work done directly in one process.

The API (FastAPI under uvicorn, SQLite) runs in this process, its training engines in
this process too (as they do today), and its samplers on generators in this process
(`api.generate.LocalBackend`, the same `Generator` a Ray Serve replica runs; Serve's
routing is left out). The SDK talks to it over loopback HTTP. Measured, each case
interleaved with its reference for `--rounds` rounds, medians reported:

- **step**: `forward_backward` + `optim_step` of a LoRA (rank `--rank`, every projection
  and the head, Tinker's defaults) on `--batch` sequences of `--seq` tokens, results read,
  against the same step on a `pstar_core` engine called directly (`losses.run` and
  `Engine.step`), the same dtype. Goal: ratio <= 1.15.
- **save to sample**: `save_weights_for_sampler` -> `create_sampling_client(model_path)`
  -> a one-token sample, from the call to its result (the adapter is exported, loaded into
  the base's generator and used). Goal: <= 2 s.
- **sampling**: `--prompts` sample requests of `--samples` samples each, `--max-tokens`
  tokens each (no stop), at once, through the sampler of that adapter: sampled tokens per
  second, against `generate` on the same base with the same adapter (peft) over the same
  prompts left-padded, `num_return_sequences=samples`. Goal: ratio >= 1.0.
- **time to first token** at 1 and `--prompts` concurrent one-token samples (the
  request's time to its result), against `generate` of that many prompts with one new
  token (a batch's prefill and one token).

Every figure names the dtype each side computed in and the CPU's capability.
"""

from __future__ import annotations

import contextlib
import json
import random
import shutil
import socket
import statistics
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from benchmarks.report import bench_dtype, finish, load_avg, machine, median
from benchmarks.serve import prompts as story_prompts
from pstar_core.hf import load_causal_lm

TOKEN = "tml-bench-primitives-0123456789"


@contextlib.contextmanager
def api_server(model_dir: Path, max_batch: int) -> Iterator[tuple[str, Any, Path]]:
    """The API on a loopback port with `model_dir` as its one base model; (url, its app
    context, the data dir)."""
    import uvicorn

    from api.app import create_app
    from api.generate import LocalBackend
    from service.control.launcher import DryLauncher
    from service.settings import Settings
    from service.store import Store

    data_dir = Path(tempfile.mkdtemp(prefix="pstar-bench-primitives-"))
    db = f"sqlite:///{data_dir / 'store.db'}"
    settings = Settings(data_dir=data_dir, db_url=db, tokens={TOKEN: "bench"})
    settings.ensure_dirs()
    (settings.models_dir / model_dir.name).symlink_to(model_dir.resolve())
    store = Store(db)
    store.migrate()
    app = create_app(settings, store, DryLauncher(), backend=LocalBackend(data_dir, max_batch))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 60
    while not server.started:
        if time.time() > deadline:
            raise RuntimeError("the API server did not start")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}", app.state.ctx, data_dir
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        shutil.rmtree(data_dir, ignore_errors=True)


def batch_data(vocab: int, batch: int, seq: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(seq + 1)] for _ in range(batch)]


@dataclass
class Times:
    """What each case measured, a value per round."""

    sdk_step: list[float] = field(default_factory=list)
    direct_step: list[float] = field(default_factory=list)
    to_sample: list[float] = field(default_factory=list)
    ours_tps: list[float] = field(default_factory=list)
    ref_tps: list[float] = field(default_factory=list)
    ttft: dict[int, list[float]] = field(default_factory=dict)
    ref_ttft: dict[int, list[float]] = field(default_factory=dict)


def step_times(tc: Any, model_dir: Path, seqs: list[list[int]], rank: int, compute: str,
               rounds: int, times: Times) -> None:  # fmt: skip
    """forward_backward + optim_step through the SDK, interleaved with the same step on an
    engine of the same model and LoRA called directly."""
    import tinker

    import pstar_core
    from service.sessions.hosts import LORA_ALPHA
    from service.sessions.losses import Datum
    from service.sessions.losses import run as run_loss
    from service.sessions.runtime import ATTENTION, MLP, UNEMBED

    T = tinker.types
    seq = len(seqs[0]) - 1
    weights = [1.0] * seq
    sdk_data = [
        T.Datum(
            model_input=T.ModelInput.from_ints(s[:-1]),
            loss_fn_inputs={"target_tokens": s[1:], "weights": weights},
        )
        for s in seqs
    ]
    direct_data = [Datum(s[:-1], {"target_tokens": s[1:], "weights": weights}) for s in seqs]
    adam = T.AdamParams(learning_rate=1e-5)
    hyper = pstar_core.StepHyper(1e-5, (0.9, 0.95), 1e-12, 0.0)
    lora = {"r": rank, "alpha": LORA_ALPHA, "target_modules": ATTENTION + MLP + UNEMBED}
    direct = pstar_core.initialize(model_dir, {"dtype": compute, "lora": lora})

    def sdk_once() -> float:
        t0 = time.perf_counter()
        fb = tc.forward_backward(sdk_data, "cross_entropy")
        step = tc.optim_step(adam)
        fb.result()
        step.result()
        return time.perf_counter() - t0

    def direct_once() -> float:
        t0 = time.perf_counter()
        run_loss(direct, direct_data, "cross_entropy", {}, backward=True)
        direct.step(hyper)
        return time.perf_counter() - t0

    sdk_once(), direct_once()  # warm-up: the tracer's step on each
    for _ in range(rounds):
        times.sdk_step.append(sdk_once())
        times.direct_step.append(direct_once())
    direct.close()


def sampling_times(sc: Any, tc: Any, model_dir: Path, adapter_root: Path,
                   chats: list[list[int]], samples: int, max_tokens: int, rounds: int,
                   times: Times) -> None:  # fmt: skip
    """Save-to-first-token, then sampled tokens/s and time to first token through the
    SDK, each round beside `generate` on the same base and adapter."""
    import tinker
    import torch
    from peft import PeftModel
    from transformers import AutoTokenizer

    T = tinker.types
    one = T.SamplingParams(max_tokens=1)
    # the base's generator made before any timing (a model load is not a sample)
    warm = sc.create_sampling_client(base_model=model_dir.name).result()
    warm.sample(T.ModelInput.from_ints(chats[0]), 1, one).result()
    sampler = None
    for i in range(rounds):
        t0 = time.perf_counter()
        path = tc.save_weights_for_sampler(f"bench-{i}").result().path
        sampler = sc.create_sampling_client(model_path=path).result()
        sampler.sample(T.ModelInput.from_ints(chats[0]), 1, one).result()
        times.to_sample.append(time.perf_counter() - t0)
    assert sampler is not None
    last = adapter_root / f"bench-{rounds - 1}"  # the last one saved, in its files' dir
    adapter = last / json.loads((last / "session.json").read_text())["files"] / "adapter"
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.padding_side = "left"
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    base_model = load_causal_lm(model_dir, dtype=torch.float32).eval()
    ref = PeftModel.from_pretrained(base_model, adapter).eval()

    def generate(n_prompts: int, new: int, per_prompt: int) -> float:
        batch_ids = tok.pad({"input_ids": chats[:n_prompts]}, padding=True, return_tensors="pt")
        t0 = time.perf_counter()
        with torch.inference_mode():
            ref.generate(
                **batch_ids,
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=True,
                num_return_sequences=per_prompt,
                pad_token_id=pad,
            )
        return time.perf_counter() - t0

    full = T.SamplingParams(max_tokens=max_tokens, temperature=1.0, stop=[])
    prompts = len(chats)
    for c in (1, prompts):
        times.ttft.setdefault(c, [])
        times.ref_ttft.setdefault(c, [])
    for _ in range(rounds):
        t0 = time.perf_counter()
        futs = [sampler.sample(T.ModelInput.from_ints(c), samples, full) for c in chats]
        got = sum(len(s.tokens) for f in futs for s in f.result().sequences)
        times.ours_tps.append(got / (time.perf_counter() - t0))
        elapsed = generate(prompts, max_tokens, samples)
        times.ref_tps.append(prompts * samples * max_tokens / elapsed)
        for c in times.ttft:
            t0 = time.perf_counter()  # c requests at once; each one's time to its token
            futs = [sampler.sample(T.ModelInput.from_ints(chats[k]), 1, one) for k in range(c)]
            ends = []
            for fut in futs:
                fut.result()
                ends.append(time.perf_counter() - t0)
            times.ttft[c].append(statistics.median(ends))
            times.ref_ttft[c].append(generate(c, 1, 1))


def run(
    model_dir: Path,
    *,
    batch: int = 8,
    seq: int = 128,
    rank: int = 32,
    rounds: int = 3,
    prompts: int = 16,
    samples: int = 8,
    max_tokens: int = 32,
    dtype: str = "auto",
    json_out: bool = False,
) -> dict[str, Any]:
    import os

    import tinker
    from transformers import AutoTokenizer

    os.environ.setdefault("TINKER_TELEMETRY", "0")
    console = Console()
    load_before = load_avg()
    compute = bench_dtype(dtype)
    base = model_dir.name
    tok = AutoTokenizer.from_pretrained(model_dir)
    seqs = batch_data(len(tok), batch, seq)
    chats = [
        tok(tok.apply_chat_template(p, tokenize=False, add_generation_prompt=True))["input_ids"]
        for p in story_prompts(prompts)
    ]
    times = Times()
    with api_server(model_dir, max_batch=prompts * samples) as (url, ctx, data_dir):
        ctx.sessions.engine_defaults["dtype"] = compute
        with tinker.ServiceClient(base_url=url, api_key=TOKEN) as sc:
            tc = sc.create_lora_training_client(base_model=base, rank=rank).result()
            console.print(f"step: {batch} x {seq} tokens, LoRA r={rank}, {compute}")
            step_times(tc, model_dir, seqs, rank, compute, rounds, times)
            console.print(f"sampling: {prompts} prompts x {samples} samples x {max_tokens} tokens")
            adapters = data_dir / "sessions" / "bench" / tc.model_id / "sampler_weights"
            sampling_times(sc, tc, model_dir, adapters, chats, samples, max_tokens, rounds, times)
            tc_id = tc.model_id
    result = report(console, times, base, tc_id, compute, batch, seq, rank, rounds, prompts,
                    samples)  # fmt: skip
    return finish(console, result, load_before, load_avg(), json_out)


def report(
    console: Console,
    t: Times,
    base: str,
    tc_id: str,
    compute: str,
    batch: int,
    seq: int,
    rank: int,
    rounds: int,
    prompts: int,
    samples: int,
) -> dict[str, Any]:
    """The table, and the result's JSON."""
    step_ratio = median(t.sdk_step) / median(t.direct_step)
    tps_ratio = median(t.ours_tps) / median(t.ref_tps)
    result: dict[str, Any] = {
        "benchmark": "primitives",
        "model": base,
        "training_model": tc_id,
        "batch": batch,
        "seq": seq,
        "lora_rank": rank,
        "rounds": rounds,
        "sdk_step_s": round(median(t.sdk_step), 3),
        "direct_step_s": round(median(t.direct_step), 3),
        "step_ratio": round(step_ratio, 3),
        "save_to_first_token_s": round(median(t.to_sample), 3),
        "sampling_rows": prompts * samples,
        "sampled_tokens_per_s": round(median(t.ours_tps), 1),
        "generate_tokens_per_s": round(median(t.ref_tps), 1),
        "sampling_ratio": round(tps_ratio, 3),
        "ttft_s": {str(c): round(median(v), 3) for c, v in t.ttft.items()},
        "generate_ttft_s": {str(c): round(median(v), 3) for c, v in t.ref_ttft.items()},
        "sampler_dtype": "fp32",
        **machine(compute),
    }
    table = Table(title=f"Tinker primitives through the SDK ({base}, {compute} training)")
    for col in ("case", "ours", "reference", "ratio", "goal"):
        table.add_column(col)
    table.add_row(
        f"forward_backward + optim_step, {batch}x{seq}",
        f"{median(t.sdk_step):.3f} s",
        f"{median(t.direct_step):.3f} s (engine direct)",
        f"{step_ratio:.3f}",
        "<= 1.15",
    )
    table.add_row(
        "save_weights_for_sampler -> first token", f"{median(t.to_sample):.3f} s", "", "", "<= 2 s"
    )
    table.add_row(
        f"sampled tokens/s, {prompts} prompts x {samples}",
        f"{median(t.ours_tps):.1f}",
        f"{median(t.ref_tps):.1f} (generate, fp32)",
        f"{tps_ratio:.3f}",
        ">= 1.0",
    )
    for c in t.ttft:
        table.add_row(
            f"time to first token, {c} at once",
            f"{median(t.ttft[c]):.3f} s",
            f"{median(t.ref_ttft[c]):.3f} s (generate)",
            f"{median(t.ttft[c]) / median(t.ref_ttft[c]):.2f}",
            "",
        )
    console.print(table)
    return result
