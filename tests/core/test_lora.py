"""LoRA through the chunk engine, first part of issue 13: a `peft` model's frozen base goes
to the frozen (param-only) list and its adapters train in the chunk lists; the numbers
equal peft + torch AdamW, and the base stays bitwise what it was."""

from __future__ import annotations

import peft
import pytest
import torch

import pstar_core
from pstar_core.chunk import ChunkType
from pstar_core.hf import load_causal_lm
from tests.core.helpers import (
    MODELS,
    TARGETS,
    batches,
    engine_config,
    lora_model,
    reference_model,
    run_engine,
    run_reference,
    tiny_hf_llama,
)

STEPS = 20


@pytest.fixture(scope="module", params=list(TARGETS))
def reference(request):
    """peft + torch AdamW (fp32) over the adapters: the ground truth."""
    ref = lora_model(request.param)
    # torch AdamW skips the frozen base: its parameters get no gradient
    return request.param, ref, run_reference(ref, batches(STEPS), 1e-3, 0.1)


def make(name, ref, memory=None):
    engine = pstar_core.initialize(
        lambda: lora_model(name), engine_config(chunk_size=4096, memory=memory or {})
    )
    engine.load_state_dict(ref.state_dict())
    return engine


@pytest.mark.parametrize("evicting", [False, True], ids=["roomy", "evicting"])
def test_lora_equals_peft_with_torch_adamw(reference, evicting):
    name, ref, want = reference
    memory = None
    if evicting:
        chunk_bytes = make(name, ref).stats()["chunk_bytes"]
        memory = {"device_budget": 2_000_000 + chunk_bytes // 3}
    engine = make(name, ref, memory)
    got = run_engine(engine, batches(STEPS))
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=0)
    if evicting:
        assert engine.stats()["bytes_moved"].get("device->host", 0) > 0


def test_the_base_stays_bitwise_and_only_adapters_carry_optimizer_state(reference):
    name, ref, _ = reference
    engine = make(name, ref)
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


# -- the `lora` section: the engine wraps a model directory's base itself ---------------

LORA = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "up_proj"]}


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("base") / "llama"
    reference_model(MODELS["hf_llama"]).save_pretrained(d)
    return d


def lora_engine(base_dir, **extra):
    cfg = engine_config(chunk_size=4096, **extra)
    cfg["lora"] = {**LORA, **cfg.get("lora", {})}
    return pstar_core.initialize(base_dir, cfg)


def peft_on(base_dir, engine=None):
    """peft's own model on the same base, with the engine's adapters if given."""

    model = load_causal_lm(base_dir, dtype=torch.float32)
    model = peft.get_peft_model(
        model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=LORA["target_modules"])
    )
    if engine is not None:
        model.load_state_dict(engine.state_dict())
    return model


def test_lora_section_on_a_model_dir_starts_at_the_base_and_trains_like_peft(base_dir):
    engine = lora_engine(base_dir)
    x = batches(1)[0]

    base = load_causal_lm(base_dir, dtype=torch.float32)
    with torch.no_grad():
        # B starts at zero (peft's init), so the adapted model is the base model
        engine.eval()
        torch.testing.assert_close(engine(input_ids=x).logits, base(input_ids=x).logits)
        engine.train()
    ref = peft_on(base_dir, engine)
    want = run_reference(ref, batches(STEPS), 1e-3, 0.1)
    got = run_engine(engine, batches(STEPS))
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=0)
    adapters = sum(p.numel() for p in ref.parameters() if p.requires_grad)
    assert engine.stats()["trainable_params"] == adapters


def test_adapter_export_reloads_in_peft_and_merged_equals_merge_and_unload(base_dir, tmp_path):

    engine = lora_engine(base_dir)
    run_engine(engine, batches(5))
    out = engine.export_hf(tmp_path / "adapter")
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("adapter_")) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    base = load_causal_lm(base_dir, dtype=torch.float32)
    loaded = peft.PeftModel.from_pretrained(base, out).eval()
    x = batches(1, seed=7)[0]
    engine.eval()
    with torch.no_grad():
        mine = engine(input_ids=x).logits
        torch.testing.assert_close(loaded(input_ids=x).logits, mine, rtol=1e-5, atol=1e-6)
    merged_dir = engine.export_hf(tmp_path / "merged", dtype=torch.float32, variant="merged")
    merged = load_causal_lm(merged_dir, dtype=torch.float32)
    theirs = loaded.merge_and_unload()
    for name, value in theirs.state_dict().items():
        torch.testing.assert_close(merged.state_dict()[name], value, rtol=0, atol=1e-7)
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=x).logits, mine, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="exports as 'adapter' or 'merged'"):
        engine.export_hf(tmp_path / "full", variant="full")


