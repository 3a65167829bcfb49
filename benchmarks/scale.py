"""`pstar bench scale`: the largest GPT each system really trains under one host-memory cap.

Systems, each trained for `steps` (>= 2) steps with a finite loss at every step:
- `ours`: the chunk engine on the CPU, no disk tier (device budget an eighth of the cap,
  host budget the rest of it above what the process holds before the model, less 10%);
- `ours_disk`: the same with the disk tier (a spill file of up to `disk_gib`);
- `deepspeed`: DeepSpeed ZeRO-3 with parameters and optimizer states offloaded to the CPU
  (built under `deepspeed.zero.Init`, its CPU Adam), when `import deepspeed` works (the
  optional `[bench]` extra, `bash scripts/setup-bench.sh`);
- `fsdp2`: PyTorch FSDP2 `fully_shard` with `CPUOffloadPolicy` and mixed precision in
  the dtype, built on the meta device and materialized on the CPU.

All systems train in one dtype (`--dtype`, default auto: what the engine picks on this
CPU): the engine's `dtype`, DeepSpeed's bf16/fp16 section (neither in fp32), FSDP2's
`MixedPrecisionPolicy(param_dtype=...)` (none in fp32); each trial reports the dtype its
first linear layer was seen computing in. Each trial also reports `init_peak_bytes`: how
far its peak resident memory rose while the model was set up (ours: across
`pstar_core.initialize`; the peers: building and wrapping it), see
`benchmarks.report.peak_rss_growth`.

The cap is enforced per trial: every trial is a fresh process whose resident memory the
parent samples every 20 ms and kills at the cap (its peak RSS, from the kernel, is
reported too). On a machine without a GPU the device and the host are the same memory, so
this measures bytes per parameter and what the disk tier adds; the GPU side of the paper's
scale result is not measured here.

Search: layers (hidden size fixed) double from `start_layers` until a trial fails, then a
binary search between the last success and the first failure. A failed trial is reported
with its error (killed at the cap, an exception, a timeout, a non-finite loss), never just
as "too big"; a system whose largest tried size succeeded is reported `at_least`.

    pstar bench scale --json
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import resource
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from benchmarks.report import (
    bench_dtype,
    deepspeed_precision,
    finish,
    fsdp2_precision,
    last_json,
    load_avg,
    machine,
    peak_rss_growth,
    torch_dtype,
    watch_compute_dtype,
)
from pstar_core.hf import load_causal_lm

__all__ = ["SYSTEMS", "run_scale"]

SYSTEMS = ("ours", "ours_disk", "deepspeed", "fsdp2")
GIB = 2**30
ROOT = Path(__file__).resolve().parents[1]


def deepspeed_available() -> bool:
    return importlib.util.find_spec("deepspeed") is not None


# -- one trial (in its own process) ---------------------------------------------------------


def _config(spec: dict[str, Any]):
    from pstar_core.models import GPTConfig

    return GPTConfig(
        hidden_size=spec["hidden"],
        num_layers=spec["layers"],
        num_heads=spec["heads"],
        vocab_size=spec["vocab"],
        seq_len=spec["seq"],
    )


def _rss_bytes() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def _peak_rss_bytes() -> int:
    """This process's peak resident memory (VmHWM). Not getrusage's ru_maxrss: Linux
    carries that over fork and exec, so a trial would report its parent's peak."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # not Linux


