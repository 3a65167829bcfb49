"""Tiny models, data and a plain-PyTorch reference loop shared by the engine tests."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from pstar_core.models import build as build_gpt

VOCAB = 128
SEQ = 16


def tiny_gpt() -> nn.Module:
    return build_gpt("gpt-tiny", vocab_size=VOCAB, seq_len=SEQ)


def tiny_hf_gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        vocab_size=VOCAB,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=SEQ,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return GPT2LMHeadModel(cfg)


def tiny_hf_llama(
    hidden: int = 32,
    intermediate: int = 64,
    layers: int = 2,
    positions: int = SEQ,
    vocab: int = VOCAB,
    attn: str | None = None,
) -> nn.Module:
    """A 2-layer Llama (GQA: 4 query heads, 2 key/value heads); `attn` picks transformers'
    attention implementation (sdpa by default)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=positions,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    if attn is not None:
        cfg._attn_implementation = attn
    return LlamaForCausalLM(cfg)


MODELS: dict[str, Callable[[], nn.Module]] = {
    "gpt": tiny_gpt,
    "hf_gpt2": tiny_hf_gpt2,
    "hf_llama": tiny_hf_llama,
}


TARGETS = {"hf_llama": ["q_proj", "v_proj", "up_proj"], "hf_gpt2": ["c_attn", "c_fc"]}


def lora_model(name: str = "hf_llama") -> nn.Module:
    """A tiny model with peft LoRA adapters (r 4), the same for the same name."""
    import peft

    torch.manual_seed(0)
    cfg = peft.LoraConfig(
        r=4,
        lora_alpha=8,
        lora_dropout=0.0,
        target_modules=TARGETS[name],  # GPT-2's are Conv1D: peft sets fan_in_fan_out
        init_lora_weights=False,  # random B too, so the adapters change the output at once
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # peft: "fan_in_fan_out ... Setting it to True"
        return peft.get_peft_model(MODELS[name](), cfg)


def batches(n: int, batch: int = 4, seed: int = 0) -> list[torch.Tensor]:
    """Learnable sequences: each row counts up from a random start by a random stride."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        start = torch.randint(0, VOCAB, (batch, 1), generator=g)
        stride = torch.randint(1, 4, (batch, 1), generator=g)
        out.append((start + stride * torch.arange(SEQ)) % VOCAB)
    return out


def reference_model(model_fn: Callable[[], nn.Module], seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model_fn()


def torch_adamw(model: nn.Module, lr: float, wd: float, params=None) -> torch.optim.AdamW:
    """torch AdamW with the engine's default grouping: no decay for 1-D parameters."""
    params = list(model.parameters()) if params is None else params
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.999),
        eps=1e-8,
        foreach=False,
    )


def run_reference(model: nn.Module, data: list[torch.Tensor], lr: float, wd: float) -> list[float]:
    """Plain PyTorch fp32 training: the ground truth."""
    model = copy.deepcopy(model)
    opt = torch_adamw(model, lr, wd)
    losses = []
    for x in data:
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def run_reference_bf16(model: nn.Module, data: list[torch.Tensor], lr: float, wd: float):
    """The equivalent PyTorch mixed-precision recipe: bf16 params and compute, fp32 masters."""
    model = copy.deepcopy(model)
    params = list(model.parameters())
    masters = [p.detach().clone().float().requires_grad_(True) for p in params]
    for p in params:
        p.data = p.data.to(torch.bfloat16)
    decay = [m for m, p in zip(masters, params, strict=False) if p.dim() >= 2]
    no_decay = [m for m, p in zip(masters, params, strict=False) if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr,
        foreach=False,
    )
    losses = []
    for x in data:
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        for m, p in zip(masters, params, strict=False):
            m.grad = None if p.grad is None else p.grad.float()
            p.grad = None
        opt.step()
        with torch.no_grad():
            for m, p in zip(masters, params, strict=False):
                p.copy_(m)
        losses.append(loss.item())
    return losses


def run_engine(engine, data: list[torch.Tensor], micro_batches: int = 1) -> list[float]:
    losses = []
    for x in data:
        total = 0.0
        for mb in x.chunk(micro_batches):
            loss = engine(input_ids=mb, labels=mb).loss / micro_batches
            engine.backward(loss)
            total += loss.item()
        engine.step()
        losses.append(total)
    return losses


