"""`pstar bench scale`: the largest GPT (layers grown) that trains under fixed budgets.

Each trial runs in a fresh subprocess; the static ZeRO-Offload-style layout is computed
from its memory constraints with the activations our tracer measured.

    python -c "from benchmarks.scale import run_scale; run_scale(json_out=True)"
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

import pstar_core
from benchmarks.dmm import (
    GIB,
    OURS_BYTES_PER_PARAM,
    STATIC_DEVICE_BYTES_PER_PARAM,
    STATIC_HOST_BYTES_PER_PARAM,
    _console,
    _load_avg,
)
from pstar_core.models import GPTConfig, build, num_params
from pstar_core.tiers import MemoryBudgetError

__all__ = ["run_scale"]


def _scale_config(layers: int, hidden: int, heads: int, vocab: int, seq: int) -> GPTConfig:
    return GPTConfig(
        hidden_size=hidden, num_layers=layers, num_heads=heads, vocab_size=vocab, seq_len=seq
    )


def _scale_trial(args: dict[str, Any]) -> None:
    """Subprocess entry: initialize + `steps` steps; prints one JSON line with the outcome."""
    cfg = _scale_config(args["layers"], args["hidden"], args["heads"], args["vocab"], args["seq"])
    out: dict[str, Any] = {"layers": cfg.num_layers, "params": num_params(cfg), "ok": False}
    t0 = time.perf_counter()
    try:
        engine = pstar_core.initialize(
            lambda: build(cfg),
            {
                "dtype": "bf16",
                "optimizer": {"lr": 1e-4},
                "memory": {
                    "device_budget": args["device_bytes"],
                    "host_budget": args["host_bytes"],
                    "disk_budget": 0,
                    "policy": "opt",
                },
            },
        )
        out["init_s"] = time.perf_counter() - t0
        gen = torch.Generator().manual_seed(0)
        loss = float("nan")
        for _ in range(args["steps"]):
            x = torch.randint(0, cfg.vocab_size, (args["batch"], args["seq"]), generator=gen)
            res = engine(input_ids=x, labels=x)
            engine.backward(res.loss)
            engine.step()
            loss = float(res.loss.detach())
        st = engine.stats()
        out.update(
            ok=math.isfinite(loss),
            loss=loss,
            peak_non_model_bytes=st["tracer"]["peak_non_model_bytes"],
            chunk_bytes=st["chunk_bytes"],
            tiers=st["tiers"],
            bytes_moved=st["bytes_moved"],
        )
        if not out["ok"]:
            out["error"] = f"loss is not finite ({loss})"
    except MemoryBudgetError as e:
        out["error"] = f"MemoryBudgetError: {str(e).splitlines()[0]}"
    except MemoryError as e:  # a real allocation failure, not the engine's budget check
        out["error"] = f"MemoryError: {e}"
    out["seconds"] = time.perf_counter() - t0
    print(json.dumps(out))


def _run_trial(args: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """One trial in a fresh interpreter: a failed trial's memory goes back to the OS with it,
    and an out-of-memory kill cannot take the benchmark down."""
    repo = str(Path(__file__).resolve().parents[1])
    code = (
        "import json, sys; from benchmarks.scale import _scale_trial; "
        "_scale_trial(json.loads(sys.argv[1]))"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")])}
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            [sys.executable, "-c", code, json.dumps(args)],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            cwd=repo,
            env=env,
        )
    except subprocess.TimeoutExpired:
        return {"layers": args["layers"], "ok": False, "error": f"timeout after {timeout_s:.0f} s"}
    for line in reversed(proc.stdout.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    tail = " | ".join(proc.stderr.strip().splitlines()[-3:])
    return {
        "layers": args["layers"],
        "ok": False,
        "seconds": time.perf_counter() - t0,
        "error": f"trial process exited with {proc.returncode}: {tail}",
    }


def _static_layers(
    device_bytes: int,
    host_bytes: int,
    nm_of: Callable[[int], float],
    cfg_of: Callable[[int], GPTConfig],
    max_layers: int = 10_000,
) -> tuple[int, str]:
    """Most layers the static layout fits: 2 B/param + activations on the device, 16 B/param on
    the host. Returns (layers, binding constraint)."""
    best, why = 0, "device"
    for layers in range(1, max_layers):
        n = num_params(cfg_of(layers))
        dev_ok = STATIC_DEVICE_BYTES_PER_PARAM * n + nm_of(layers) <= device_bytes
        host_ok = STATIC_HOST_BYTES_PER_PARAM * n <= host_bytes
        if not (dev_ok and host_ok):
            why = "device" if not dev_ok else "host"
            break
        best = layers
    return best, why


def run_scale(
    device_gib: float = 1.5,
    host_gib: float = 6.0,
    hidden: int = 1024,
    seq: int = 128,
    batch: int = 1,
    steps: int = 3,
    json_out: bool = False,
    vocab: int = 8192,
    heads: int = 16,
    start_layers: int = 12,
    max_trials: int = 8,
    trial_timeout_s: float = 1200.0,
) -> dict[str, Any]:
    """Largest GPT (hidden fixed, layers grown) our DMM trains for `steps` steps within the
    budgets, found by doubling the layers from `start_layers` and then bisecting, at most
    `max_trials` trials; versus the static layout computed from its constraints.

    Layer counts whose model data alone (14 B/param) exceeds device + host budgets cannot fit
    and bound the search from above without a trial.
    """
    device_bytes, host_bytes = int(device_gib * GIB), int(host_gib * GIB)

    def cfg_of(layers: int) -> GPTConfig:
        return _scale_config(layers, hidden, heads, vocab, seq)

    ceiling = 1
    while OURS_BYTES_PER_PARAM * num_params(cfg_of(ceiling)) <= device_bytes + host_bytes:
        ceiling += 1
    console = _console()
    console.print(
        f"scale search: hidden {hidden}, heads {heads}, vocab {vocab}, batch {batch} x seq {seq}, "
        f"{steps} steps per trial; device {device_gib} GiB, host {host_gib} GiB; "
        f"{ceiling} layers cannot fit (model data > device + host); at most {max_trials} trials"
    )
    load_before = _load_avg()
    t_start = time.perf_counter()
    trials: list[dict[str, Any]] = []
    lo, hi = 0, ceiling  # largest layer count that trained, smallest that cannot
    while len(trials) < max_trials:
        if lo == 0 and not trials:
            layers = min(start_layers, hi - 1)
        elif lo > 0 and not any(not t["ok"] for t in trials) and 2 * lo < hi:
            layers = 2 * lo  # still growing
        else:
            if hi - lo <= 1:
                break
            layers = (lo + hi) // 2
        if layers < 1:
            break
        args = {
            "layers": layers,
            "hidden": hidden,
            "heads": heads,
            "vocab": vocab,
            "seq": seq,
            "batch": batch,
            "steps": steps,
            "device_bytes": device_bytes,
            "host_bytes": host_bytes,
        }
        n = num_params(cfg_of(layers))
        console.print(
            f"[dim]{time.strftime('%H:%M:%S')}[/dim] trial {len(trials) + 1}: {layers} layers "
            f"({n / 1e6:.0f}M params) ..."
        )
        t = _run_trial(args, trial_timeout_s)
        t.setdefault("params", n)
        trials.append(t)
        status = "ok" if t["ok"] else f"failed: {t.get('error', '?')}"
        console.print(f"    {t.get('seconds', 0):.0f} s, {status}")
        if t["ok"]:
            lo = max(lo, layers)
        else:
            hi = min(hi, layers)

    ok = sorted((t for t in trials if t["ok"]), key=lambda t: t["layers"])
    ours_layers = lo
    ours_params = num_params(cfg_of(lo)) if lo else 0
    # Activations grow with depth: fit N(L) = a + b L through the successful trials (a
    # single trial gives a line through the origin), then apply the static constraints.
    if len(ok) >= 2:
        xs = [t["layers"] for t in ok]
        ys = [t["peak_non_model_bytes"] for t in ok]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum(
            (x - mx) ** 2 for x in xs
        )
        a = my - b * mx
    elif ok:
        a, b = 0.0, ok[0]["peak_non_model_bytes"] / ok[0]["layers"]
    else:
        a, b = 0.0, 0.0
    static_layers, binding = _static_layers(
        device_bytes, host_bytes, lambda layers: max(0.0, a + b * layers), cfg_of
    )
    static_params = num_params(cfg_of(static_layers)) if static_layers else 0
    best = ok[-1] if ok else {}
    result: dict[str, Any] = {
        "device_gib": device_gib,
        "host_gib": host_gib,
        "hidden": hidden,
        "heads": heads,
        "vocab": vocab,
        "seq": seq,
        "batch": batch,
        "steps": steps,
        "ours_layers": ours_layers,
        "ours_params": ours_params,
        "static_layers": static_layers,
        "static_params": static_params,
        "static_binding": binding,
        "ratio": ours_params / static_params if static_params else None,
        "resolution_layers": hi - lo,
        "first_failing_layers": hi,
        "peak_non_model_bytes": best.get("peak_non_model_bytes"),
        "non_model_fit": {"a_bytes": a, "b_bytes_per_layer": b},
        "trials": [
            {k: t.get(k) for k in ("layers", "params", "ok", "seconds", "init_s", "loss", "error")}
            | {"peak_non_model_bytes": t.get("peak_non_model_bytes")}
            for t in trials
        ],
        "seconds_per_trial": sum(t.get("seconds", 0) for t in trials) / max(1, len(trials)),
        "seconds": time.perf_counter() - t_start,
        "load_avg": {"before": load_before, "after": _load_avg()},
    }
    _print_scale(console, result)
    if json_out:
        print(json.dumps(result))
    return result


def _print_scale(console: Console, r: dict[str, Any]) -> None:
    table = Table(
        title=(
            f"largest trainable GPT: hidden {r['hidden']}, vocab {r['vocab']}, batch {r['batch']}"
            f" x seq {r['seq']}; device {r['device_gib']} GiB, host {r['host_gib']} GiB"
        )
    )
    for col in ("layout", "layers", "params", "how"):
        table.add_column(col, justify="left" if col in ("layout", "how") else "right")
    table.add_row(
        "ours (DMM, opt, bf16)",
        str(r["ours_layers"]),
        f"{r['ours_params'] / 1e6:.1f}M",
        f"trained {r['steps']} steps; next size up ({r['first_failing_layers']} layers) failed "
        "or cannot fit",
    )
    table.add_row(
        "static (ZeRO-Offload-style)",
        str(r["static_layers"]),
        f"{r['static_params'] / 1e6:.1f}M",
        "computed from constraints, not run: 2 B/param + activations (measured by our tracer) "
        f"<= device, 16 B/param <= host; binding: {r['static_binding']}",
    )
    console.print(table)
    ratio = f"{r['ratio']:.2f}" if r["ratio"] else "-"
    console.print(
        f"ratio ours/static {ratio}; search resolution {r['resolution_layers']} layer(s); "
        f"{len(r['trials'])} trials, {r['seconds_per_trial']:.0f} s per trial, "
        f"{r['seconds']:.0f} s in all; load avg before {r['load_avg']['before']}, after "
        f"{r['load_avg']['after']}"
    )
    for t in r["trials"]:
        console.print(
            f"  {t['layers']:>3} layers {t['params'] / 1e6:7.1f}M: "
            + ("ok" if t["ok"] else f"failed ({t['error']})")
            + f", {t.get('seconds') or 0:.0f} s"
        )


if __name__ == "__main__":
    run_scale(json_out=True)