def _train_ours(spec: dict[str, Any], base_rss: int, out: dict[str, Any]) -> list[float]:
    import torch

    import pstar_core
    from pstar_core.models import build

    cfg = _config(spec)
    cap = spec["cap_bytes"]
    # "device" = CPU memory here: a small share for activations and the operators' chunks
    # (the warm-up step needs every chunk to fit host + disk, so the host holds the model)
    device = cap // 8
    host = max(cap - device - base_rss - cap // 10, cap // 10)  # 10% for temporaries
    if "host_bytes" in spec:  # the caller's shares (bench lora)
        host, device = spec["host_bytes"], spec["device_bytes"]
    memory: dict[str, Any] = {"device_budget": device, "host_budget": host, "disk_budget": 0}
    if spec["system"] in ("ours_disk", "ours_lora"):
        memory.update(disk_budget=spec["disk_bytes"], disk_dir=spec["disk_dir"])
    config: dict[str, Any] = {"dtype": spec["dtype"], "optimizer": {"lr": 1e-4}, "memory": memory}
    with _init_peak(out):
        if spec["system"] == "ours_lora":  # a pretrained base directory, see benchmarks.lora
            config["lora"] = {"r": spec["lora_r"], "alpha": 2 * spec["lora_r"]}
            engine = pstar_core.initialize(spec["model_dir"], config)
        else:
            engine = pstar_core.initialize(lambda: build(cfg), config)
    return _loop(spec, lambda x: _engine_step(engine, x), torch, out, engine.module)


@contextlib.contextmanager
def _init_peak(out: dict[str, Any]) -> Iterator[None]:
    """`out["init_peak_bytes"]`: the rise of the peak RSS while the block sets the model
    up; the peak before it is kept, so the trial's own peak still covers the whole run."""
    with peak_rss_growth() as grew:
        yield
    out["init_peak_bytes"] = grew["bytes"]
    out["init_new_modules"] = grew["new_modules"]
    out["prior_peak_bytes"] = grew["prior_peak_bytes"]


def _engine_step(engine: Any, x: Any) -> float:
    out = engine(input_ids=x, labels=x)
    engine.backward(out.loss)
    engine.step()
    return float(out.loss.detach())


def _train_deepspeed(spec: dict[str, Any], _base_rss: int, out: dict[str, Any]) -> list[float]:
    import deepspeed
    import torch

    from pstar_core.models import build

    deepspeed.init_distributed(dist_backend="gloo")
    offload = {"device": "cpu", "pin_memory": False}
    config = {
        "train_batch_size": spec["batch"],
        "train_micro_batch_size_per_gpu": spec["batch"],
        "gradient_accumulation_steps": 1,
        **deepspeed_precision(spec["dtype"]),
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0}},
        "zero_optimization": {"stage": 3, "offload_param": offload, "offload_optimizer": offload},
        "steps_per_print": 10**9,
    }
    with _init_peak(out):
        with deepspeed.zero.Init(config_dict_or_path=config, remote_device="cpu"):
            net = build(_config(spec))
        # the model's own init ran on already partitioned parameters: run it again one
        # module at a time, gathered, so DeepSpeed trains the same GPT-2 init as the others
        net.init_weights(gather=lambda ps: deepspeed.zero.GatheredParameters(ps, modifier_rank=0))
        engine, *_ = deepspeed.initialize(
            model=net, model_parameters=net.parameters(), config=config
        )

    def step(x: Any) -> float:
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        return float(loss.detach())

    return _loop(spec, step, torch, out, net)


def _train_fsdp2(spec: dict[str, Any], _base_rss: int, out: dict[str, Any]) -> list[float]:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    from pstar_core.models import build

    dist.init_process_group("gloo", init_method="env://")
    mesh = init_device_mesh("cpu", (1,))
    with _init_peak(out):
        with torch.device("meta"):
            net = build(_config(spec))
        mp = fsdp2_precision(spec["dtype"])
        offload = CPUOffloadPolicy(pin_memory=False)
        for block in net.blocks:
            fully_shard(block, mesh=mesh, mp_policy=mp, offload_policy=offload)
        fully_shard(net, mesh=mesh, mp_policy=mp, offload_policy=offload)
        net.to_empty(device="cpu")
        with torch.no_grad():
            net.init_weights()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4)

    return _loop(spec, _torch_step(net, opt), torch, out, net)


