"""Chunk-based ZeRO-DP on CPU: our engine vs. FSDP2 (and DeepSpeed ZeRO-3), and chunked comm.

`run_zero` trains the same zoo GPT with a global batch split over ranks and times the
steps of

- ours, 1 rank with the global batch (2 torch threads: the whole machine);
- ours, 2 gloo ranks, "collective" variant (1 thread each);
- FSDP2 (`fully_shard` on every block, then the root; params cast to the dtype, fp32
  gradient reduction; foreach AdamW), 2 gloo ranks x 1 thread;
- DeepSpeed ZeRO-3 with parameter and optimizer CPU offload, its bf16/fp16 section for
  the dtype (neither in fp32), 2 gloo ranks x 1 thread, when `import deepspeed` works (it
  is not a project dependency).

All run in one dtype (`--dtype`, default auto: what the engine picks on this CPU); each
run reports what its first linear layer was seen computing in, and per rank
`init_peak_bytes`: how far the rank's peak resident memory rose while its model was set
up (ours: across `pstar_core.initialize`, where a rank materializes only its own share;
the peers: building and wrapping the model), see `benchmarks.report.peak_rss_growth`.

Every configuration runs in fresh worker processes (`benchmarks.zero_worker`) started here,
torchrun-style (MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE in the environment). Ranks meet at a barrier
before each step, so a step's time is the slowest rank's; the median over the timed
steps after warm-up is reported.

Communication volume. Per rank and step our engine counts (N-1) x chunk bytes for each
all-gather and each reduce-scatter it joins. Each param chunk is all-gathered once in
forward and once in backward and its gradient reduce-scattered once, so with P the bytes
of the whole padded param chunk list (`manager.lists[PARAM]`, nproc chunks per group) and
F that of the frozen list (gathered twice, never reduced):

    theory_bytes = (2 + 1) x (N - 1) / N x P  +  2 x (N - 1) / N x F

`comm_bytes` is the engine's own counter over the timed steps ÷ steps (`comm_calls`: per
collective). Independently, every worker wraps torch.distributed's collectives and counts
what is really handed to them: per collective, the calls and the bytes of the tensors
given to send and to receive into, as passed, with no model of the algorithm
(`wire`, per step). From those the ring algorithm's share each rank sends, the model the
engine's counter uses (see [Note: bytes sent] in pstar_core/zero.py), gives
`comm_bytes_wire` and the FSDP2/DeepSpeed byte columns.

`run_collectives` isolates the communication pattern: the bytes of a GPT's parameters (in
the dtype) are all-gathered over 2 gloo ranks either as chunk-sized all-gathers (the
engine's chunk size from `make_plan`, each rank contributing one chunk per group) or as
one all-gather per parameter tensor (each rank contributing 1/N of it), runs interleaved.

    python -m benchmarks.zero              # run_zero(json_out=True)
    pstar bench zero --json; pstar bench collectives --json
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from benchmarks.report import (
    bench_dtype,
    finish,
    load_avg,
    machine,
    median,
)

__all__ = ["run_collectives", "run_zero"]

ROOT = Path(__file__).resolve().parents[1]
OURS_1, OURS_2, FSDP2, DEEPSPEED = (
    "ours 1 rank",
    "ours 2 ranks",
    "FSDP2 2 ranks",
    "DeepSpeed 2 ranks",
)
_TIMEOUT_S = 1800  # a DeepSpeed first run JIT-compiles its CPU Adam (a minute or more)


# -- launching ------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def deepspeed_available() -> bool:
    """Whether workers can `import deepspeed` (looked up without importing it here)."""
    return importlib.util.find_spec("deepspeed") is not None


def _launch(kind: str, world: int, threads: int, spec: dict[str, Any]) -> list[dict[str, Any]]:
    """Run `kind` in `world` fresh worker processes; returns each rank's result dict.

    Output goes to files, not pipes: DeepSpeed logs a lot, and a full pipe of one rank
    would block it inside a collective while we wait on the other.
    """
    with tempfile.TemporaryDirectory(prefix="pstar-bench-zero-") as tmp:
        out = Path(tmp)
        path = os.environ.get("PYTHONPATH", "")
        env = {
            **os.environ,
            "PYTHONPATH": str(ROOT) + (os.pathsep + path if path else ""),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(_free_port()),
            "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world),
            "OMP_NUM_THREADS": str(threads),
        }
        if kind == "deepspeed":
            env["DS_ACCELERATOR"] = "cpu"
            env.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_extensions"))
        spec = {**spec, "threads": threads}
        procs, logs = [], []
        for r in range(world):
            log = (out / f"log-{r}.txt").open("w")
            logs.append(log)
            cmd = [sys.executable, "-m", "benchmarks.zero_worker", "--worker", kind]
            cmd += ["--spec", json.dumps(spec), "--out", str(out)]
            rank_env = {**env, "RANK": str(r), "LOCAL_RANK": str(r)}
            procs.append(
                subprocess.Popen(cmd, cwd=ROOT, env=rank_env, stdout=log, stderr=subprocess.STDOUT)
            )
        deadline = time.monotonic() + _TIMEOUT_S
        try:
            for p in procs:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
                p.wait()
            raise RuntimeError(f"{kind} workers timed out after {_TIMEOUT_S} s") from None
        finally:
            for log in logs:
                log.close()
        for r, p in enumerate(procs):
            if p.returncode != 0:
                # one rank's crash makes the other fail too; show the first failing rank
                text = (out / f"log-{r}.txt").read_text(errors="replace")
                raise RuntimeError(f"{kind} rank {r} exited with {p.returncode}:\n{text[-3000:]}")
        return [json.loads((out / f"result-{r}.json").read_text()) for r in range(world)]


# -- parent side --------------------------------------------------------------------------


def _stepmedian(ranks: list[dict[str, Any]]) -> float:
    """Median over steps of the slowest rank's time (ranks start each step together)."""
    return median([max(ts) for ts in zip(*(r["times"] for r in ranks), strict=True)])


