"""The dry run (`POST /v1/fine_tuning/jobs/validate`): what a job would do, storing nothing.

It runs the same checks as create, tokenizes the files as the driver would, and plans the
job with the capacity
planner (`pstar_core.capacity`, as `pstar plan --gpus` does for hardware that is not
here): the chunk plan on the meta device (no weight is allocated) for the requested
number of workers; each rank's chunks per list and tier at start, placed as `initialize`
places them (host memory first; what it cannot hold goes to the device up to its warm-up
share, then to disk); and one iteration forecast: the activations' peak (the planner's
activation model, calibrated on the engine's tracer), the least device memory the
iteration runs in, the device and host peaks and the bytes moved each way. If that does
not fit, it says which tier overflows and by how much, and the smallest change that
would fit (activation checkpointing, a smaller batch, more workers, LoRA). A LoRA job's
plan is that of the model with its adapters (built with `peft` on meta): the base in the
frozen list at its compute dtype only, the adapters with fp32 masters and Adam state;
`lora` sums it up.

It reads a bounded sample, the first `SAMPLE_EXAMPLES` examples of each file, because it
runs in the API process, which every tenant shares: `seq_len` ("auto"), truncation and the
rows are the sample's, the step count is scaled to the whole file, and `data.sampled` says
so. The job prepares the whole files in a Ray task on a worker, where it fails with the
same messages if a later line is the problem.

Budgets given in bytes are exact. A fraction or a default is resolved on the control
plane's host (the machine the embedded local Ray runs on); a GPU's share is resolved on
its worker, so the device side of a GPU job is checked only when its budget is in bytes.
"""

from __future__ import annotations

from typing import Any

from pstar_core.capacity import (
    Hardware,
    Options,
    RankPlan,
    Workload,
    arch_of,
    lists_at_start,
    module_tensors,
    plan_tensors,
    smallest_change,
)
from pstar_core.config import EngineConfig
from pstar_core.mapping import BYTES_OPTIMIZER_STATES, BYTES_PARAM, make_plan
from pstar_core.precision import planned_dtype
from pstar_core.startup import host_disk_shortfall
from pstar_core.tiers import host_whole
from service.control.files import file_path
from service.control.jobs import JobService
from service.data.datasets import DataError
from service.data.prepare import prepare
from service.errors import InvalidRequest
from service.settings import Settings
from service.spec.job import JobSpec
from service.spec.request import JobRequest
from service.store import Store

# what the dry run reads of each file: a bounded look, whatever the file's size
SAMPLE_EXAMPLES = 2000


def validate_job(
    settings: Settings, store: Store, jobs: JobService, tenant: str, req: JobRequest
) -> dict[str, Any]:
    _model, spec = jobs.resolve(tenant, req)
    train = store.files.get(tenant, req.training_file)
    assert train is not None  # resolve found it
    valid = store.files.get(tenant, req.validation_file) if req.validation_file else None
    try:
        prep = prepare(
            spec,
            file_path(settings, train),
            file_path(settings, valid) if valid is not None else None,
            sample=SAMPLE_EXAMPLES,
        )
    except DataError as e:
        raise InvalidRequest(str(e), param="training_file", code="invalid_training_data") from None
    # a DPO step forwards both answers of each of its pairs
    rows_per_example = 2 if prep.format == "preference" else 1
    nodes = getattr(jobs.launcher, "cluster_nodes", lambda: None)()
    memory = estimate_memory(spec, prep.seq_len, len(prep.tokenizer), rows_per_example, nodes)
    tokens_per_step = spec.hyperparameters.batch_size * rows_per_example * prep.seq_len
    problems = list(memory.pop("problems"))
    resources = place_workers(spec.resources.model_dump(), nodes)
    if resources["fits"] is False:
        problems.append(resources["problem"])
    if prep.train.truncated:
        problems.append(
            f"{prep.train.truncated} training example(s) are longer than seq_len {prep.seq_len} "
            "and will be cut (raise hyperparameters.seq_len to keep them whole)"
        )
    fits = memory["fits"] and resources["fits"] is not False
    return {
        "object": "fine_tuning.job.validation",
        "fits": fits,
        "problems": problems,
        "hyperparameters": {**spec.hyperparameters.model_dump(), "seq_len": prep.seq_len},
        "data": prep.report(),
        "estimate": {
            "steps": prep.total_steps,
            "steps_per_epoch": prep.steps_per_epoch,
            "tokens_per_step": tokens_per_step,
            "trained_tokens": prep.total_steps * tokens_per_step,
            **memory,
            "resources": resources,
        },
    }


