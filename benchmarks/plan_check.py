"""The capacity planner checked against this engine, on this machine (outside the engine's
package: it trains models to measure them).

- The activation model (`capacity.activation_peak_bytes`) is calibrated on the tracer's
  peak non-model bytes of real steps; the measurements ship in
  `data/activation_calibration.json` (`calibrate` measures them again) and
  `calibration_error` states the fit.
- The forecast of an iteration (`capacity.tensors_forecast`: device and host peaks, bytes
  moved each way) is checked against the engine's own stats with CPU budgets standing in
  for the GPU and host tiers (`check_split`), for three zoo models under three budget
  splits (`VALIDATION`, `SPLITS`): a device that holds everything (Adam on it), one that
  holds the param chunks but not the optimizer states, and the least device memory the
  forecast says the iteration runs in (plus 5%), where chunks are evicted in forward and
  backward.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from pstar_core.capacity import Workload, activation_peak_bytes, tensors_forecast, zoo_tensors
from pstar_core.mapping import BYTES_PARAM, make_plan

# the measurements the activation model (`capacity.activation_peak_bytes`) is fitted to
CALIBRATION = Path(__file__).with_name("data") / "activation_calibration.json"


def calibration_error(min_params: int = 1_000_000) -> dict[str, float]:
    """How far `activation_peak_bytes` is from the shipped tracer measurements: the largest
    and the median of |predicted / measured - 1|, over the models of at least `min_params`
    parameters (the tiny presets' peaks are dominated by what no formula of the shape
    sees)."""
    from statistics import median

    from pstar_core.models import get_config, num_params

    errors = []
    for r in json.loads(CALIBRATION.read_text())["rows"]:
        cfg = get_config(r["model"])
        if num_params(cfg) < min_params:
            continue
        act = BYTES_PARAM[r.get("dtype", "fp32")]
        got = activation_peak_bytes(
            cfg.hidden_size, cfg.num_layers, cfg.vocab_size, r["batch"], r["seq"], r["ckpt"], act
        )
        errors.append(abs(got / r["measured"] - 1))
    return {"max": max(errors), "median": median(errors), "points": len(errors)}


def measure_peak(model: str, batch: int, seq: int, checkpointing: bool, dtype: str = "fp32") -> int:
    """The tracer's peak non-model bytes of one step of a zoo GPT on this engine."""
    import torch

    import pstar_core
    from pstar_core.models import GPT, get_config

    cfg = get_config(model)

    def build():
        m = GPT(cfg)
        if checkpointing:
            m.gradient_checkpointing_enable()
        return m

    config = {"dtype": dtype, "chunk_size": "auto", "optimizer": {"lr": 1e-4}}
    engine = pstar_core.initialize(build, config)
    x = torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    engine.backward(engine(input_ids=x, labels=x).loss)
    engine.step()
    return int(engine.stats()["tracer"]["peak_non_model_bytes"])


GRID = [  # (model, checkpointing, batch, seq, dtype) of the shipped calibration
    (m, c, b, s, "fp32")
    for m, seqs in (("gpt-tiny", (32, 64)), ("gpt-small", (32, 128)), ("gpt-45m", (32, 128)))
    for c in (False, True)
    for b in (2, 8)
    for s in seqs
] + [  # bf16 (on a CPU without native bf16 these steps are slow, not different)
    (m, c, 8, s, "bf16")
    for m in ("gpt-small", "gpt-45m")
    for c in (False, True)
    for s in (128, 256)
]


def calibrate() -> dict[str, float]:
    """Measure every point of `GRID` on this machine, rewrite `CALIBRATION`, and return
    the fit's error on the new data (`pstar calibrate-activations`)."""
    import platform

    import torch

    rows = []
    for model, ckpt, batch, seq, dtype in GRID:
        peak = measure_peak(model, batch, seq, ckpt, dtype)
        rows.append(
            {"model": model, "ckpt": ckpt, "batch": batch, "seq": seq, "dtype": dtype,
             "measured": peak}
        )  # fmt: skip
    doc = json.loads(CALIBRATION.read_text())
    doc["measured_on"] = (
        f"{platform.machine()}, torch {torch.__version__}, "
        f"{torch.backends.cpu.get_cpu_capability()}"
    )
    doc["rows"] = rows
    CALIBRATION.write_text(json.dumps(doc, indent=1) + "\n")
    return calibration_error()


