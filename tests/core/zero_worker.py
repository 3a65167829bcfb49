"""Worker processes for the ZeRO tests (a module of its own so spawn can import it)."""

from __future__ import annotations

import functools
import json
import os
import sys
import types
from pathlib import Path

import torch
import torch.distributed as dist

import pstar_core
from tests.core.helpers import (
    MODELS,
    batches,
    engine_config,
    lora_model,
    mean_over_ranks,
    reference_model,
)

STEPS = 20


def run_steps(engine, data, rank, world):
    beside = os.environ.get("PSTAR_TEST_BESIDE") == "1"  # backward_and_step
    micro = int(os.environ.get("PSTAR_TEST_MICRO", "1"))  # micro-batches a step
    losses = []
    for x in data:
        part = x.chunk(world)[rank]
        for mb in part.chunk(micro)[:-1]:  # all but the last: accumulated
            engine.backward(engine(input_ids=mb, labels=mb).loss / micro)
        part = part.chunk(micro)[-1]
        loss = engine(input_ids=part, labels=part).loss / micro
        if beside:
            engine.backward_and_step(loss)
            BESIDE.append(engine.stats()["adam_beside_backward_chunks"])
        else:
            engine.backward(loss)
            engine.step()
        losses.append(mean_over_ranks(loss, world))
    return losses


BESIDE: list[int] = []  # chunks whose Adam ran beside backward, at each step


class HostPayloads:
    """Counts the bytes of chunk payloads in CPU memory that are alive (their mappings: a
    payload stays alive as long as anything holds a view of it), and the most at once."""

    def __init__(self) -> None:
        self.live = self.peak = 0

    def install(self) -> None:
        import mmap
        import weakref

        from pstar_core import tiers

        def counted(fileno: int, size: int) -> mmap.mmap:
            m = mmap.mmap(fileno, size)
            self.live += size
            self.peak = max(self.peak, self.live)
            weakref.finalize(m, self._gone, size)
            return m

        tiers.mmap = types.SimpleNamespace(mmap=counted)

    def _gone(self, size: int) -> None:
        self.live -= size


HOST = HostPayloads()
ORDER: list[str] = []  # the first single-buffer gathers and device-budget reads, in order


def record_order() -> None:
    from pstar_core import tiers, zero

    plannable, gather = tiers.plannable_bytes, getattr(zero, "_gather_into", None)

    def budget(*args, **kwargs):
        ORDER.append("budget")
        return plannable(*args, **kwargs)

    def gathered(*args, **kwargs):
        ORDER.append("all_gather")
        return gather(*args, **kwargs)

    tiers.plannable_bytes = budget
    if gather is not None:
        zero._gather_into = gathered


