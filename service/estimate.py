"""The dry run (`POST /v1/fine_tuning/jobs/validate`): what a job would do, storing nothing.

It runs the same checks as create, tokenizes the files as the driver would (so `seq_len`,
truncation and the step count are the real ones), builds the chunk plan on the meta device
(no weight is allocated) for the requested number of workers, and places each rank's
chunks into the tier budgets the way `initialize` does at start: host memory first, then
the device up to its warm-up share, then disk, per chunk list. If that does not fit, it
says which tier overflows and by how much. A LoRA job's plan is that of the model with its
adapters (built with `peft` on meta): the base in the frozen list at its compute dtype
only, the adapters with fp32 masters and Adam state; `lora` sums it up.

Budgets given in bytes are exact. A fraction or a default is resolved on the control
plane's host (the machine the embedded local Ray runs on); on a remote cluster give
budgets in bytes for an exact answer. Non-model memory (activations) is measured by the
tracer in the first step, not estimated here.
"""

from __future__ import annotations

from typing import Any

from pstar_core.config import EngineConfig
from pstar_core.mapping import BYTES_OPTIMIZER_STATES, BYTES_PARAM, make_plan
from pstar_core.precision import planned_dtype
from pstar_core.tiers import host_memory_limit
from service.datasets import DataError
from service.errors import InvalidRequest
from service.files import file_path
from service.job_request import JobRequest
from service.jobs import JobService
from service.prepare import prepare
from service.settings import Settings
from service.store import Store


