"""The resume stage of the one-GPU acceptance run (`scripts/gpu_check.py`): a run under
the budget where Adam splits between the device and the host, trained straight, trained
straight again, and stopped after step 2 then resumed from its checkpoint. The three
halves run as processes of their own (`resume_half`, the script's `--resume-half`); their
per-step chunk digests locate the first difference (`first_difference`).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

from benchmarks.doctor import budgets
from benchmarks.gpu_common import (
    Result,
    batches,
    engine_config,
    gpt_config,
    is_cuda,
    open_device,
    probe,
    run_engine,
    sizes_for,
)

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.py"
HALF_SECONDS = 60  # each process of the stage (four, each with its probe run; one may build Adam)


# the extra memory settings of every process of the stage (JSON), to investigate a failure
# (with prefetch off, say): `PSTAR_GPU_CHECK_RESUME_MEMORY='{"prefetch_moments": 0}'`
RESUME_MEMORY_ENV = "PSTAR_GPU_CHECK_RESUME_MEMORY"
# "1": also note each chunk's gradient as Adam reads it (a host sync before each chunk's
# Adam, which changes the step's timing: for investigating, not by default)
RESUME_GRADS_ENV = "PSTAR_GPU_CHECK_RESUME_GRADS"
STATE_KINDS = ("param", "param_fp32", "momentum", "variance")


def _digest(t, slots=None) -> str:
    """A short digest of `t`'s bytes, or of only the regions of `slots` in it: the rest of
    a chunk (its unused tail) is memory no tensor lives in, which a fresh device buffer
    leaves as it found it."""
    import torch

    flat = t.detach().view(-1)
    if slots is not None:
        flat = torch.cat([flat[s.offset : s.end] for s in slots]) if slots else flat[:0]
    data = flat.cpu().contiguous().view(torch.uint8).numpy()
    return hashlib.sha256(data).hexdigest()[:12]


def _chunk_states(engine, device_adam: list[int]) -> dict[str, dict[str, str]]:
    """After a step whose Adam ran on the device for `device_adam`: each trainable
    chunk's tier of Adam and digests of its states: of the tensors in it (by kind) and of
    the whole buffer (`KIND+unused`, which differs alone when only the unused tail does)."""
    from pstar_core.chunk import ChunkType

    m = engine.manager
    out = {}
    for c in m.own_chunks([ChunkType.PARAM]):
        seen = {"adam": "device" if c.index in device_adam else "host"}
        for kind in STATE_KINDS:
            chunks = m.lists[ChunkType(kind)]
            if c.index < len(chunks):
                payload = m.residency.in_memory(chunks[c.index]).payload
                seen[kind] = _digest(payload, c.slots)  # the four lists are aligned
                seen[f"{kind}+unused"] = _digest(payload)
                seen[f"{kind}@"] = str(chunks[c.index].tier)
        out[str(c.index)] = seen
    return out


def _trace_grads(engine, grads: list[dict[str, str]]) -> None:
    """Note each chunk's gradient as its Adam reads it, in `grads[-1]` (RESUME_GRADS_ENV)."""
    opt = engine.optimizer
    adam = opt._adam

    def traced(i, chunk, segs, *settings):
        grads[-1][str(i)] = _digest(opt._grad_source(i).payload, chunk.slots)
        adam(i, chunk, segs, *settings)

    opt._adam = traced