def vm_hwm() -> int:
    """This process's peak resident memory so far (VmHWM), bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def init_scenario(name: str, rank: int, world: int) -> dict:
    """Random init only: the peak memory `initialize` adds, and what the tensors hold."""
    import hashlib

    from pstar_core.models import GPTConfig, build

    if name == "init_memory":  # ~50M parameters, no single tensor over 4 MB
        cfg = GPTConfig(hidden_size=512, num_layers=16, num_heads=8, vocab_size=1024, seq_len=64)
        model_fn = functools.partial(build, cfg)
    else:
        model_fn = MODELS["hf_gpt2"]
    device = os.environ.get("PSTAR_TEST_DEVICE", "cpu")
    cfg = engine_config(dtype=os.environ.get("PSTAR_TEST_DTYPE", "fp32"), device=device)
    # the one-time costs of a first engine in a process (the precision probe's oneDNN
    # kernels, thread pools, allocator arenas) are paid by a tiny one first
    pstar_core.initialize(MODELS["gpt"], cfg).close()
    torch.manual_seed(0)
    before = vm_hwm()
    engine = pstar_core.initialize(model_fn, cfg)
    out = {"init_peak_growth": vm_hwm() - before}
    out["params"] = sum(s.numel for s in engine.manager.slots)
    out["host_pool"] = engine.stats()["host_pool"]
    if name == "init":
        out["tensors"] = {
            k: hashlib.sha256(v.float().numpy().tobytes()).hexdigest()
            for k, v in engine.state_dict().items()
        }
    return out


def precision_scenario(rank: int) -> dict:
    """dtype auto where rank 1's CPU has no fast bf16 and rank 0's has: both ranks must
    compute in fp32 (the chunks of every rank have one layout and dtype)."""
    from pstar_core import precision

    decide = precision.decide

    def slow_bf16(requested, device):
        return precision.Precision(requested, "fp32", "no fast bf16 here", "AVX2", False)

    def fast_bf16(requested, device):
        p = decide(requested, device)
        return precision.Precision(requested, "bf16", "native", "AVX512", True, p.probe_gflops)

    precision.decide = slow_bf16 if rank == 1 else fast_bf16
    engine = pstar_core.initialize(MODELS["gpt"], engine_config(dtype="auto"))
    return {"precision": engine.stats()["precision"]}


def from_dir_scenario(rank: int, world: int, tmp: Path) -> dict:
    """A pretrained directory (written beforehand by the test), full and LoRA: a rank
    streams only its own tensors in (others' stay empty, no staging for them)."""
    out = {}
    data = batches(4, batch=8)
    for name, extra in (("full", {}), ("lora", {"lora": {"r": 4}})):
        cfg = engine_config(chunk_size=8192, **extra)
        torch.manual_seed(0)  # peft draws the adapters' A: the same stream on every rank
        engine = pstar_core.initialize(tmp.parent / "src", cfg)
        out[name] = run_steps(engine, data, rank, world)
        engine.close()
    return out


class Branchy(torch.nn.Module):
    """A model whose parameter use depends on the data: a batch whose first token is even
    goes through `a`, an odd one through `b` (as an MoE block skips an expert that got no
    tokens). With chunks of one layer each, [embed, a] and [b, head] are the two groups of
    2 ranks."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(width, width)
        self.a = torch.nn.Linear(width, width - 1)
        self.b = torch.nn.Linear(width, width - 1)
        self.head = torch.nn.Linear(width - 1, width)

    def forward(self, input_ids, labels):
        h = self.embed(input_ids)
        h = self.a(h) if int(input_ids[0, 0]) % 2 == 0 else self.b(h)
        logits = self.head(h)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return types.SimpleNamespace(loss=loss)


def diverge_scenario(rank: int, world: int) -> dict:
    """Each rank takes the branch its data asks for (rank 0 `a`, rank 1 `b`): the ranks'
    gradient reductions then come in different orders."""
    from pstar_core.zero import RankFailed

    engine = pstar_core.initialize(Branchy, engine_config(chunk_size=64 * 64))
    x = torch.randint(0, 32, (2, 8)) * 2 + rank  # rank 0 even tokens, rank 1 odd
    out: dict = {"errors": []}
    try:
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
    except RankFailed as e:
        out["errors"].append([type(e).__name__, str(e)])
    # the same data on both ranks afterwards: the engine goes on, in step
    y = torch.randint(0, 32, (2, 8)) * 2
    loss = engine(input_ids=y, labels=y).loss
    engine.backward(loss)
    engine.step()
    out["after"] = mean_over_ranks(loss, world)
    return out


class Skippy(torch.nn.Module):
    """A batch whose first token is odd skips layers `a` and `b`. With chunks of one layer
    each, [embed, mid], [a, b] and [head] are the three groups of 2 ranks: a rank that
    skips gathers the third group where the other gathers the second."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(width, width - 1)
        self.mid, self.a, self.b = (torch.nn.Linear(width - 1, width - 1) for _ in range(3))
        self.head = torch.nn.Linear(width - 1, width)

    def forward(self, input_ids, labels):
        h = self.mid(self.embed(input_ids))
        if int(input_ids[0, 0]) % 2 == 0:
            h = self.b(self.a(h))
        logits = self.head(h)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return types.SimpleNamespace(loss=loss)


def depart_scenario(rank: int, world: int) -> dict:
    """Both ranks go through every layer for four steps, so their sections are agreed
    and run without flags (the fourth evaluates between forward and backward); at the
    fifth, rank 1's data skips two layers (it leaves the agreed collectives in its
    forward); then both go through every layer again."""
    from pstar_core.zero import RankFailed

    engine = pstar_core.initialize(Skippy, engine_config(chunk_size=64 * 64))
    out: dict = {"errors": [], "agreed": []}
    for i in range(7):
        odd = i == 4 and rank == 1
        x = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(i)) * 2 + odd
        out["agreed"].append(engine.stats()["comm_agreed_sections"])
        try:
            loss = engine(input_ids=x, labels=x).loss
            if i == 3:  # an evaluation between forward and backward: not a departure
                with torch.no_grad():
                    out["evaluated"] = float(engine(input_ids=x, labels=x).loss)
            engine.backward(loss)
            engine.step()
            out.setdefault("losses", []).append(mean_over_ranks(loss, world))
        except RankFailed as e:
            out["errors"].append([i, type(e).__name__, str(e)])
    return out