def test_training_continues_from_an_exported_adapter(base_dir, tmp_path):
    engine = lora_engine(base_dir)
    run_engine(engine, batches(4))
    adapter = engine.export_hf(tmp_path / "adapter")
    want = run_engine(engine, batches(3, seed=5))
    # a fresh engine from the same base and the adapter: same weights, fresh optimizer
    again = lora_engine(base_dir, lora={"adapter_dir": str(adapter)})
    mine = {k: v for k, v in engine.state_dict().items() if "lora_" in k}
    assert mine
    first = run_engine(again, batches(1, seed=5))[0]
    # the adapters were loaded: the first loss equals the trained engine's, not a fresh one's
    assert first == pytest.approx(want[0], rel=1e-6)
    with pytest.raises(pstar_core.ConfigError, match=r"lora\.r is 8 but the adapter"):
        lora_engine(base_dir, lora={"adapter_dir": str(adapter), "r": 8})


def test_lora_checkpoint_holds_adapters_only_and_resumes_bitwise(base_dir, tmp_path):
    engine = lora_engine(base_dir)
    run_engine(engine, batches(3))
    ckpt = engine.save_checkpoint(tmp_path / "ckpt")
    want = run_engine(engine, batches(4, seed=3))
    from safetensors import safe_open

    with safe_open(str(next(ckpt.glob("*.safetensors"))), "pt") as f:
        keys = list(f.keys())
    assert keys
    assert not [k for k in keys if k.startswith(ChunkType.FROZEN.value)]
    size = sum(p.stat().st_size for p in ckpt.iterdir())
    assert size < engine.stats()["chunks"][ChunkType.FROZEN.value]["bytes"]
    resumed = lora_engine(base_dir)
    resumed.load_checkpoint(ckpt)
    assert run_engine(resumed, batches(4, seed=3)) == want
    # a model not read from that directory cannot take the base from it
    other = pstar_core.initialize(MODELS["hf_llama"], engine_config(chunk_size=4096, lora=LORA))
    with pytest.raises(pstar_core.checkpoint.CheckpointError, match="initialize the engine"):
        other.load_checkpoint(ckpt)


# -- two ranks: the frozen base is sharded and only ever all-gathered --------------------


@pytest.mark.parametrize(
    ("name", "evicting"),
    [("hf_gpt2", False), ("hf_gpt2", True), ("hf_llama", False), ("hf_llama", True)],
    ids=["gpt2-roomy", "gpt2-evicting", "llama-roomy", "llama-evicting"],
)
def test_two_ranks_equal_peft_and_send_the_base_in_all_gathers_only(tmp_path, name, evicting):
    import json

    from tests.core import zero_worker
    from tests.core.helpers import spawn_ranks

    ref = reference_model(lambda: lora_model(name))
    want = run_reference(ref, batches(zero_worker.STEPS, batch=8), 1e-3, 0.1)
    env = {"PSTAR_TEST_LORA": name}
    if evicting:
        env["PSTAR_TEST_MEMORY"] = json.dumps({"device_budget": 750_000})
    ranks = spawn_ranks("tests.core.zero_worker", 2, tmp_path, "train", **env)
    torch.testing.assert_close(
        torch.tensor(ranks[0]["losses"]), torch.tensor(want), rtol=1e-5, atol=0
    )
    for r in ranks:
        by_list, lists = r["comm_by_list"], r["chunk_lists"]
        assert set(by_list[ChunkType.FROZEN.value]) == {"all_gather"}
        # each rank sends its own adapter chunks once per step in a reduce-scatter
        assert (
            by_list[ChunkType.PARAM.value]["reduce_scatter"]
            == zero_worker.STEPS * lists[ChunkType.PARAM.value]["bytes"]
        )
        # the base goes out in forward and again in backward, at most
        frozen = by_list[ChunkType.FROZEN.value]["all_gather"]
        assert frozen <= 2 * zero_worker.STEPS * lists[ChunkType.FROZEN.value]["bytes"]
        assert frozen >= zero_worker.STEPS * lists[ChunkType.FROZEN.value]["bytes"]
        if evicting:
            assert r["moved"].get("device->host", 0) > 0
        print(json.dumps({"rank_bytes": by_list, "lists": lists}))


# -- memory: ~2 bytes per base parameter, and bases larger than memory -----------------


def test_bytes_per_parameter_are_two_for_the_base_and_fourteen_for_adapters():
    cfg = engine_config("bf16", chunk_size=4096, lora={"r": 16})
    engine = pstar_core.initialize(MODELS["hf_llama"], cfg)
    st = engine.stats()
    assert st["bytes_per_param"] == {"frozen": 2.0, "trainable": 14.0}
    frozen = st["params"] - st["trainable_params"]
    want = (2 * frozen + 14 * st["trainable_params"]) / st["params"]
    assert st["model_data_bytes_per_param"] == pytest.approx(want)
    # 'all-linear': every projection got adapters, the head and embeddings did not
    names = {s.name for s in engine.manager.slots if s.trainable}
    assert any("o_proj.lora_A" in n for n in names)
    assert any("down_proj.lora_B" in n for n in names)
    assert not any("lm_head" in n or "embed" in n for n in names)