# (model, chunk size) of the forecast check: chunks as small as the embedding allows, so
# the smaller models have several to evict
VALIDATION = (("gpt-tiny", 32768), ("gpt-small", "auto"), ("gpt-45m", 25731584))
VALIDATION_WORK = Workload(batch=2, seq=64, activation_checkpointing=False, dtype="fp32")
SPLITS = ("roomy", "params", "tight")
CHECKED = ("device_peak_bytes", "host_peak_bytes", "host_to_device_bytes", "device_to_host_bytes")


def resolved_chunk(model: str, chunk_size: int | str, work: Workload = VALIDATION_WORK) -> int:
    return _plan(model, chunk_size, work).chunk_size


def _plan(model: str, chunk_size: int | str, work: Workload):
    t = zoo_tensors(model)
    return make_plan(t.numels, t.trainable, t.names, work.dtype, chunk_size)


def cpu_forecast(model: str, device: int, chunk: int, work: Workload = VALIDATION_WORK):
    """The forecast of one rank of a zoo model with CPU budgets for its tiers."""
    return tensors_forecast(zoo_tensors(model), device, 1, work, chunk, accelerator=False)


def split_budgets(model: str, chunk: int, split: str, work: Workload = VALIDATION_WORK):
    """(device, host) budgets in bytes of one split, from the forecast's own figures."""
    whole = cpu_forecast(model, 1 << 50, chunk, work)
    one = chunk * BYTES_PARAM[work.dtype]
    params = int(_plan(model, chunk, work).list_stats()["param"]["bytes"])
    host = 2 * whole.device_chunk_peak_bytes
    if split == "roomy":  # everything, Adam included, on the device
        return 2 * (whole.non_model_peak_bytes + whole.device_chunk_peak_bytes), host
    if split == "params":  # the param chunks, and half an optimizer-state triple spare
        return whole.non_model_peak_bytes + params + one // 2 + 6 * chunk, host
    if split == "tight":
        return whole.least_device_bytes * 105 // 100, host
    raise ValueError(f"unknown split {split!r}; one of {SPLITS}")


def measure_iteration(
    model: str, chunk: int, device: int, host: int, work: Workload = VALIDATION_WORK
) -> dict[str, int]:
    """The engine's figures of its third iteration (the first to follow a trace) of a
    zoo GPT on the CPU under these budgets."""
    import torch

    import pstar_core
    from pstar_core.models import GPT, get_config

    cfg = get_config(model)
    config = {
        "dtype": work.dtype,
        "chunk_size": chunk,
        "optimizer": {"lr": 1e-4},
        "memory": {"device_budget": device, "host_budget": host},
    }
    engine = pstar_core.initialize(lambda: GPT(cfg), config)
    seq = work.seq or cfg.seq_len
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.vocab_size, (work.batch, seq), generator=g)
    for _ in range(3):
        engine.backward(engine(input_ids=x, labels=x).loss)
        engine.step()
    s = engine.stats()
    moved = s["bytes_moved_last_iteration"]
    return {
        "device_peak_bytes": s["tracer"]["peak_device_bytes_last_iteration"],
        "host_peak_bytes": s["tiers"]["host"]["peak_last_iteration"],
        "host_to_device_bytes": moved.get("host->device", 0),
        "device_to_host_bytes": moved.get("device->host", 0),
    }


MOVED = ("host_to_device_bytes", "device_to_host_bytes")


def _error(predicted: int, measured: int, slack: int) -> float:
    """|predicted / measured - 1| after forgiving `slack` bytes (0 where both are 0)."""
    off = max(0, abs(predicted - measured) - slack)
    if measured:
        return off / measured
    return 0.0 if off == 0 else math.inf


def check_split(model: str, chunk_size: int | str, split: str) -> dict[str, Any]:
    """Forecast and measurement of one model under one split, and their relative error
    per figure (0 where both are 0; bytes moved within one chunk count as exact)."""
    chunk = resolved_chunk(model, chunk_size)
    device, host = split_budgets(model, chunk, split)
    f = cpu_forecast(model, device, chunk).to_json()
    got = measure_iteration(model, chunk, device, host)
    # bytes move in whole chunks: a forecast one chunk off (an eviction the engine's
    # measured room spared, on a model of a few chunks) is as close as it can be
    one = chunk * BYTES_PARAM[VALIDATION_WORK.dtype]
    errors = {k: _error(f[k], got[k], one if k in MOVED else 0) for k in CHECKED}
    return {
        "model": model,
        "split": split,
        "chunk_size": chunk,
        "device_budget": device,
        "host_budget": host,
        "predicted": {k: f[k] for k in CHECKED},
        "measured": got,
        "error": errors,
        "max_error": max(errors.values()),
    }