def subgroup_scenario(rank: int, world: int) -> dict:
    """ZeRO over ranks 0 and 1 of 3 (`process_group=`): rank 2 never joins the engine's
    groups, and the 2 members train as 1 rank with their global batch would. Afterwards
    every rank makes one more group, as a data-parallel group across ZeRO groups would be:
    groups are named by a count of `new_group` calls unless made with local
    synchronization, so one the engine made on its members alone would shift the names."""
    sub = dist.new_group([0, 1])  # every rank of the default group calls new_group
    out: dict = {"member": rank in (0, 1)}
    if out["member"]:
        device = os.environ.get("PSTAR_TEST_DEVICE", "cpu")
        cfg = engine_config(chunk_size=8192, device=device)
        ref = reference_model(MODELS["hf_gpt2"])
        engine = pstar_core.initialize(MODELS["hf_gpt2"], cfg, process_group=sub)
        engine.load_state_dict(ref.state_dict())
        out["losses"] = []
        for x in batches(4, batch=8):
            part = x.chunk(2)[rank]
            loss = engine(input_ids=part, labels=part).loss
            engine.backward(loss)
            engine.step()
            t = loss.detach().clone()
            dist.all_reduce(t, group=sub)
            out["losses"].append(t.item() / 2)
        out["world_size"] = engine.stats()["world_size"]
        engine.close()
    across = dist.new_group([1, 2], backend="gloo")
    if rank in (1, 2):
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=across)
        out["across"] = t.item()
    dist.barrier()
    return out


def oom_scenario(rank: int, world: int) -> dict:
    """Rank 1's device runs out of memory while allocating a group's gather buffer in
    the forward of batch 2 (`PSTAR_TEST_FAIL_AT`): both ranks raise (rank 0 `RankFailed`),
    each measured from the batch's start, and both go on in step."""
    import time

    from pstar_core.tiers import TierName
    from pstar_core.zero import RankFailed

    device = os.environ.get("PSTAR_TEST_DEVICE", "cpu")
    cfg = engine_config(chunk_size=8192, device=device)
    engine = pstar_core.initialize(MODELS["hf_gpt2"], cfg)
    tier = engine.manager.residency.tiers[TierName.DEVICE]
    group_elems = 8192 * world
    armed = {"on": False}
    allocate = tier.allocate

    def failing(numel, dtype):
        if armed["on"] and numel == group_elems:
            armed["on"] = False
            raise torch.OutOfMemoryError("CUDA out of memory (injected in a gather)")
        return allocate(numel, dtype)

    tier.allocate = failing
    out: dict = {"errors": [], "losses": [], "agreed": []}
    at = int(os.environ.get("PSTAR_TEST_FAIL_AT", "2"))
    for i, x in enumerate(batches(at + 2, batch=8)):
        part = x.chunk(world)[rank]
        armed["on"] = i == at and rank == 1
        out["agreed"].append(engine.stats()["comm_agreed_sections"])
        start = time.monotonic()
        try:
            loss = engine(input_ids=part, labels=part).loss
            engine.backward(loss)
            engine.step()
            out["losses"].append(mean_over_ranks(loss, world))
        except (RankFailed, torch.OutOfMemoryError) as e:
            out["errors"].append([i, type(e).__name__, str(e), time.monotonic() - start])
    return out


def pressed_scenario(rank: int, world: int) -> dict:
    """In backward, whenever reductions are in flight, settle them as `Residency.reserve`
    does when the device is full: the device must not allocate anything for it (the own
    chunk leaves the group's buffer for the host), and the numbers must not change."""
    from pstar_core.manager import TrainingPhase

    device = os.environ.get("PSTAR_TEST_DEVICE", "cpu")
    accel = getattr(torch, device)
    ref = reference_model(MODELS["hf_gpt2"])
    engine = pstar_core.initialize(MODELS["hf_gpt2"], engine_config(chunk_size=8192, device=device))
    engine.load_state_dict(ref.state_dict())
    m = engine.manager
    grown: list[int] = []

    def observe(_slots) -> None:
        if m.phase is TrainingPhase.BACKWARD and m.groups.in_flight:
            before = accel.memory_allocated()
            accel.reset_peak_memory_stats()
            m.groups.settle(pressed=True)
            grown.append(accel.max_memory_allocated() - before)

    m.on_access.append(observe)
    losses = run_steps(engine, batches(4, batch=8), rank, world)
    return {
        "losses": losses,
        "grown": grown,
        "evicted": engine.stats()["comm_evicted_under_pressure"],
    }