def _fmt_bytes(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**20:,.1f} MiB"


def run_zero(
    model: str = "gpt-45m",
    global_batch: int = 4,
    seq: int = 256,
    steps: int = 4,
    warmup: int = 1,
    dtype: str = "auto",
    json_out: bool = False,
    peers: bool | Sequence[str] = True,
    chunk_size: int | None = None,
    agree_per_collective: bool = False,
) -> dict[str, Any]:
    """Time ours (1 and 2 ranks) vs FSDP2 and DeepSpeed ZeRO-3; print a table, return a dict.

    ``ratio_vs_fsdp2`` = ours 2-rank s/step ÷ FSDP2 s/step (< 1: we are faster), likewise
    ``ratio_vs_deepspeed``. ``comm_bytes`` is what one of our ranks sends per step and
    ``theory_bytes`` = 3 x (N-1)/N x (bytes of the padded param chunk list), see the
    module docstring. ``peers=False`` skips FSDP2 and DeepSpeed, a tuple of
    names ("fsdp2", "deepspeed") runs only those (for tests);
    ``chunk_size`` overrides the engine's "auto" choice (elements per chunk). ``dtype``
    is every run's (auto: what the engine picks on this CPU). ``agree_per_collective``:
    our ranks exchange a flag before every collective (`zero.agree_per_collective`), not
    only at the points of their agreed sections.
    """
    from pstar_core.models import get_config, num_params

    dtype = bench_dtype(dtype)
    cfg = get_config(model)
    if seq > cfg.seq_len or seq < 2:
        raise ValueError(f"seq must be in [2, {cfg.seq_len}] for {model}, got {seq}")
    if global_batch < 2 or global_batch % 2:
        raise ValueError(f"global_batch must be even (2 ranks share it), got {global_batch}")
    if steps < 1 or warmup < 0:
        raise ValueError("need steps >= 1 and warmup >= 0")
    spec = {
        "model": model, "global_batch": global_batch, "seq": seq, "steps": steps,
        "warmup": warmup, "dtype": dtype, "chunk_size": chunk_size,
        "agree_per_collective": agree_per_collective,
    }  # fmt: skip
    load_before = load_avg()
    runs: dict[str, list[dict[str, Any]] | str] = {}
    runs[OURS_1] = _launch("ours", 1, 2, spec)
    runs[OURS_2] = _launch("ours", 2, 1, {**spec, "variant": "collective"})
    wanted = {"fsdp2", "deepspeed"} if peers is True else set(peers or ())
    for name, kind in ((FSDP2, "fsdp2"), (DEEPSPEED, "deepspeed")):
        if kind not in wanted:
            continue
        if kind == "deepspeed" and not deepspeed_available():
            runs[name] = "not installed"
            continue
        try:
            runs[name] = _launch(kind, 2, 1, spec)
        except RuntimeError as e:  # a peer failing should not hide our numbers
            runs[name] = f"failed: {str(e).strip().splitlines()[-1][:200]}"
    load_after = load_avg()

    secs = {k: _stepmedian(v) if isinstance(v, list) else None for k, v in runs.items()}
    ours2 = runs[OURS_2]
    assert isinstance(ours2, list)
    fs, ds = secs.get(FSDP2), secs.get(DEEPSPEED)
    result: dict[str, Any] = {
        "model": model,
        "params": num_params(cfg),
        "dtype": dtype,
        "global_batch": global_batch,
        "seq": seq,
        "steps": steps,
        "warmup": warmup,
        "ours_1rank_s": secs[OURS_1],
        "ours_2rank_s": secs[OURS_2],
        "fsdp2_s": fs,
        "deepspeed_s": ds,
        "ratio_vs_fsdp2": secs[OURS_2] / fs if fs else None,
        "ratio_vs_deepspeed": secs[OURS_2] / ds if ds else None,
        "comm_bytes": ours2[0]["comm_bytes"],
        "comm_bytes_per_rank": [r["comm_bytes"] for r in ours2],
        "comm_calls": [r["comm_calls"] for r in ours2],  # per rank: the engine's counter
        "comm_bytes_wire": ours2[0]["comm_bytes_wire"],
        "comm_bytes_flags": ours2[0]["comm_bytes_flags"],
        # a step's time in the flag exchanges, per rank, and its share of the step
        "agree_per_collective": agree_per_collective,
        "flag_exchanges": ours2[0]["comm_calls"].get("failure_flag", {}).get("calls", 0),
        "flag_s": [r["flag_s"] for r in ours2],
        "flag_share": max(r["flag_s"] for r in ours2) / secs[OURS_2],
        "wire": [r["wire"] for r in ours2],  # per rank: what torch.distributed was handed
        "wire_by_call": ours2[0]["wire_by_call"],
        "theory_bytes": ours2[0]["theory_bytes"],
        "param_list_bytes": ours2[0]["param_list_bytes"],
        "comm_vs_theory": ours2[0]["comm_bytes"] / ours2[0]["theory_bytes"],
        "chunk_size": ours2[0]["chunk_size"],
        "param_chunks": ours2[0]["param_chunks"],
        "own_param_chunks": [r["own_param_chunks"] for r in ours2],
        "own_param_used_bytes": [r["own_param_used_bytes"] for r in ours2],
        "peer_bytes": {
            k: v[0]["comm_bytes_wire"] for k, v in runs.items() if k in (FSDP2, DEEPSPEED)
            if isinstance(v, list)
        },
        "peer_wire": {
            k: v[0]["wire"] for k, v in runs.items() if k in (FSDP2, DEEPSPEED)
            if isinstance(v, list)
        },
        # calls per collective function over the whole run (set-up and warm-up included)
        "peer_wire_by_call": {
            k: v[0]["wire_by_call"] for k, v in runs.items() if k in (FSDP2, DEEPSPEED)
            if isinstance(v, list)
        },
        "status": {k: v if isinstance(v, str) else "ok" for k, v in runs.items()},
        "step_times_s": {k: [max(ts) for ts in zip(*(r["times"] for r in v), strict=True)]
                         for k, v in runs.items() if isinstance(v, list)},
        "final_loss": {k: v[0]["losses"][-1] for k, v in runs.items() if isinstance(v, list)},
        # per rank: how far its peak RSS rose while its model was set up
        "init_peak_bytes": {k: [r["init_peak_bytes"] for r in v] for k, v in runs.items()
                            if isinstance(v, list)},
        # modules pstar_core.initialize imported (its first call pays for them in the peak)
        "init_new_modules": ours2[0]["init_new_modules"],
        "compute_dtype_seen": {k: v[0]["compute_dtype_seen"] for k, v in runs.items()
                               if isinstance(v, list)},
        "engine_dtype": ours2[0]["engine_dtype"],
        **machine(dtype),
        "load_avg": {"before": load_before, "after": load_after},
    }  # fmt: skip

    table = Table(
        title=(
            f"chunk ZeRO-DP on CPU (gloo): {model} ({result['params'] / 1e6:.1f}M params), "
            f"{dtype} on CPU {result['cpu_capability']}, global batch {global_batch} x seq "
            f"{seq}, median of {steps} steps after {warmup} warm-up"
        )
    )
    cols = ("run", "threads/rank", "s/step", "ours-2 ÷ row", "bytes sent/step/rank")
    for col in (*cols, "init peak/rank", "computed in"):
        table.add_column(col, justify="left" if col == "run" else "right")
    rows = [OURS_1, OURS_2, FSDP2, DEEPSPEED]
    for name in rows:
        v = runs.get(name, "skipped")
        if isinstance(v, str):
            table.add_row(name, "-", v, "-", "-", "-", "-")
            continue
        s = secs[name]
        sent = v[0]["comm_bytes"] if name.startswith("ours") else v[0]["comm_bytes_wire"]
        init = " / ".join(_fmt_bytes(r["init_peak_bytes"]) for r in v)
        table.add_row(
            name, str(v[0]["threads"]), f"{s:.3f}", f"{secs[OURS_2] / s:.3f}", _fmt_bytes(sent),
            init, v[0]["compute_dtype_seen"] or "-",
        )  # fmt: skip
    table.caption = (
        "init peak/rank: how far each rank's peak RSS rose while its model was set up (ours: "
        f"pstar_core.initialize, which imported {result['init_new_modules']} modules on the "
        "way; peers: building and wrapping the model)"
    )
    console = Console(width=max(Console().width, 160))
    console.print(table)
    console.print(
        f"ours 2 ranks: chunk size {result['chunk_size']:,} elements, "
        f"{result['param_chunks']} param chunks (padded), own per rank "
        f"{result['own_param_chunks']} holding "
        f"{[_fmt_bytes(b) for b in result['own_param_used_bytes']]} of params; comm "
        f"{_fmt_bytes(result['comm_bytes'])}/step (from the tensors torch.distributed was "
        f"handed: {_fmt_bytes(result['comm_bytes_wire'])}, of which "
        f"{result['comm_bytes_flags']:.0f} bytes of failure flags) vs theory 3 x (N-1)/N x "
        f"list = {_fmt_bytes(result['theory_bytes'])} -> x{result['comm_vs_theory']:.3f}; "
        f"{result['flag_exchanges']:.0f} flag exchanges a step "
        f"({'before every collective' if agree_per_collective else 'agreed sections'}) took "
        f"{[round(1000 * s, 1) for s in result['flag_s']]} ms a step per rank "
        f"({100 * result['flag_share']:.1f}% of the step)"
    )
    return finish(console, result, load_before, load_after, json_out)


