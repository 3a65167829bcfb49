"""The acceptance run of the engine on one GPU, in at most 7 minutes.

    PYTHONPATH=. python scripts/gpu_check.py --out DIR                  # on the GPU machine
    PYTHONPATH=. python scripts/gpu_check.py --device fakegpu --out DIR # anywhere: CI runs it

It needs torch, numpy, safetensors, psutil, pyyaml and rich (a CUDA image has them) and
pydantic, which such an image may lack: it looks in `.gpu-deps/` (`--deps`), which
`bash scripts/gpu_deps.sh` fills on a machine with PyPI for the GPU machine's Python, and
says so before anything runs if pydantic is still missing. Nothing is installed.

Each stage runs in a process of its own under its own time limit (a hung CUDA call or
collective is killed, and the stage reports a timeout with its last output), and
`DIR/gpu_check.json` is written after every stage, so a run cut short still reports:

- env: torch, CUDA, NCCL, the GPU; which collective and stream names this torch has;
  pinned and pageable host<->device GB/s; page-locking (cudaHostRegister) GB/s; the host
  AdamW kernel built or not, and its choice against torch's fused AdamW;
- doctor: `pstar doctor --gpu`'s one-GPU checks (placement, parity, tracer against the
  allocator, overlap, device Adam), each within 60 s;
- budgets: a ~1B zoo GPT in bf16 under two device budgets, the device limited to each
  with `set_per_process_memory_fraction`: (a) N + P/2, params evicted to the pinned host
  in forward and backward, all Adam on the host; (b) N + P + room for two chunks'
  optimizer states, Adam split between device and host; and (a) again with
  `backward_and_step` (host Adam beside backward: the same losses, and its speed-up).
  Each: the moves, reserved peak against the limit, allocator retries, the tracer's N_i
  against the allocator sampled at every operator, the init peak per parameter, TFLOPS;
- baselines: the same model, data and seed as plain PyTorch (bf16 params, fp32 masters,
  fused AdamW on the GPU), as the engine with no budget, and as FSDP2 with CPU offload on
  one rank: TFLOPS and loss curves against plain PyTorch;
- resume: a checkpoint after step 2 and a fresh process that loads it: steps 3-4 bitwise,
  with Adam on the same chunks of each tier; a second straight run says whether the
  engine repeats itself at all, and a failure names the first step and chunk that differ;
- nccl: every collective the engine calls, on one NCCL rank, with its dtypes and
  in-place buffers (a gloo flag group beside it).

On `--device fakegpu` (the test suite's second device) every stage executes on small
models and every figure a fake device cannot give (GB/s, TFLOPS, retries) says "n/a".
The last line printed is the whole result as one JSON object. This script runs the
stages and writes the report; the stages are `benchmarks/gpu_stages.py`.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("env", "doctor", "budgets", "baselines", "resume", "nccl")
# opt-in (`--stages ...,profile`): where an engine step's time goes (benchmarks/gpu_profile.py)
EXTRA_STAGES = ("profile",)
# each stage's time limit in seconds: 8 minutes in all
# (on an H200, in 2026-11: env 25 s, doctor 17, budgets 66 with two runs and 80 with
# three, baselines 47, resume 53 with one probe run, 89 and 80 with one in each of its
# three processes (a fourth since), nccl 5, profile 64)
LIMITS = {"env": 60, "doctor": 45, "budgets": 125, "baselines": 75, "resume": 150, "nccl": 25}
LIMITS["profile"] = 100
NEEDED = ("torch", "numpy", "safetensors", "psutil", "yaml", "rich", "pydantic")
# where `scripts/gpu_deps.sh` unpacks what a GPU image lacks; the processes this script
# starts find it here too
DEPS_ENV = "PSTAR_GPU_DEPS"


def missing_modules() -> list[str]:
    return [m for m in NEEDED if importlib.util.find_spec(m) is None]


def add_deps(deps: Path) -> None:
    """Where a needed module is missing, put the unpacked wheels of `scripts/gpu_deps.sh`
    at the end of the path (what is installed comes first; each stage does the same)."""
    if missing_modules() and deps.is_dir() and str(deps) not in sys.path:
        sys.path.append(str(deps))


# ---------------------------------------------------------------------------------------
# A child: one stage (see benchmarks/gpu_stages.py)
# ---------------------------------------------------------------------------------------


def run_stage(name: str, device: str, out: Path) -> None:
    """The child side: run one stage and write its result (a crash is a failed stage)."""
    start = time.perf_counter()
    try:
        from benchmarks import gpu_stages
        from benchmarks.gpu_common import open_device

        dev = open_device(device)
        result = gpu_stages.STAGE_FUNCTIONS[name](device, dev)
        payload = {"status": result.status, "numbers": result.numbers, "detail": result.detail}
    except Exception as e:
        tb = traceback.format_exc().strip().splitlines()
        detail = f"{type(e).__name__}: {e} at {tb[-4:]}"
        payload = {"status": "fail", "numbers": {}, "detail": detail}
    payload["seconds"] = round(time.perf_counter() - start, 1)
    (out / "stages").mkdir(parents=True, exist_ok=True)
    (out / "stages" / f"{name}.json").write_text(json.dumps(payload, default=str))


# ---------------------------------------------------------------------------------------
# The parent: stages in order, each in its own process under its own limit
# ---------------------------------------------------------------------------------------


def _tail(text: str | bytes | None, n: int = 1500) -> str:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return (text or "")[-n:]


def run_all(device: str, out: Path, stages: list[str], print_table: bool = True) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"device": device, "stages": {}, "started": time.time()}
    path = out / "gpu_check.json"
    t0 = time.perf_counter()
    for name in stages:
        started = time.perf_counter()
        stage_file = out / "stages" / f"{name}.json"
        stage_file.unlink(missing_ok=True)
        cmd = [sys.executable, __file__, "--device", device, "--out", str(out), "--stage", name]
        print(f"gpu_check: {name} (limit {LIMITS[name]} s) ...", file=sys.stderr, flush=True)
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=LIMITS[name])
            output = proc.stdout + proc.stderr
            if stage_file.is_file():
                entry = json.loads(stage_file.read_text())
            else:
                entry = {"status": "fail", "numbers": {}, "detail": f"exit {proc.returncode}"}
            if entry["status"] == "fail":
                entry["output_tail"] = _tail(output)
        except subprocess.TimeoutExpired as e:
            entry = {
                "status": "timeout",
                "numbers": {},
                "detail": f"killed after its {LIMITS[name]} s limit",
                "output_tail": _tail(e.stdout) + _tail(e.stderr),
            }
        entry["wall_s"] = round(time.perf_counter() - started, 1)
        report["stages"][name] = entry
        report["passed"] = [k for k, v in report["stages"].items() if v["status"] == "pass"]
        report["failed"] = [k for k, v in report["stages"].items() if v["status"] != "pass"]
        report["seconds"] = round(time.perf_counter() - t0, 1)
        path.write_text(json.dumps(report, indent=1, default=str))
        print(f"gpu_check: {name}: {entry['status']} in {entry['wall_s']} s", file=sys.stderr)
    report["throughput"] = throughput_table(report)
    path.write_text(json.dumps(report, indent=1, default=str))
    if print_table:
        show(report)
    return report


def throughput_table(report: dict) -> list[dict[str, Any]]:
    """TFLOPS of every configuration measured, and each step time against plain PyTorch."""
    rows = []
    base = report["stages"].get("baselines", {}).get("numbers", {})
    plain = base.get("plain_torch", {}).get("step_s")
    for key in ("plain_torch", "engine_no_budget", "fsdp2_cpu_offload"):
        if key in base:
            rows.append({"run": key, "tflops": base[key]["tflops"], "step_s": base[key]["step_s"]})
    budgets = report["stages"].get("budgets", {}).get("numbers", {})
    for key in ("a_params_evicted", "b_adam_split", "a_adam_beside"):
        if key in budgets:
            rows.append(
                {
                    "run": f"engine {key}",
                    "tflops": budgets[key]["tflops"],
                    "step_s": budgets[key]["step_s"],
                }
            )
    for r in rows:
        r["step_time_vs_plain"] = round(r["step_s"] / plain, 3) if plain else None
    return rows


def show(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(stderr=True)
    table = Table(title=f"gpu_check on {report['device']}")
    for col in ("stage", "status", "seconds", "detail"):
        table.add_column(col)
    for name, s in report["stages"].items():
        style = "green" if s["status"] == "pass" else "red"
        table.add_row(name, f"[{style}]{s['status']}", str(s["wall_s"]), s.get("detail", "")[:120])
    console.print(table)
    if report["throughput"]:
        t = Table(title="throughput (model FLOPs, median step)")
        for col in ("run", "TFLOPS", "step s", "step time / plain PyTorch's"):
            t.add_column(col)
        for r in report["throughput"]:
            t.add_row(r["run"], str(r["tflops"]), str(r["step_s"]), str(r["step_time_vs_plain"]))
        console.print(t)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out", type=Path, default=Path("runs/gpu-check"), help="where gpu_check.json goes"
    )
    parser.add_argument("--device", default="cuda", help="cuda (default) or fakegpu")
    parser.add_argument("--stages", default=",".join(STAGES), help="comma-separated subset")
    parser.add_argument(
        "--deps",
        type=Path,
        default=Path(os.environ.get(DEPS_ENV) or ROOT / ".gpu-deps"),
        help="unpacked wheels of what this machine lacks (scripts/gpu_deps.sh)",
    )
    parser.add_argument("--stage", help=argparse.SUPPRESS)  # a child running one stage
    parser.add_argument("--resume-half", nargs=2, help=argparse.SUPPRESS)  # resume's halves
    args = parser.parse_args()
    os.environ[DEPS_ENV] = str(args.deps)  # for the stages' own processes
    add_deps(args.deps)
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    if args.resume_half:
        from benchmarks.gpu_resume import resume_half

        resume_half(args.device, args.resume_half[0], Path(args.resume_half[1]))
        return 0
    if args.stage:
        run_stage(args.stage, args.device, args.out)
        return 0
    stages = [s for s in args.stages.split(",") if s]
    unknown = [s for s in stages if s not in STAGES + EXTRA_STAGES]
    if unknown:
        parser.error(f"unknown stages {unknown}; known: {', '.join(STAGES + EXTRA_STAGES)}")
    missing = missing_modules()
    if missing:
        error = (
            f"missing Python modules: {', '.join(missing)}. On a machine with PyPI run "
            f"`bash scripts/gpu_deps.sh PYTHON_VERSION` (this one's is "
            f"{sys.version_info.major}.{sys.version_info.minor}): it unpacks them into "
            f"{args.deps}, which this script puts on the path; copy that folder here"
        )
        print(error, file=sys.stderr)
        print(json.dumps({"device": args.device, "error": error, "missing": missing}))
        return 2
    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            error = "torch sees no CUDA device (a CPU build of torch, or no GPU visible)"
            print(error, file=sys.stderr)
            print(json.dumps({"device": args.device, "error": error}))
            return 2
    report = run_all(args.device, args.out, stages)
    print(json.dumps(report, default=str, separators=(",", ":")))
    return 0 if not report["failed"] else 1


if __name__ == "__main__":
    sys.exit(main())