def validate_job(
    settings: Settings, store: Store, jobs: JobService, tenant: str, req: JobRequest
) -> dict[str, Any]:
    _model, plan = jobs.resolve(tenant, req)
    train = store.files.get(tenant, req.training_file)
    valid = store.files.get(tenant, req.validation_file) if req.validation_file else None
    try:
        prep = prepare(
            plan,
            file_path(settings, train),
            file_path(settings, valid) if valid is not None else None,
        )
    except DataError as e:
        raise InvalidRequest(str(e), param="training_file", code="invalid_training_data") from None
    hp = dict(plan["hyperparameters"], seq_len=prep.seq_len)
    memory = estimate_memory(plan, prep.seq_len, len(prep.tokenizer))
    # a DPO step forwards both answers of each of its pairs
    rows_per_example = 2 if prep.format == "preference" else 1
    tokens_per_step = hp["batch_size"] * rows_per_example * prep.seq_len
    problems = list(memory.pop("problems"))
    nodes = getattr(jobs.launcher, "cluster_nodes", lambda: None)()
    resources = place_workers(plan["resources"], nodes)
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
        "hyperparameters": hp,
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
    `cpus_per_worker` CPUs and, with `use_gpu`, one GPU). `fits` is None when the cluster
    did not say; a job that does not fit waits `queued` (an autoscaler may add nodes)."""
    want = res["num_workers"]
    out: dict[str, Any] = {"requested": res, "fits": None}
    if not nodes:
        return out
    cpu, gpu = res["cpus_per_worker"], 1 if res["use_gpu"] else 0
    strategy = res.get("placement_strategy", "PACK")
    per_node = []
    for n in nodes:
        k = int(n.get("CPU", 0) // cpu) if cpu else want
        if gpu:
            k = min(k, int(n.get("GPU", 0)))
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
        },
        placeable_workers=room,
        fits=room >= want,
    )
    if room < want:
        out["problem"] = (
            f"{want} workers x {cpu:g} CPU{' + 1 GPU' if gpu else ''} do not fit the Ray cluster "
            f"now ({room} can be placed {strategy} on its {len(nodes)} node(s)); the job would "
            "wait queued until resources free up or nodes are added"
        )
    return out


def estimate_memory(plan: dict[str, Any], seq_len: int, vocab: int) -> dict[str, Any]:
    """The chunk plan for the job's workers and each rank's model data per tier."""
    import torch

    cfg = EngineConfig.parse(plan["engine"])
    workers = plan["resources"]["num_workers"]
    dtype = planned_dtype(cfg.dtype, bool(plan["resources"].get("use_gpu")))
    module = _meta_model(plan["model"], seq_len, vocab)
    lora = (plan.get("method") or {}).get("lora")
    if lora is not None:
        from service.lora import wrap_meta

        module = wrap_meta(module, lora)  # the base frozen, the adapters trainable
    seen: dict[int, tuple[str, torch.nn.Parameter]] = {}
    for name, p in module.named_parameters():
        seen.setdefault(id(p), (name, p))
    params = list(seen.values())
    chunk_plan = make_plan(
        [p.numel() for _, p in params],
        [p.requires_grad for _, p in params],
        [n for n, _ in params],
        dtype,
        cfg.chunk_size,
        workers,
    )
    per_rank_chunks = chunk_plan.chunk_bytes // workers
    per_rank_data = chunk_plan.model_data_bytes // workers
    p_bytes = BYTES_PARAM[dtype]
    param_chunk_bytes = chunk_plan.chunk_size * p_bytes
    # the ranks of one host share it (local Ray: every worker is on this host)
    host_whole = host_memory_limit() // workers
    gpu = plan["resources"].get("use_gpu")
    dev_whole = None if gpu else host_whole
    mem = cfg.memory
    device = _resolve(mem.device_budget, dev_whole)
    host = _resolve(mem.host_budget, host_whole)
    disk = _resolve(mem.disk_budget, None) if mem.disk_budget else 0
    problems = []
    if disk is None:
        problems.append("memory.disk_budget as a fraction is resolved on the worker: not checked")
        disk = 0
    # at start: host first, then the device up to its warm-up share (param lists only),
    # then disk; the warm-up step must pass every chunk through host and disk
    need = per_rank_chunks
    on_host = min(need, host)
    param_lists = sum(
        int(s["bytes"]) for k, s in chunk_plan.list_stats().items() if k in ("param", "frozen")
    )
    share = int(mem.warmup_ratio * device) if device is not None else 0
    on_device = min(need - on_host, share, param_lists // workers)
    on_disk = min(need - on_host - on_device, disk)
    lists_at_start = _lists_at_start(
        {k: int(v["bytes"]) // workers for k, v in chunk_plan.list_stats().items()},
        on_device,
        on_disk,
    )
    overflow = None
    if need > host + disk:
        overflow = {"tier": "host", "bytes": need - host - disk}
        problems.append(
            f"each rank needs {_gib(need)} of chunks; host {_gib(host)} + disk {_gib(disk)} "
            f"budgets hold {_gib(host + disk)} (the warm-up step updates every chunk on the host): "
            f"short by {_gib(need - host - disk)}; raise memory.host_budget or "
            "memory.disk_budget, or add workers"
        )
    working_set = param_chunk_bytes * workers  # an operator's chunk, gathered from all ranks
    if device is not None and working_set > device:
        overflow = overflow or {"tier": "device", "bytes": working_set - device}
        problems.append(
            f"an operator needs at least {_gib(working_set)} of gathered param chunks on the "
            f"device, whose budget is {_gib(device)}; raise memory.device_budget or use a "
            "smaller chunk_size"
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
            "model_data_bytes": per_rank_data,
            "chunk_bytes": need,
            "tiers_at_start": {
                "device": {"budget": device, "chunk_bytes": on_device},
                "host": {"budget": host, "chunk_bytes": on_host},
                "disk": {"budget": disk, "chunk_bytes": on_disk},
            },
            "lists_at_start": lists_at_start,
            "gathered_working_set_bytes": working_set,
        },
        "non_model_bytes": "measured by the tracer in the first step",
    }
    if lora is not None:
        out["lora"] = _lora_plan(lora, chunk_plan, p_bytes, lists_at_start)
    return out


# Where `startup.enforce_budgets` puts a rank's chunks at start, by list: all on the
# host; while the host is over its budget, chunks of the param lists move to the device
# (up to its warm-up share), then chunks spill to disk in this order
TO_DEVICE_FIRST = ("param", "frozen")
TO_DISK_FIRST = ("param", "frozen", "param_fp32", "momentum", "variance")


def _lists_at_start(
    list_bytes: dict[str, int], on_device: int, on_disk: int
) -> dict[str, dict[str, int]]:
    """Each chunk list's bytes per tier at start (one rank), given how many bytes go to
    the device and to disk (what the host budget cannot hold)."""
    out = {k: {"device": 0, "host": b, "disk": 0} for k, b in list_bytes.items()}
    for tier, left, order in (
        ("device", on_device, TO_DEVICE_FIRST),
        ("disk", on_disk, TO_DISK_FIRST),
    ):
        for k in order:
            take = min(out[k]["host"], left)
            out[k]["host"] -= take
            out[k][tier] += take
            left -= take
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


def _meta_model(model: dict[str, Any], seq_len: int, vocab: int):
    import torch

    if model["kind"] == "zoo":
        from service.prepare import model_fn

        with torch.device("meta"):
            return model_fn(model, seq_len, vocab)()
    from service.planning import build_meta

    return build_meta(model["path"])


def _resolve(budget: int | float | None, whole: int | None) -> int | None:
    if budget is None:
        return whole
    if isinstance(budget, float):
        return None if whole is None else int(budget * whole)
    return int(budget)


def _gib(n: int | None) -> str:
    return "unknown" if n is None else f"{n / 2**30:.2f} GiB"