def no_room_ahead(engine, rank: int) -> None:
    """From the fifth step on, before each gather ahead, this rank's own chunk of the
    group goes to the host: it cannot gather ahead without making room, whatever the
    agreed script says."""
    from pstar_core.tiers import TierName

    groups = engine.manager.groups
    gather_ahead = groups.gather_ahead

    def without_room(c) -> bool:
        own = groups._members(c)[rank]
        if engine.global_step >= 4 and not groups.is_live(c) and own.pins == 0:
            groups.residency.move(own, TierName.HOST)
        return gather_ahead(c)

    groups.gather_ahead = without_room


def scenario(name: str, rank: int, world: int, tmp: Path) -> dict:
    if name == "pressed":
        return pressed_scenario(rank, world)
    if name == "diverge":
        return diverge_scenario(rank, world)
    if name == "depart":
        return depart_scenario(rank, world)
    if name == "subgroup":
        return subgroup_scenario(rank, world)
    if name == "oom_gather":
        return oom_scenario(rank, world)
    if name == "from_dir":
        return from_dir_scenario(rank, world, tmp)
    if name.startswith("init"):
        return init_scenario(name, rank, world)
    if name == "precision":
        return precision_scenario(rank)
    model_fn = MODELS["hf_gpt2"]
    if lora_on := os.environ.get("PSTAR_TEST_LORA"):  # peft adapters (test_lora): on which
        model_fn = functools.partial(lora_model, lora_on)
    ref = reference_model(model_fn)
    data = batches(STEPS, batch=8)
    memory = json.loads(os.environ.get("PSTAR_TEST_MEMORY", "{}"))
    variant = os.environ.get("PSTAR_TEST_VARIANT", "collective")
    overlap = os.environ.get("PSTAR_TEST_OVERLAP", "auto")
    ahead = os.environ.get("PSTAR_TEST_AHEAD", "auto")
    zero = {"variant": variant, "overlap_reductions": overlap, "gather_ahead": ahead}
    if os.environ.get("PSTAR_TEST_PER_COLLECTIVE") == "1":  # a flag before each collective
        zero["agree_per_collective"] = True
    device = os.environ.get("PSTAR_TEST_DEVICE", "cpu")
    clip = float(os.environ.get("PSTAR_TEST_CLIP", "0")) or None  # global-norm clipping
    chunk = int(os.environ.get("PSTAR_TEST_CHUNK", "8192"))  # below 4096: tensors span chunks
    cfg = engine_config(
        chunk_size=chunk, memory=memory, zero=zero, device=device, gradient_clipping=clip
    )
    accel = getattr(torch, device.split(":")[0]) if device != "cpu" else None
    if accel is not None:  # the device's own count of bytes, from here on
        base = accel.memory_allocated()
        accel.reset_peak_memory_stats()
    engine = pstar_core.initialize(model_fn, cfg)
    engine.load_state_dict(ref.state_dict())
    out: dict = {"stats_before": {k: engine.stats()[k] for k in ("model_data_bytes", "chunk_size")}}
    if os.environ.get("PSTAR_TEST_NO_ROOM_AHEAD") == "1" and rank == 1:
        no_room_ahead(engine, rank)
    if name == "train":
        out["losses"] = run_steps(engine, data, rank, world)
        out["moved"] = engine.stats()["bytes_moved"]
        out["comm_bytes"] = engine.stats()["comm_bytes_sent"]
        out["comm_calls"] = engine.stats()["comm_calls"]
        out["comm_by_list"] = engine.stats()["comm_bytes_by_list"]
        out["chunk_lists"] = {
            k: {"count": v["count"], "bytes": v["bytes"]}
            for k, v in engine.stats()["chunks"].items()
        }
        out["overlapped"] = engine.stats()["comm_overlapped_reductions"]
        out["gathered_ahead"] = engine.stats()["comm_gathered_ahead"]
        out["flag_exchanges"] = engine.stats()["comm_flag_exchanges"]
        out["ahead_made_room"] = engine.stats()["comm_gathered_ahead_made_room"]
        out["agreed_sections"] = engine.stats()["comm_agreed_sections"]
        out["beside"] = BESIDE
        out["device_adam_chunks"] = engine.stats()["device_adam_chunks"]
        out["evicted_under_pressure"] = engine.stats()["comm_evicted_under_pressure"]
        out["peak_non_model"] = engine.stats()["tracer"]["peak_non_model_bytes"]
        out["host_pool"] = engine.stats()["host_pool"]
        out["own_bytes"] = sum(c.nbytes for c in engine.manager.own_chunks())
        out["device"] = str(engine.device)
        out["collective_names"] = [n for n in ("all_gather_single",) if hasattr(dist, n)]
        out["order"] = ORDER[:2]
        if accel is not None:
            out["device_peak_growth"] = accel.max_memory_allocated() - base
            out["device_budget"] = engine.stats()["tiers"]["device"]["budget"]
    elif name == "resume":
        run_steps(engine, data[:8], rank, world)
        HOST.peak = before = HOST.live
        engine.save_checkpoint(tmp / "ckpt")
        out["save_growth_bytes"] = HOST.peak - before  # chunk memory the save added
        out["host_budget"] = engine.stats()["tiers"]["host"]["budget"]
        out["chunk_bytes_max"] = max(c.nbytes for c in engine.manager.chunks())
        out["spilled"] = engine.stats()["bytes_moved"].get("host->disk", 0)
        fresh = pstar_core.initialize(model_fn, cfg)
        fresh.load_checkpoint(tmp / "ckpt")
        out["resumed"] = run_steps(fresh, data[8:12], rank, world)
        out["straight"] = run_steps(engine, data[8:12], rank, world)
    elif name in ("fail", "skip"):
        # batch 3 fails: inside rank 1's forward (a layer raises there), batch 5 in rank
        # 0's own code between forward and backward (it calls abandon_iteration), batch 7
        # inside rank 1's backward; "skip" leaves them out on every rank: the runs must
        # agree. From batch 3 on, the sections run on the collectives agreed for them.

        layer = engine.module.transformer.h[1]
        boom = {"on": False}

        def hook(_mod, _args):
            if boom["on"]:
                raise MemoryError("out of memory in block 1 (simulated)")

        def fails_in_backward(_grad):
            raise RuntimeError("a hook failed in backward (simulated)")

        def then(_mod, _args, output):
            if name == "fail" and i == 7 and rank == 1:
                (output[0] if isinstance(output, tuple) else output).register_hook(
                    fails_in_backward
                )

        layer.register_forward_pre_hook(hook)
        layer.register_forward_hook(then)
        out["losses"], out["errors"] = [], []
        for i, x in enumerate(data[:8]):
            if name == "skip" and i in (3, 5, 7):
                continue
            part = x.chunk(world)[rank]
            boom["on"] = name == "fail" and i == 3 and rank == 1
            out.setdefault("agreed", []).append(engine.stats()["comm_agreed_sections"])
            try:
                loss = engine(input_ids=part, labels=part).loss
                if name == "fail" and i == 5 and rank == 0:
                    engine.abandon_iteration()  # the caller's own code failed here
                    raise ValueError("a bad label in batch 5 (simulated)")
                engine.backward(loss)
                engine.step()
                out["losses"].append(mean_over_ranks(loss, world))
            except (RuntimeError, MemoryError, ValueError) as e:
                out["errors"].append([i, type(e).__name__, str(e)])
    elif name == "export":
        run_steps(engine, data[:3], rank, world)
        engine.export_hf(tmp / "hf", max_shard_bytes=64 * 1024)
        x = batches(1, seed=9)[0]
        with torch.no_grad():
            out["logits"] = engine(input_ids=x).logits.tolist()
        out["state_dict_keys"] = len(engine.state_dict())
    return out


