"""LoRA through the chunk engine, first part of issue 13: a `peft` model's frozen base goes
to the frozen (param-only) list and its adapters train in the chunk lists; the numbers
equal peft + torch AdamW, and the base stays bitwise what it was."""

from __future__ import annotations

import copy

import peft
import pytest
import torch

import pstar_core
from pstar_core.chunk import ChunkType
from tests.core.helpers import MODELS, batches, engine_config, run_engine, torch_adamw

STEPS = 20


def lora_llama() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = peft.LoraConfig(
        r=4,
        lora_alpha=8,
        lora_dropout=0.0,
        target_modules=["q_proj", "v_proj", "up_proj"],
        init_lora_weights=False,  # random B too, so the adapters change the output at once
    )
    return peft.get_peft_model(MODELS["hf_llama"](), cfg)


@pytest.fixture(scope="module")
def reference():
    """peft + torch AdamW (fp32) over the adapters: the ground truth."""
    ref = lora_llama()
    model = copy.deepcopy(ref)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch_adamw(model, 1e-3, 0.1, params=params)
    losses = []
    for x in batches(STEPS):
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return ref, losses


def make(ref, memory=None):
    engine = pstar_core.initialize(lora_llama, engine_config(chunk_size=4096, memory=memory or {}))
    engine.load_state_dict(ref.state_dict())
    return engine


@pytest.mark.parametrize("evicting", [False, True], ids=["roomy", "evicting"])
def test_lora_equals_peft_with_torch_adamw(reference, evicting):
    ref, want = reference
    memory = None
    if evicting:
        chunk_bytes = make(ref).stats()["chunk_bytes"]
        memory = {"device_budget": 2_000_000 + chunk_bytes // 3}
    engine = make(ref, memory)
    got = run_engine(engine, batches(STEPS))
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=0)
    if evicting:
        assert engine.stats()["bytes_moved"].get("device->host", 0) > 0


def test_the_base_stays_bitwise_and_only_adapters_carry_optimizer_state(reference):
    ref, _ = reference
    engine = make(ref)
    before = {k: v.clone() for k, v in engine.state_dict().items() if "lora_" not in k}
    run_engine(engine, batches(3))
    after = engine.state_dict()
    for name, value in before.items():
        assert torch.equal(after[name], value), name
    trainable = {s.name for s in engine.manager.slots if s.trainable}
    assert trainable
    assert all("lora_" in n for n in trainable)
    st = engine.stats()["chunks"]
    # the base is in the frozen list: compute dtype only, no grad, master or Adam state
    frozen = sum(s.numel for s in engine.manager.slots if not s.trainable)
    assert st[ChunkType.FROZEN.value]["bytes"] >= 4 * frozen  # fp32 here
    assert st[ChunkType.MOMENTUM.value]["bytes"] < st[ChunkType.FROZEN.value]["bytes"] / 4