def engine_config(dtype: str = "fp32", lr: float = 1e-3, wd: float = 0.1, **extra) -> dict:
    return {
        "dtype": dtype,
        "chunk_size": "auto",
        "optimizer": {"lr": lr, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": wd},
        **extra,
    }


ROOT = Path(__file__).resolve().parents[2]


# [Note: ranks forked from a warm server] A rank is a fresh process, as torchrun's are,
# but not a fresh interpreter: importing torch and transformers takes a new Python 3-6 s
# on 2 cores, and the suite starts well over a hundred ranks. They are forked instead from
# multiprocessing's forkserver, one per test process, which has imported those (and run
# nothing of torch's: a fork after an OpenMP region would not be safe). Everything of
# ours is imported fresh in each rank, after its environment is set, as in a new process.
# PSTAR_TEST_FRESH_RANKS=1 starts each rank as `python -m module` instead.
PRELOAD = [
    "numpy",
    "torch",
    "torch.distributed",
    "safetensors.torch",
    "transformers",
    "transformers.models.llama.modeling_llama",
    "transformers.models.gpt2.modeling_gpt2",
]
_FORKSERVER = None


def _forkserver():
    global _FORKSERVER
    if _FORKSERVER is None:
        import multiprocessing

        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        _FORKSERVER = ctx
    return _FORKSERVER


def _run_rank(module: str, argv: list[str], env: dict[str, str], cwd: str, log: str) -> None:
    """A rank in a process forked from the warm server: `python -m module *argv`, with its
    output in `log` and the environment it would have been started with."""
    import runpy

    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.path.insert(0, cwd)
    # the server read OMP_NUM_THREADS when it imported torch; this rank's is the one asked
    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
    sys.argv = [module, *argv]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def spawn_ranks(
    module: str, world: int, tmp: Path, *args: str, timeout: float = 300, **env: str
) -> list[dict]:
    """Run `python -m module RANK WORLD TMP *args` as `world` new processes (one per rank,
    gloo over a file in `tmp`; see [Note: ranks forked from a warm server]); each writes
    `tmp/result-RANK.json`, returned in order. Ranks still running after `timeout` seconds
    (a hang) are killed and the test fails."""
    tmp.mkdir(parents=True, exist_ok=True)
    environ = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **env}

    def torchrun(r: int) -> dict[str, str]:  # what torchrun tells each rank
        ranks = {"RANK": r, "LOCAL_RANK": r, "WORLD_SIZE": world, "LOCAL_WORLD_SIZE": world}
        return {k: str(v) for k, v in ranks.items()}

    argv = [[str(r), str(world), str(tmp), *args] for r in range(world)]
    envs = [{**environ, **torchrun(r)} for r in range(world)]
    if os.environ.get("PSTAR_TEST_FRESH_RANKS") == "1":
        return _fresh_ranks(module, argv, tmp, timeout, envs)
    ctx = _forkserver()
    logs = [tmp / f"rank-{r}.log" for r in range(world)]
    procs = [
        ctx.Process(
            target=_run_rank,
            args=(module, argv[r], envs[r], str(ROOT), str(logs[r])),
        )
        for r in range(world)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    if any(p.is_alive() for p in procs):
        for p in procs:
            p.kill()
            p.join(30)
        texts = [log.read_text(errors="replace")[-1500:] for log in logs]
        raise AssertionError(f"ranks still running after {timeout} s (killed): {texts}")
    for p, log in zip(procs, logs, strict=True):
        assert p.exitcode == 0, (
            f"exit code {p.exitcode}: " + log.read_text(errors="replace")[-3000:]
        )
    return [json.loads((tmp / f"result-{r}.json").read_text()) for r in range(world)]


def _fresh_ranks(
    module: str, argv: list[list[str]], tmp: Path, timeout: float, envs: list[dict[str, str]]
) -> list[dict]:
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", module, *a],
            cwd=ROOT,
            env=e,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for a, e in zip(argv, envs, strict=True)
    ]
    try:
        outputs = [p.communicate(timeout=timeout)[0] for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        texts = [p.communicate()[0][-1500:] for p in procs]
        raise AssertionError(f"ranks still running after {timeout} s (killed): {texts}") from None
    for p, text in zip(procs, outputs, strict=True):
        assert p.returncode == 0, text[-3000:]
    return [json.loads((tmp / f"result-{r}.json").read_text()) for r in range(len(argv))]


def mean_over_ranks(loss: torch.Tensor, world: int) -> float:
    """The loss averaged over the ranks (each had an equal part of the global batch)."""
    import torch.distributed as dist

    t = loss.detach().clone()
    if world > 1:
        dist.all_reduce(t)
    return t.item() / world