def main(rank: int, world: int, tmp: str, name: str) -> None:
    tmp_path = Path(tmp)
    backend = "gloo"
    if os.environ.get("PSTAR_TEST_DEVICE") == "fakegpu":  # the second device (GPU-like)
        from tests import fakedevice

        fakedevice.load()
        backend = "fakegpu:fakenccl"  # as "nccl" alone on GPUs: host tensors are refused
    if os.environ.get("PSTAR_TEST_OLD_TORCH") == "1":
        # a torch before 2.13: its single-buffer collectives have only their old names
        for new in ("all_gather_single", "reduce_scatter_single"):
            if hasattr(dist, new):
                delattr(dist, new)
    if world > 1:
        dist.init_process_group(
            backend, init_method=f"file://{tmp_path / 'pg'}", rank=rank, world_size=world
        )
    torch.set_num_threads(1)
    HOST.install()
    record_order()
    result = scenario(name, rank, world, tmp_path)
    (tmp_path / f"result-{rank}.json").write_text(json.dumps(result))
    if world > 1:
        dist.destroy_process_group()
    # Skip interpreter finalization: a gloo run-loop thread can still hold the last
    # reference to a finished collective's tensors, and dropping it while Python
    # finalizes aborts the process (std::terminate; seen about 1 run in 8 on this box).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])  # rank world tmp name
