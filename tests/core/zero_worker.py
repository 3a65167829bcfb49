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
    losses = []
    for x in data:
        part = x.chunk(world)[rank]
        loss = engine(input_ids=part, labels=part).loss
        engine.backward(loss)
        engine.step()
        losses.append(mean_over_ranks(loss, world))
    return losses


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
    # the one-time costs of a first engine in a process (the precision probe's oneDNN
    # kernels, thread pools, allocator arenas) are paid by a tiny one first
    pstar_core.initialize(MODELS["gpt"], engine_config()).close()
    torch.manual_seed(0)
    before = vm_hwm()
    engine = pstar_core.initialize(model_fn, engine_config())
    out = {"init_peak_growth": vm_hwm() - before}
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


def scenario(name: str, rank: int, world: int, tmp: Path) -> dict:
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
    zero = {"variant": variant, "overlap_reductions": overlap}
    device = os.environ.get("PSTAR_TEST_DEVICE", "cpu")
    clip = float(os.environ.get("PSTAR_TEST_CLIP", "0")) or None  # global-norm clipping
    cfg = engine_config(
        chunk_size=8192, memory=memory, zero=zero, device=device, gradient_clipping=clip
    )
    engine = pstar_core.initialize(model_fn, cfg)
    engine.load_state_dict(ref.state_dict())
    out: dict = {"stats_before": {k: engine.stats()[k] for k in ("model_data_bytes", "chunk_size")}}
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
        out["host_pool"] = engine.stats()["host_pool"]
        out["own_bytes"] = sum(c.nbytes for c in engine.manager.own_chunks())
        out["device"] = str(engine.device)
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
        # batch 3 fails: inside rank 1's forward (a layer raises there), and batch 5 in
        # rank 0's own code between forward and backward (it calls abandon_iteration);
        # "skip" leaves both batches out on every rank: the runs must agree
        from pstar_core.zero import RankFailed

        layer = engine.module.transformer.h[1]
        boom = {"on": False}

        def hook(_mod, _args):
            if boom["on"]:
                raise MemoryError("out of memory in block 1 (simulated)")

        layer.register_forward_pre_hook(hook)
        out["losses"], out["errors"] = [], []
        for i, x in enumerate(data[:8]):
            if name == "skip" and i in (3, 5):
                continue
            part = x.chunk(world)[rank]
            boom["on"] = name == "fail" and i == 3 and rank == 1
            try:
                loss = engine(input_ids=part, labels=part).loss
                if name == "fail" and i == 5 and rank == 0:
                    engine.abandon_iteration()  # the caller's own code failed here
                    raise ValueError("a bad label in batch 5 (simulated)")
                engine.backward(loss)
                engine.step()
                out["losses"].append(mean_over_ranks(loss, world))
            except (RankFailed, MemoryError, ValueError) as e:
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
    if world > 1:
        dist.init_process_group(
            backend, init_method=f"file://{tmp_path / 'pg'}", rank=rank, world_size=world
        )
    torch.set_num_threads(1)
    HOST.install()
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