# The paper's chunk-size table (Evaluation): the chunk size it found per model, in M =
# 2^20 elements, and the utilization it reports (None: not given)
PAPER_CHUNKS = (
    ("gpt-10b", 288, 0.9447),
    ("gpt-15b", 480, 0.9262),
    ("gpt-18b", 312, 0.915),
    ("gpt-20b", 288, None),
    ("gpt-40b", 288, None),
    ("gpt-60b", 416, None),
    ("gpt-68b", 416, None),
)


def chunk_table(dtype: str = "fp16") -> list[dict[str, Any]]:
    """The paper's chunk sizes next to this engine's search (one rank, on `meta`): the
    size it picks and the share of chunk memory its tensors use; and the paper's own size
    applied to the tensors the paper keeps in chunks (its embeddings are not: they live on
    the CPU), for comparison."""
    from pstar_core.mapping import pack

    rows = []
    for model, paper_m, paper_util in PAPER_CHUNKS:
        t = zoo_tensors(model)
        names, numels = t.names, t.numels
        plan = make_plan(numels, [True] * len(numels), names, dtype, "auto")
        blocks = [n for n, name in zip(numels, names, strict=True) if not _embedding(name)]
        rows.append(
            {
                "model": model,
                "params": sum(numels),
                "paper_chunk_m": paper_m,
                "paper_utilization": paper_util,
                "chunk_m": plan.chunk_size / 2**20,
                "utilization": plan.utilization,
                "utilization_at_paper_size": pack(blocks, paper_m * 2**20).utilization,
            }
        )
    return rows


def _embedding(name: str) -> bool:
    return name.split(".")[0] in ("wte", "wpe")


# The paper's model-scale results (Evaluation): (case, GPUs, GiB per GPU, GiB host, the
# largest model it trained, whether that figure was bounded by its throughput bar rather
# than by memory (its 1-GPU maxima), the GPU, and the bar: the TFLOPS per GPU below which
# the paper did not count a model as trained on that cluster)
PAPER_CASES = (
    ("YARD 1 GPU", 1, 32, 240, "gpt-12b", True, "v100", 30),
    ("YARD 8 GPUs", 8, 32, 240, "gpt-18b", False, "v100", 30),
    ("SuperPod 1 GPU", 1, 40, 1024, "gpt-50b", True, "a100", 50),
    ("SuperPod 8 GPUs", 8, 40, 1024, "gpt-68b", False, "a100", 50),
)


def paper_case(case: tuple, batch: int = 8) -> dict[str, Any]:
    """The planner's largest model for one of `PAPER_CASES`, under this engine's rule
    (memory, and the case's TFLOPS bar with its GPU's stated figures) and the paper's
    memory rule, next to the paper's answer. `within_one_step`: where memory bounded the
    paper, ours is within one model of the family of its answer; where its throughput bar
    did, memory and the bar allow at least one model less than it trained (it trained it,
    so ours must not be far below). `within_one_step_strict`: within one model either way."""
    from pstar_core.capacity import GPUS, PAPER_FAMILY, largest, node

    name, gpus, gpu_gib, host_gib, paper, throughput, gpu, bar = case
    hw = node(gpus, gpu_gib, host_gib, speed=GPUS[gpu])
    ours = largest(hw, Workload(batch=batch), min_tflops=bar)
    memory = largest(hw, Workload(batch=batch))
    rule = largest(hw, Workload(batch=batch), rule="paper")
    i, j = PAPER_FAMILY.index(ours["largest_model"]), PAPER_FAMILY.index(paper)
    plan = ours["plan"] or {}
    return {
        "case": name,
        "paper": paper,
        "planner": ours["largest_model"],
        "planner_params": ours["params"],
        "planner_memory_only": memory["largest_model"],
        "planner_paper_rule": rule["largest_model"],
        "gpu": gpu,
        "min_tflops": bar,
        "planner_tflops": plan.get("tflops_per_gpu"),
        "planner_step_s": plan.get("step_seconds"),
        "bounded_by": "throughput" if throughput else "memory",
        "within_one_step": i >= j - 1 if throughput else abs(i - j) <= 1,
        "within_one_step_strict": abs(i - j) <= 1,
        "next_model": ours["next_model"],
        "next_why": ours["next_why"],
    }