def _train_peft_lora(spec: dict[str, Any], _base_rss: int, out: dict[str, Any]) -> list[float]:
    """The usual LoRA recipe on a pretrained base directory: `from_pretrained` in the
    dtype, peft's fp32 adapters on every linear layer, torch AdamW."""
    import peft
    import torch

    with _init_peak(out):
        base = load_causal_lm(spec["model_dir"], dtype=torch_dtype(spec["dtype"]))
        config = peft.LoraConfig(
            r=spec["lora_r"], lora_alpha=2 * spec["lora_r"], target_modules="all-linear"
        )
        net = peft.get_peft_model(base, config)
    opt = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=1e-4)

    return _loop(spec, _torch_step(net, opt), torch, out, net)


def _torch_step(net: Any, opt: Any) -> Any:
    """One plain PyTorch training step of `net` with `opt`, as a function of the batch."""

    def step(x: Any) -> float:
        loss = net(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    return step


def _loop(
    spec: dict[str, Any], step: Any, torch: Any, out: dict[str, Any], module: Any
) -> list[float]:
    """`spec["steps"]` steps; `out["compute_dtype_seen"]`: what `module` computed in."""
    seen = watch_compute_dtype(module)
    gen = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(spec["steps"]):
        x = torch.randint(0, spec["vocab"], (spec["batch"], spec["seq"]), generator=gen)
        losses.append(step(x))
        out["compute_dtype_seen"] = seen()
    return losses


TRAINERS = {
    "ours": _train_ours,
    "ours_disk": _train_ours,
    "deepspeed": _train_deepspeed,
    "fsdp2": _train_fsdp2,
    "ours_lora": _train_ours,  # `pstar bench lora`
    "peft_lora": _train_peft_lora,
}


def trial_main(spec_json: str) -> None:
    """A trial process: build, train `steps` steps, print one JSON line with the outcome."""
    import torch

    spec = json.loads(spec_json)
    torch.set_num_threads(spec["threads"])
    cfg = _config(spec)
    from pstar_core.models import num_params

    params = spec.get("params") or num_params(cfg)  # given when a model_dir is trained
    out: dict[str, Any] = {"layers": cfg.num_layers, "params": params, "ok": False}
    base = _rss_bytes()
    t0 = time.perf_counter()
    try:
        losses = TRAINERS[spec["system"]](spec, base, out)
        out["losses"] = losses
        out["ok"] = len(losses) >= 2 and all(math.isfinite(v) for v in losses)
        if not out["ok"]:
            out["error"] = f"a loss is not finite: {losses}"
    except Exception as e:  # reported as this trial's error, whatever it is
        out["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
    out["seconds"] = time.perf_counter() - t0
    out["base_rss_bytes"] = base
    # the peak before the set-up's reset (if any) counts too
    out["peak_rss_bytes"] = max(_peak_rss_bytes(), out.pop("prior_peak_bytes", None) or 0)
    sys.stdout.write("\n" + json.dumps(out) + "\n")
    sys.stdout.flush()
    os._exit(0)  # skip finalization: a gloo run-loop thread may still hold tensors


# -- the parent side ------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_trial(spec: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """One trial in a fresh process, killed if its resident memory passes the cap."""
    import psutil

    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": str(spec["threads"]),
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "DS_ACCELERATOR": "cpu",
        "TORCH_EXTENSIONS_DIR": str(Path.home() / ".cache" / "pstar" / "torch_extensions"),
    }
    code = "import sys; from benchmarks.scale import trial_main; trial_main(sys.argv[1])"
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", code, json.dumps(spec)],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
        )
        ps = psutil.Process(proc.pid)
        t0, peak, why = time.perf_counter(), 0, None
        while proc.poll() is None:
            try:
                rss = ps.memory_info().rss
            except psutil.Error:
                break
            peak = max(peak, rss)
            if rss > spec["cap_bytes"]:
                why = f"killed at the cap: resident memory reached {rss / GIB:.2f} GiB"
            elif time.perf_counter() - t0 > timeout_s:
                why = f"timed out after {timeout_s:.0f} s"
            if why:
                proc.kill()
                break
            time.sleep(0.02)
        proc.wait()
        out.seek(0)
        text = out.read()
    base = {"layers": spec["layers"], "ok": False, "sampled_peak_rss_bytes": peak}
    if why:
        return {**base, "error": why, "seconds": time.perf_counter() - t0}
    got = last_json(text)
    if got is not None:
        got["sampled_peak_rss_bytes"] = peak
        if got["ok"] and got["peak_rss_bytes"] > spec["cap_bytes"]:
            got.update(ok=False, error="peak RSS over the cap (between two samples)")
        return got
    tail = " | ".join(text.strip().splitlines()[-3:])
    return {**base, "error": f"exited with {proc.returncode}: {tail}"[:400]}