def test_a_base_larger_than_device_plus_host_trains_with_lora_where_full_is_refused(tmp_path):
    def big() -> torch.nn.Module:
        return tiny_hf_llama(hidden=128, intermediate=256, layers=8)

    lora = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}
    probe = pstar_core.initialize(big, engine_config(chunk_size=32768, lora=lora))
    base_bytes = probe.stats()["chunks"][ChunkType.FROZEN.value]["bytes"]
    full_bytes = 16 * probe.stats()["params"]  # fp32: param + master + two moments
    probe.close()
    memory = {
        "device_budget": 3_000_000,  # the chunks in use and the activations
        "host_budget": base_bytes // 10,
        "disk_budget": base_bytes,
        "disk_dir": str(tmp_path),
    }
    assert memory["device_budget"] + memory["host_budget"] < base_bytes
    assert memory["host_budget"] + memory["disk_budget"] < full_bytes
    with pytest.raises(pstar_core.tiers.MemoryBudgetError, match=r"raise memory\.host_budget"):
        pstar_core.initialize(big, engine_config(chunk_size=32768, memory=memory))
    engine = pstar_core.initialize(big, engine_config(chunk_size=32768, lora=lora, memory=memory))
    ref = peft.get_peft_model(
        big(), peft.LoraConfig(r=4, lora_alpha=8, target_modules=lora["target_modules"])
    )
    ref.load_state_dict(engine.state_dict())
    want = run_reference(ref, batches(4, batch=1), 1e-3, 0.1)
    got = run_engine(engine, batches(4, batch=1))
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=0)
    st = engine.stats()
    assert st["chunks"][ChunkType.FROZEN.value]["by_tier"].get("disk", 0) > 0
    assert st["bytes_moved"].get("disk->host", 0) > 0


def test_streaming_a_base_into_frozen_chunks_holds_no_more_than_the_host_budget(tmp_path):
    """A pretrained base streams into lazily made frozen chunks; full ones spill to disk
    as the next arrive, so loading peaks at the host budget, not at the whole base."""
    src = tmp_path / "base"
    reference_model(lambda: tiny_hf_llama(hidden=128, intermediate=256, layers=8)).save_pretrained(
        src
    )
    lora = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}
    torch.manual_seed(0)  # the adapters' random init
    roomy = pstar_core.initialize(src, engine_config(chunk_size=32768, lora=lora))
    base_bytes = roomy.stats()["chunks"][ChunkType.FROZEN.value]["bytes"]
    assert roomy.stats()["load_peak_bytes"]["host"] >= base_bytes  # all of it, at once
    host = base_bytes // 3
    memory = {
        "device_budget": 3_000_000,
        "host_budget": host,
        "disk_budget": 2 * base_bytes,
        "disk_dir": str(tmp_path),
    }
    torch.manual_seed(0)
    engine = pstar_core.initialize(src, engine_config(chunk_size=32768, lora=lora, memory=memory))
    st = engine.stats()
    assert st["load_peak_bytes"]["host"] <= host
    assert st["chunks"][ChunkType.FROZEN.value]["by_tier"].get("disk", 0) > 0
    # the same weights as the roomy load, and the same training
    for name, value in roomy.state_dict().items():
        assert torch.equal(engine.state_dict()[name], value), name
    assert run_engine(engine, batches(3, batch=1)) == run_engine(roomy, batches(3, batch=1))


@pytest.mark.parametrize(
    ("targets", "says"),
    [
        (["q_proj", "q_projj"], r"\['q_projj'\] match no module"),
        (["nothing_here"], "lora.target_modules"),
        (["q_proj", "embed_tokens"], "not linear layers"),
    ],
)
def test_lora_targets_that_do_not_name_linear_layers_are_refused(targets, says):
    cfg = engine_config(chunk_size=4096, lora={"r": 4, "target_modules": targets})
    with pytest.raises(pstar_core.ConfigError, match=says):
        pstar_core.initialize(MODELS["hf_llama"], cfg)


def test_training_steps_do_not_accumulate_objects():
    """The hooks that release frozen tensors after backward leave nothing behind: the
    live Python objects stay level from step to step (a hook cycle through autograd's
    nodes once leaked ~10 MB per step at 64 layers)."""
    import gc

    engine = pstar_core.initialize(MODELS["hf_llama"], engine_config(chunk_size=4096, lora=LORA))
    data = batches(12)
    run_engine(engine, data[:4])
    gc.collect()
    before = len(gc.get_objects())
    run_engine(engine, data[4:])
    gc.collect()
    assert len(gc.get_objects()) - before < 100