def place_workers(res: dict[str, Any], nodes: list[dict[str, float]] | None) -> dict[str, Any]:
    """Whether the Ray cluster has room for the workers as asked (each on one node with
    `cpus_per_worker` CPUs, `memory_per_worker` of its memory when given and, with
    `use_gpu`, one GPU). `fits` is None when the cluster did not say; a job that does not
    fit waits `queued` (an autoscaler may add nodes)."""
    want = res["num_workers"]
    out: dict[str, Any] = {"requested": res, "fits": None}
    if not nodes:
        return out
    cpu, gpu = res["cpus_per_worker"], 1 if res["use_gpu"] else 0
    memory = res.get("memory_per_worker")
    strategy = res.get("placement_strategy", "PACK")
    per_node = []
    for n in nodes:
        k = int(n.get("CPU", 0) // cpu) if cpu else want
        if gpu:
            k = min(k, int(n.get("GPU", 0)))
        if memory:
            k = min(k, int(n.get("memory", 0) // memory))
        per_node.append(k)
    if strategy == "STRICT_SPREAD":  # one worker per node at most
        room = sum(1 for k in per_node if k > 0)
    elif strategy == "STRICT_PACK":  # every worker on one node
        room = max(per_node)
    else:
        room = sum(per_node)
    out.update(
        cluster={
            "nodes": len(nodes),
            "CPU": sum(n.get("CPU", 0) for n in nodes),
            "GPU": sum(n.get("GPU", 0) for n in nodes),
            "memory": sum(n.get("memory", 0) for n in nodes),
        },
        placeable_workers=room,
        fits=room >= want,
    )
    if room < want:
        out["problem"] = (
            f"{want} workers x {cpu:g} CPU{' + 1 GPU' if gpu else ''}"
            f"{f' + {memory / 2**30:.1f} GiB' if memory else ''} do not fit the Ray cluster "
            f"now ({room} can be placed {strategy} on its {len(nodes)} node(s)); the job would "
            "wait queued until resources free up or nodes are added"
        )
    return out


def estimate_memory(
    spec: JobSpec,
    seq_len: int,
    vocab: int,
    rows_per_example: int = 1,
    nodes: list[dict[str, float]] | None = None,
) -> dict[str, Any]:
    """The chunk plan for the job's workers, each rank's model data per tier at start, and
    one iteration forecast by the capacity planner (`pstar_core.capacity`); for a job that
    does not fit, the smallest change that would."""
    cfg = EngineConfig.parse(spec.engine_config())
    workers = spec.resources.num_workers
    gpu = spec.resources.use_gpu
    dtype = planned_dtype(cfg.dtype, gpu)
    lora = spec.method.lora.settings() if spec.method.lora is not None else None
    model = spec.model.model_dump()
    tensors = _tensors(model, seq_len, vocab, lora)
    chunk_plan = make_plan(
        tensors.numels, tensors.trainable, tensors.names, dtype, cfg.chunk_size, workers
    )
    list_bytes = chunk_plan.list_bytes(workers)  # one rank's, whole groups each
    need = sum(list_bytes.values())
    p_bytes = BYTES_PARAM[dtype]
    # the ranks of one host share it (local Ray: every worker is on this host), as the
    # workers' engines will count it when no budget is given
    whole = host_whole(spec.resources.memory_per_worker, workers)
    mem = cfg.memory
    device = _resolve(mem.device_budget, None if gpu else whole)
    host = _resolve(mem.host_budget, whole) or 0
    disk = _resolve(mem.disk_budget, None) if mem.disk_budget else 0
    problems = []
    if disk is None:
        problems.append("memory.disk_budget as a fraction is resolved on the worker: not checked")
        disk = 0
    if device is None:
        problems.append(
            "memory.device_budget is resolved on the worker (a share of its GPU): the GPU's "
            "side is not checked here; give it in bytes to have it checked"
        )

    def plan_for(o: Options) -> RankPlan:
        t = tensors
        if o.lora and lora is None:  # the suggestion: LoRA with its defaults
            t = _tensors(model, seq_len, vocab, {})  # LoraConfig's defaults
        hw = Hardware(o.workers, device or 1 << 60, host * o.workers, disk * o.workers,
                      accelerator=False)  # fmt: skip
        work = Workload(
            batch=max(1, o.batch // o.workers) * rows_per_example, seq=seq_len,
            activation_checkpointing=o.checkpointing, dtype=dtype, chunk_size=cfg.chunk_size,
        )  # fmt: skip
        return plan_tensors(spec.model.id, t, hw, work)

    now = Options(workers, spec.hyperparameters.batch_size, cfg.activation_checkpointing,
                  lora is not None)  # fmt: skip
    rank = plan_for(now)
    share = int(mem.warmup_ratio * device) if device is not None else 0
    lists_at = lists_at_start(list_bytes, host, share, disk)
    on = {t: sum(row[t] for row in lists_at.values()) for t in ("device", "host", "disk")}
    overflow = None
    if short := host_disk_shortfall(need, host, disk):
        overflow = {"tier": "host", "bytes": short}
        problems.append(
            f"each rank needs {_gib(need)} of chunks; host {_gib(host)} + disk {_gib(disk)} "
            f"budgets hold {_gib(host + disk)} (the warm-up step updates every chunk on the host): "
            f"short by {_gib(short)}; raise memory.host_budget or "
            "memory.disk_budget, or add workers"
        )
    if device is not None and rank.least_device_bytes > device:
        overflow = overflow or {"tier": "device", "bytes": rank.least_device_bytes - device}
        problems.append(
            f"an iteration needs at least {_gib(rank.least_device_bytes)} on the device (its "
            f"activations peak at {_gib(rank.non_model_peak_bytes)}, with the chunks its "
            f"operators use), whose budget is {_gib(device)}; raise memory.device_budget, "
            "turn on engine.activation_checkpointing or use a smaller batch"
        )
    out = {
        "fits": overflow is None,
        "overflow": overflow,
        "problems": problems,
        "chunk_plan": {
            "dtype": dtype,  # 'auto' as planned here (pstar_core.precision.planned_dtype)
            "chunk_size": chunk_plan.chunk_size,
            "utilization": chunk_plan.utilization,
            "params": chunk_plan.params,
            "trainable_params": chunk_plan.trainable_params,
            "model_data_bytes": chunk_plan.model_data_bytes,
            "model_data_bytes_per_param": chunk_plan.model_data_bytes / max(1, chunk_plan.params),
            "chunk_bytes": chunk_plan.chunk_bytes,
            "lists": chunk_plan.list_stats(),
        },
        "per_rank": {
            "workers": workers,
            "model_data_bytes": chunk_plan.model_data_bytes // workers,
            "chunk_bytes": need,
            "tiers_at_start": {
                "device": {"budget": device, "chunk_bytes": on["device"]},
                "host": {"budget": host, "chunk_bytes": on["host"]},
                "disk": {"budget": disk, "chunk_bytes": on["disk"]},
            },
            "lists_at_start": lists_at,
            "gathered_working_set_bytes": chunk_plan.chunk_size * p_bytes * workers,
            "iteration": _iteration(rank, device is not None),
        },
        "non_model_bytes": rank.non_model_peak_bytes,
        "non_model_source": (
            "the planner's activation model, calibrated on the engine's tracer "
            "(benchmarks/plan_check.py); the job's first step measures it"
        ),
    }
    if overflow is not None:
        one = (
            place_workers({**spec.resources.model_dump(), "num_workers": 1}, nodes) if nodes else {}
        )
        out["smallest_change"] = smallest_change(
            plan_for, now, max_workers=one.get("placeable_workers")
        )
    if lora is not None:
        out["lora"] = _lora_plan(lora, chunk_plan, p_bytes, lists_at)
    return out


def _iteration(rank: RankPlan, device_known: bool) -> dict[str, Any]:
    """One rank's iteration as the planner forecasts it (the device's figures only when
    its budget is known here)."""
    out: dict[str, Any] = {
        "non_model_peak_bytes": rank.non_model_peak_bytes,
        "least_device_bytes": rank.least_device_bytes,
        "collective_bytes": rank.collective_bytes_per_iter,
    }
    if device_known:
        out |= {
            "device_peak_bytes": rank.device_peak_bytes,
            "host_peak_bytes": rank.host_peak_bytes,
            "host_to_device_bytes": rank.host_to_device_bytes_per_iter,
            "device_to_host_bytes": rank.device_to_host_bytes_per_iter,
            "device_margin_bytes": rank.gpu_margin_bytes,
            "optimizer_chunks_on_device": rank.os_chunks_on_gpu,
            "optimizer_chunks": rank.os_chunks,
        }
    return out


def _lora_plan(
    settings: dict[str, Any], plan: Any, p_bytes: int, at_start: dict[str, dict[str, int]]
) -> dict[str, Any]:
    """The LoRA memory plan: the frozen base (compute dtype only) and the adapters
    (compute dtype, fp32 master, momentum, variance), counted and placed."""
    adapter_per_param = p_bytes + BYTES_OPTIMIZER_STATES
    adapters_at_start = {
        tier: sum(at_start[k][tier] for k in ("param", "param_fp32", "momentum", "variance"))
        for tier in ("device", "host", "disk")
    }
    return {
        **settings,
        "base_params": plan.params - plan.trainable_params,
        "base_bytes": plan.frozen.used_elems * p_bytes,
        "base_bytes_per_param": p_bytes,
        "adapter_params": plan.trainable_params,
        "adapter_bytes": plan.trainable.used_elems * adapter_per_param,
        "adapter_bytes_per_param": adapter_per_param,
        "model_data_bytes": plan.model_data_bytes,
        "model_data_bytes_per_param": plan.model_data_bytes / max(1, plan.params),
        "per_rank_chunk_bytes_at_start": {
            "base": at_start["frozen"],
            "adapters": adapters_at_start,
        },
    }


def _tensors(model: dict[str, Any], seq_len: int, vocab: int, lora: dict[str, Any] | None):
    """The job's model on the meta device (no weight allocated), as the planner needs it;
    with `lora`, wrapped by `peft`: the base frozen, the adapters trainable."""
    import torch

    if model["kind"] == "zoo":
        from service.data.prepare import model_fn

        with torch.device("meta"):
            module = model_fn(model, seq_len, vocab)()
    else:
        from service.tools.planning import build_meta

        module = build_meta(model["path"])
    config = module.config
    if lora is not None:
        from service.adapters import wrap_meta

        module = wrap_meta(module, lora)
    return module_tensors(module, arch_of(config), seq_len)


def _resolve(budget: int | float | None, whole: int | None) -> int | None:
    if budget is None:
        return whole
    if isinstance(budget, float):
        return None if whole is None else int(budget * whole)
    return int(budget)


def _gib(n: int | None) -> str:
    return "unknown" if n is None else f"{n / 2**30:.2f} GiB"