def trial_logger(console: Console) -> Any:
    """`log(system, trial)` for `largest`: one dim line per trial, its outcome and peak."""

    def log(system: str, r: dict[str, Any]) -> None:
        what = "ok" if r["ok"] else f"failed: {r.get('error')}"
        rss = r.get("peak_rss_bytes") or r.get("sampled_peak_rss_bytes") or 0
        console.print(
            f"[dim]{system:>9} {r['layers']:>4} layers: {what} "
            f"(peak RSS {rss / GIB:.2f} GiB, {r.get('seconds', 0):.0f} s)"
        )

    return log


def largest(
    spec: dict[str, Any],
    start: int,
    max_layers: int,
    timeout_s: float,
    log: Any,
    prepare: Any = None,
) -> dict[str, Any]:
    """Largest layer count that trains: doubling, then binary search. Every trial kept.
    `prepare(spec) -> spec`, if given, completes a trial's spec (e.g. writes its model)."""
    trials: list[dict[str, Any]] = []

    def attempt(layers: int) -> bool:
        trial = {**spec, "layers": layers}
        r = run_trial(prepare(trial) if prepare else trial, timeout_s)
        trials.append(r)
        log(spec["system"], r)
        return r["ok"]

    good, bad = 0, None
    layers = start
    while layers <= max_layers:
        if attempt(layers):
            good = layers
            if layers == max_layers:
                break
            layers = min(2 * layers, max_layers)
        else:
            bad = layers
            break
    if bad is not None:
        lo, hi = good, bad
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if attempt(mid):
                lo = mid
            else:
                hi = mid
        good = lo
    ok = {t["layers"]: t for t in trials if t["ok"]}
    best = ok.get(good)
    first_failure = min((t for t in trials if not t["ok"]), key=lambda t: t["layers"], default=None)
    return {
        "layers": good,
        "params": best["params"] if best else 0,
        "peak_rss_bytes": best["peak_rss_bytes"] if best else None,
        "init_peak_bytes": best.get("init_peak_bytes") if best else None,
        "compute_dtype_seen": best.get("compute_dtype_seen") if best else None,
        "at_least": bad is None and good == max_layers,
        "failed_at": first_failure["layers"] if first_failure else None,
        "failure": first_failure["error"] if first_failure else None,
        "trials": sorted(trials, key=lambda t: t["layers"]),
    }