def resume_half(device: str, half: str, work: Path) -> None:
    """One process of the resume stage: "a" trains 4 steps and checkpoints after step 2,
    "a2" trains the same 4 steps again (is a straight run repeatable?), "b" loads the
    checkpoint and trains steps 3-4, "c" trains the 4 steps with `backward_and_step` (host
    Adam beside backward: bitwise the same as "a", with deterministic kernels). Each
    writes what it saw, with each chunk's states after every step (`_chunk_states`), with
    RESUME_GRADS_ENV its gradients, and the warnings it raised (torch names there the
    operations it cannot make deterministic)."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        result = _half(device, half, work)
    result["warnings"] = sorted({f"{w.category.__name__}: {w.message}"[:300] for w in seen})
    (work / f"{half}.json").write_text(json.dumps(result))


def _half(device: str, half: str, work: Path) -> dict[str, Any]:
    import torch

    torch.use_deterministic_algorithms(True, warn_only=True)
    dev = open_device(device)
    if is_cuda(dev):  # attention's plain path: the fused kernels' backward may use atomics
        torch.backends.cuda.enable_flash_sdp(False)
        torch.backends.cuda.enable_mem_efficient_sdp(False)
        # cuDNN's too: torch 2.11 picks it on an H200 and warns that its backward is not
        # deterministic (two straight runs differed in a chunk's gradient at step 3)
        getattr(torch.backends.cuda, "enable_cudnn_sdp", lambda _on: None)(False)
    import pstar_core
    from pstar_core.chunk import ChunkType
    from pstar_core.models import build

    sizes = sizes_for(device)
    cfg = gpt_config(sizes.resume_model, sizes.seq)
    data = batches(cfg, sizes, 4, seed=1)
    # Every half runs the probe first, though only "a" needs its budget (Adam on both
    # tiers): an engine's placement comes from what its own trace measures, which a run
    # before it in the process may change. On an H200 a straight run without one differed
    # from "a" (at step 3, the first step compared then); with the probe in every half,
    # the runs repeated bitwise.
    budget = budgets(probe(cfg, data[:2], device, dev), dev)["adam_split"]
    if half == "a":
        (work / "budget.json").write_text(json.dumps(budget))
    budget = json.loads((work / "budget.json").read_text())
    memory = {"device_budget": budget, **json.loads(os.environ.get(RESUME_MEMORY_ENV) or "{}")}
    torch.manual_seed(0)
    engine = pstar_core.initialize(lambda: build(cfg), engine_config(device, memory))
    steps: list[dict[str, Any]] = []  # per step: each chunk's states after it
    grads: list[dict[str, str]] = []  # per step: each chunk's gradient (RESUME_GRADS_ENV)
    if os.environ.get(RESUME_GRADS_ENV) == "1":
        _trace_grads(engine, grads)
    tiers = {}
    beside: list[int] = []  # chunks whose Adam ran beside backward, per step ("c")

    def run(batch: list, first: int) -> list[float]:
        losses = []
        for k, x in enumerate(batch):
            tiers[first + k] = sorted(engine.manager.device_adam)
            grads.append({})
            losses += run_engine(engine, [x], dev, warmup=1, beside=half == "c").losses
            beside.append(engine.stats()["adam_beside_backward_chunks"])
            steps.append(_chunk_states(engine, tiers[first + k]))
        return losses

    if half == "b":
        engine.load_checkpoint(work / "ckpt")
        first = []
        steps += [{}, {}]  # steps 1-2 ran in "a"
        grads += [{}, {}]
    else:
        first = run(data[:2], 1)
        if half == "a":
            engine.save_checkpoint(work / "ckpt")
    last = run(data[2:], 3)
    m = engine.manager
    digest = hashlib.sha256()
    for kind in (ChunkType.PARAM_FP32, ChunkType.MOMENTUM, ChunkType.VARIANCE):
        for c, own in zip(m.lists[kind], m.lists[ChunkType.PARAM], strict=False):
            digest.update(_digest(m.residency.in_memory(c).payload, own.slots).encode())
    for name, t in sorted(engine.state_dict().items()):
        digest.update(name.encode())
        digest.update(t.contiguous().view(torch.uint8).numpy())
    result = {
        "first": first,
        "last": last,
        "device_adam_before_step": tiers,
        "own_chunks": len(m.lists[ChunkType.PARAM]),
        "state_sha256": digest.hexdigest(),
        "states": steps,
        "grads": grads,
        "budget": budget,
        "adam_beside_backward_chunks": beside,
    }
    engine.close()
    return result


def first_difference(x: dict[str, Any], y: dict[str, Any]) -> str:
    """Where two halves first differ, over the steps both recorded (a resumed half has
    steps 3-4 only): the step, the chunk (its Adam's tier in each) and what: its gradient
    (when traced: before the update) or a state after it, and any state held on another
    tier in one than in the other."""
    unused = []
    for step in range(1, min(len(x["states"]), len(y["states"])) + 1):
        gx, gy = x["grads"][step - 1], y["grads"][step - 1]
        sx, sy = x["states"][step - 1], y["states"][step - 1]
        for chunk in sorted(set(sx) & set(sy), key=int):
            cx, cy = sx[chunk], sy[chunk]
            where = f"step {step}, chunk {chunk} (Adam on {cx.get('adam')} vs {cy.get('adam')})"
            if gx.get(chunk) != gy.get(chunk):
                return f"{where}: its gradient"
            differ = [k for k in STATE_KINDS if cx.get(k) != cy.get(k)]
            if differ:
                moved = [
                    f"{k} on {cx.get(k + '@')} vs {cy.get(k + '@')}"
                    for k in STATE_KINDS
                    if cx.get(k + "@") != cy.get(k + "@")
                ]
                held = f" ({'; '.join(moved)})" if moved else ""
                return f"{where}: {', '.join(differ)} after the step{held}"
            tails = [k for k in STATE_KINDS if cx.get(f"{k}+unused") != cy.get(f"{k}+unused")]
            unused += [f"{where}: {k}" for k in tails]
    if unused:  # not a difference in training: memory no tensor lives in
        return f"every chunk's tensors are the same; only unused tails differ ({unused[0]})"
    return "every chunk's states after every step both ran are the same"


def stage_resume(device: str, dev) -> Result:
    env = {
        **os.environ,
        "CUBLAS_WORKSPACE_CONFIG": ":4096:8",  # before CUDA starts: deterministic cuBLAS
    }
    results = {}
    with tempfile.TemporaryDirectory(prefix="pstar-resume-") as tmp:
        for half in ("a", "a2", "b", "c"):
            proc = subprocess.run(
                [sys.executable, str(SCRIPT), "--device", device, "--resume-half", half, tmp],
                env=env,
                capture_output=True,
                text=True,
                timeout=HALF_SECONDS,
            )
            if proc.returncode != 0:
                return Result("fail", {}, f"half {half}: {(proc.stdout + proc.stderr)[-1500:]}")
            results[half] = json.loads(Path(tmp, f"{half}.json").read_text())
    a, a2, b, c = results["a"], results["a2"], results["b"], results["c"]
    numbers = {
        "losses_straight": a["last"],
        "losses_resumed": b["last"],
        "same_state": a["state_sha256"] == b["state_sha256"],
        "straight_repeats": a["state_sha256"] == a2["state_sha256"] and a["last"] == a2["last"],
        "device_adam_chunks": len(a["device_adam_before_step"]["3"]),
        "own_chunks": a["own_chunks"],
        "warnings": sorted({w for r in results.values() for w in r["warnings"]}),
        # the chunks whose Adam ran on the device, before each step, in each half
        "device_adam_by_step": {h: r["device_adam_before_step"] for h, r in results.items()},
        # "c": the straight run with host Adam beside backward (backward_and_step)
        "beside_repeats": a["state_sha256"] == c["state_sha256"] and a["last"] == c["last"],
        "beside_chunks_by_step": c["adam_beside_backward_chunks"],
        "same_device_adam": all(
            a["device_adam_before_step"][k] == b["device_adam_before_step"][k] for k in ("3", "4")
        ),
    }
    problems = []
    if not numbers["straight_repeats"]:
        problems.append(f"two straight runs differ: {first_difference(a, a2)}")
    if a["last"] != b["last"]:
        problems.append("steps 3-4 differ after resuming")
    if not numbers["beside_repeats"]:
        problems.append(f"Adam beside backward differs: {first_difference(a, c)}")
    elif not any(numbers["beside_chunks_by_step"]):
        problems.append("no chunk's Adam ran beside backward")
    if not numbers["same_state"]:
        problems.append("the chunks or the state dict differ after step 4")
    if a["last"] != b["last"] or not numbers["same_state"]:
        problems.append(f"first: {first_difference(a, b)}")
    if not numbers["same_device_adam"]:
        problems.append("the resumed run ran Adam on other chunks")
    if not 0 < numbers["device_adam_chunks"] < numbers["own_chunks"]:
        problems.append("Adam did not run on both tiers")
    return Result("fail" if problems else "pass", numbers, "; ".join(problems))