def run_collectives(
    model: str = "gpt-45m",
    repeats: int = 5,
    json_out: bool = False,
    chunk_size: int | None = None,
    dtype: str = "auto",
) -> dict[str, Any]:
    """Chunk-sized all-gathers vs one per parameter tensor, same bytes, 2 gloo ranks.

    ``ratio`` = chunked throughput ÷ per-tensor throughput (> 1: chunks move faster).
    Rounds are interleaved (chunked, per-tensor, chunked, ...) after one warm-up round;
    each time is the slower rank's, medians are reported. The params are gathered in
    ``dtype`` (auto: what the engine picks on this CPU), chunked as the engine would.
    """
    from pstar_core.models import get_config, num_params

    dtype = bench_dtype(dtype)
    cfg = get_config(model)
    if repeats < 1:
        raise ValueError("repeats must be >= 1")
    load_before = load_avg()
    spec = {"model": model, "repeats": repeats, "chunk_size": chunk_size, "dtype": dtype}
    r0 = _launch("collectives", 2, 1, spec)[0]
    load_after = load_avg()
    med = {k: median(v) for k, v in r0["times"].items()}
    gbps = {k: r0["bytes"][k] / med[k] / 1e9 for k in med}
    result: dict[str, Any] = {
        "model": model,
        "params": num_params(cfg),
        "chunk_size": r0["chunk_size"],
        "calls": r0["calls"],
        "bytes": r0["model_bytes"],
        "bytes_gathered": r0["bytes"],
        "chunked_s": med["chunked"],
        "per_tensor_s": med["per_tensor"],
        "chunked_gbps": gbps["chunked"],
        "per_tensor_gbps": gbps["per_tensor"],
        "ratio": gbps["chunked"] / gbps["per_tensor"],
        "times_s": r0["times"],
        "gathered_ok": r0["gathered_ok"],
        "repeats": repeats,
        "dtype": dtype,
        **machine(dtype),
        "load_avg": {"before": load_before, "after": load_after},
    }
    table = Table(
        title=(
            f"all-gather of {model}'s {dtype} params ({_fmt_bytes(r0['model_bytes'])}), 2 "
            f"gloo ranks x 1 thread, CPU {result['cpu_capability']}, median of {repeats} "
            "interleaved rounds"
        )
    )
    for col in ("pattern", "calls", "bytes gathered", "s", "GB/s", "÷ per-tensor"):
        table.add_column(col, justify="left" if col == "pattern" else "right")
    labels = {
        "chunked": f"chunks of {r0['chunk_size']:,} elements",
        "per_tensor": "one per parameter tensor",
    }
    for k, label in labels.items():
        table.add_row(
            label,
            str(r0["calls"][k]),
            _fmt_bytes(r0["bytes"][k]),
            f"{med[k]:.4f}",
            f"{gbps[k]:.3f}",
            f"{gbps[k] / gbps['per_tensor']:.3f}",
        )
    console = Console(width=max(Console().width, 110))
    console.print(table)
    return finish(console, result, load_before, load_after, json_out)


if __name__ == "__main__":
    run_zero(json_out=True)