def run_scale(
    cap_gib: float = 2.0,
    disk_gib: float = 16.0,
    hidden: int = 512,
    heads: int = 8,
    vocab: int = 8192,
    seq: int = 64,
    batch: int = 1,
    steps: int = 2,
    start_layers: int = 4,
    max_layers: int = 128,
    systems: tuple[str, ...] = SYSTEMS,
    threads: int = 2,
    trial_timeout_s: float = 900.0,
    dtype: str = "auto",
    json_out: bool = False,
) -> dict[str, Any]:
    dtype = bench_dtype(dtype)
    if steps < 2:
        raise ValueError("steps must be >= 2 (a step after the first shows training goes on)")
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        raise ValueError(f"unknown systems {sorted(unknown)}; choose from {', '.join(SYSTEMS)}")
    console = Console(width=max(Console().width, 140))
    note = ""
    if "deepspeed" in systems and not deepspeed_available():
        systems = tuple(s for s in systems if s != "deepspeed")
        note += "DeepSpeed is not installed (bash scripts/setup-bench.sh): not run. "
    load_before = load_avg()
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="pstar-scale-") as disk_dir:
        base = {
            "hidden": hidden,
            "heads": heads,
            "vocab": vocab,
            "seq": seq,
            "batch": batch,
            "steps": steps,
            "threads": threads,
            "dtype": dtype,
            "cap_bytes": int(cap_gib * GIB),
            "disk_bytes": int(disk_gib * GIB),
            "disk_dir": disk_dir,
        }

        log = trial_logger(console)

        for system in systems:
            spec = {**base, "system": system}
            results[system] = largest(spec, start_layers, max_layers, trial_timeout_s, log)
    load_after = load_avg()
    peers = [results[p]["params"] for p in ("deepspeed", "fsdp2") if p in results]
    best_peer = max(peers) if peers else 0

    def ratio(system: str) -> float | None:
        if system not in results or not best_peer:
            return None
        return results[system]["params"] / best_peer

    result: dict[str, Any] = {
        "cap_bytes": base["cap_bytes"],
        "disk_bytes": base["disk_bytes"],
        "hidden": hidden,
        "seq": seq,
        "batch": batch,
        "steps": steps,
        "largest_params": {s: r["params"] for s, r in results.items()},
        "largest_layers": {s: r["layers"] for s, r in results.items()},
        "peak_rss_bytes": {s: r["peak_rss_bytes"] for s, r in results.items()},
        # one rank per trial: the set-up's peak growth of each system's largest model
        "init_peak_bytes": {s: r["init_peak_bytes"] for s, r in results.items()},
        "compute_dtype_seen": {s: r["compute_dtype_seen"] for s, r in results.items()},
        "at_least": {s: r["at_least"] for s, r in results.items()},
        "best_peer_params": best_peer or None,
        "ratio_vs_best_peer": ratio("ours"),
        "ratio_with_disk": ratio("ours_disk"),
        "systems": results,
        **machine(dtype),
        "trial_threads": threads,
        "load_avg": {"before": load_before, "after": load_after},
    }
    table = Table(
        title=f"largest GPT under a {cap_gib:g} GiB cap per process (hidden {hidden}, seq {seq}, "
        f"batch {batch}, {steps} steps, {threads} threads), {dtype} on CPU "
        f"{result['cpu_capability']}"
    )
    cols = ("system", "layers", "params (M)", "peak RSS GiB", "init peak GiB", "computed in")
    for col in (*cols, "first failure"):
        table.add_column(col, justify="left" if col in ("system", "first failure") else "right")
    for system, r in results.items():
        failure = (
            "none up to the largest tried"
            if r["failed_at"] is None
            else f"{r['failed_at']} layers: {r['failure']}"
        )
        table.add_row(
            system,
            f"{'≥' if r['at_least'] else ''}{r['layers']}",
            f"{r['params'] / 1e6:.1f}",
            f"{(r['peak_rss_bytes'] or 0) / GIB:.2f}",
            "-" if r["init_peak_bytes"] is None else f"{r['init_peak_bytes'] / GIB:.3f}",
            r["compute_dtype_seen"] or "-",
            failure[:80],
        )
    table.caption = (
        "init peak: how far the trial's peak RSS rose while the model was set up (ours: "
        "pstar_core.initialize; peers: building and wrapping it), for the largest model"
    )
    console.print(table)
    for key in ("ratio_vs_best_peer", "ratio_with_disk"):
        if result[key] is not None:
            note += f"{key} {result[key]:.2f}; "
    return finish(console, result, load_before, load_after, json_out, note)


if __name__ == "__main__":
    run_scale(json_out=True)
