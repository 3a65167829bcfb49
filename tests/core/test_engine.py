"""The engine trains exactly like PyTorch: same losses, same updates, same checkpoints."""

from __future__ import annotations

import copy

import pytest
import torch

import pstar_core
from pstar_core import TensorState
from tests.core.helpers import (
    MODELS,
    batches,
    engine_config,
    reference_model,
    run_engine,
    run_reference,
    run_reference_bf16,
)

LR, WD = 1e-3, 0.1


def make_engine(model_fn, ref, **cfg):
    engine = pstar_core.initialize(model_fn, engine_config(**cfg))
    engine.load_state_dict(ref.state_dict())
    return engine


@pytest.mark.parametrize("name", sorted(MODELS))
def test_fp32_matches_pytorch_adamw_over_20_steps(name):
    ref = reference_model(MODELS[name])
    data = batches(20)
    expected = run_reference(ref, data, LR, WD)
    got = run_engine(make_engine(MODELS[name], ref, lr=LR, wd=WD), data)
    assert expected[-1] < expected[0]  # the run actually trains
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=1e-5, atol=0)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_bf16_matches_pytorch_mixed_precision_recipe(name):
    # Both sides compute in bf16 from the same bf16 weights and update fp32 masters, so
    # they differ only where the fused kernel rounds an fp32 update differently from
    # torch's op-by-op AdamW (last-bit fp32 differences); such a difference can flip the
    # bf16 rounding of a weight by one bf16 ulp (2^-8 relative). Over 20 steps that moves
    # the loss by far less than one bf16 ulp of the loss, hence rtol = 2^-8.
    ref = reference_model(MODELS[name])
    data = batches(20)
    expected = run_reference_bf16(ref, data, LR, WD)
    got = run_engine(make_engine(MODELS[name], ref, dtype="bf16", lr=LR, wd=WD), data)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=2**-8, atol=0)


@pytest.mark.parametrize("name", ["gpt", "hf_llama"])
def test_activation_checkpointing_gives_identical_losses(name):
    ref = reference_model(MODELS[name])
    data = batches(5)
    plain = run_engine(make_engine(MODELS[name], ref, lr=LR, wd=WD), data)
    ckpt = run_engine(
        make_engine(MODELS[name], ref, lr=LR, wd=WD, activation_checkpointing=True), data
    )
    assert plain == ckpt


@pytest.mark.parametrize("name", ["gpt", "hf_gpt2"])
def test_four_micro_batches_equal_one_batch(name):
    ref = reference_model(MODELS[name])
    data = batches(6, batch=8)
    whole = run_engine(make_engine(MODELS[name], ref, lr=LR, wd=WD), data)
    engine = make_engine(MODELS[name], ref, lr=LR, wd=WD)
    accumulated = run_engine(engine, data, micro_batches=4)
    torch.testing.assert_close(torch.tensor(accumulated), torch.tensor(whole), rtol=1e-5, atol=0)
    # the fp32 accumulation chunks existed while accumulating, and are gone after step()
    assert engine.stats()["peak_grad_accum_bytes"] > 0
    assert engine.stats()["grad_accum_bytes"] == 0


def test_accumulation_memory_is_four_bytes_per_trainable_param():
    ref = reference_model(MODELS["gpt"])
    engine = make_engine(MODELS["gpt"], ref, dtype="bf16")
    x = batches(1)[0]
    for mb in x.chunk(2):
        engine.backward(engine(input_ids=mb, labels=mb).loss)
    stats = engine.stats()
    assert stats["grad_accum_bytes"] == 4 * stats["chunks"]["param"]["count"] * stats["chunk_size"]
    assert stats["model_data_bytes_per_param"] == pytest.approx(14 + 4, rel=0.1)
    engine.step()
    assert engine.stats()["model_data_bytes_per_param"] == 14


def test_grad_overwrites_param_slot_after_last_use():
    ref = reference_model(MODELS["gpt"])
    engine = make_engine(MODELS["gpt"], ref)
    x = batches(1)[0]
    engine.backward(engine(input_ids=x, labels=x).loss)
    ref_loss = ref(input_ids=x, labels=x).loss
    ref_loss.backward()
    wte = engine.by_name["wte.weight"]  # tied with lm_head: two uses, one gradient
    assert wte.state is TensorState.HOLD_AFTER_BWD
    assert engine.module.wte.weight.numel() == 0  # the temporary grad and view are gone
    assert engine.module.wte.weight.grad is None
    slot = engine.manager.param_chunk(wte).view(wte)
    torch.testing.assert_close(slot, ref.wte.weight.grad, rtol=1e-5, atol=1e-7)


def test_frozen_params_are_bitwise_unchanged_and_have_no_optimizer_state():
    def lora_like():
        model = MODELS["gpt"]()
        for name, p in model.named_parameters():
            if "attn" in name or "wpe" in name:
                p.requires_grad_(False)
        return model

    ref = reference_model(lora_like)
    engine = make_engine(lora_like, ref)
    before = engine.state_dict()
    frozen = [n for n, p in ref.named_parameters() if not p.requires_grad]
    run_engine(engine, batches(3))
    after = engine.state_dict()
    assert frozen
    for n in frozen:
        assert torch.equal(before[n], after[n]), n
    assert not torch.equal(before["ln_f.weight"], after["ln_f.weight"])
    stats = engine.stats()
    n_frozen = sum(p.numel() for p in ref.parameters() if not p.requires_grad)
    assert stats["chunks"]["frozen"]["used_bytes"] == 4 * n_frozen
    assert stats["trainable_params"] == stats["params"] - n_frozen
    # frozen tensors have no slots in the optimizer-state lists
    assert stats["chunks"]["momentum"]["used_bytes"] == 4 * stats["trainable_params"]


class Gated(torch.nn.Module):
    """A model whose `extra` block runs only when asked: unused parameters in some steps."""

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(8, 8)
        self.extra = torch.nn.Linear(8, 8)
        self.out = torch.nn.Linear(8, 1)

    def forward(self, x, use_extra):
        h = torch.relu(self.inp(x))
        if use_extra:
            h = h + self.extra(h)
        return self.out(h).pow(2).mean()


def test_module_skipped_in_some_steps_is_not_updated_then():
    torch.manual_seed(0)
    ref = Gated()
    engine = make_engine(Gated, ref)
    x = torch.randn(4, 8)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.0, foreach=False)
    engine_cfg_wd0 = pstar_core.initialize(Gated, engine_config(wd=0.0))
    engine_cfg_wd0.load_state_dict(ref.state_dict())
    for use_extra in [True, False, False, True, False]:
        before = engine_cfg_wd0.state_dict()["extra.weight"]
        engine_cfg_wd0.backward(engine_cfg_wd0(x, use_extra))
        assert engine_cfg_wd0.step()
        after = engine_cfg_wd0.state_dict()["extra.weight"]
        assert torch.equal(before, after) != use_extra
        ref(x, use_extra).backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
    torch.testing.assert_close(engine_cfg_wd0.state_dict()["extra.weight"], ref.extra.weight)
    torch.testing.assert_close(engine_cfg_wd0.state_dict()["inp.weight"], ref.inp.weight)
    del engine


def test_save_load_continue_is_bitwise_uninterrupted(tmp_path):
    ref = reference_model(MODELS["hf_llama"])
    data = batches(8)
    straight = make_engine(MODELS["hf_llama"], ref, dtype="bf16", lr=LR, wd=WD)
    expected = run_engine(straight, data)

    first = make_engine(MODELS["hf_llama"], ref, dtype="bf16", lr=LR, wd=WD)
    run_engine(first, data[:4])
    first.save_checkpoint(tmp_path / "ckpt")
    resumed = pstar_core.initialize(MODELS["hf_llama"], engine_config("bf16", lr=LR, wd=WD))
    resumed.load_checkpoint(tmp_path / "ckpt")
    assert resumed.global_step == 4
    assert run_engine(resumed, data[4:]) == expected[4:]


def test_loading_the_weights_alone_starts_adam_again_from_them(tmp_path):
    """optimizer=False: the trained weights (chunked and excluded alike), a fresh Adam
    (step 0, zero moments): the next steps are a new AdamW run from those weights."""
    ref = reference_model(MODELS["hf_llama"])
    data = batches(6)
    trained = make_engine(MODELS["hf_llama"], ref, lr=LR, wd=WD)
    run_engine(trained, data[:3])
    trained.save_checkpoint(tmp_path / "ckpt")
    weights = trained.state_dict()
    loaded = pstar_core.initialize(MODELS["hf_llama"], engine_config(lr=LR, wd=WD))
    loaded.load_checkpoint(tmp_path / "ckpt", optimizer=False)
    assert loaded.global_step == 0
    for k, v in weights.items():
        assert torch.equal(loaded.state_dict()[k], v), k
    # a new engine given the same weights by state_dict trains the same from here
    fresh = pstar_core.initialize(MODELS["hf_llama"], engine_config(lr=LR, wd=WD))
    fresh.load_state_dict(weights)
    want = run_engine(fresh, data[3:])
    assert run_engine(loaded, data[3:]) == want
    assert want != run_engine(trained, data[3:])  # which the optimizer state would change


class _Planted:
    """What a crafted checkpoint file would hold: unpickling it runs code."""

    def __reduce__(self):
        import pathlib

        return (pathlib.Path.touch, (pathlib.Path(_Planted.marker),))


def test_a_checkpoint_file_that_would_run_code_is_refused_without_running_it(tmp_path):
    from pstar_core.checkpoint import CheckpointError

    ref = reference_model(MODELS["hf_llama"])
    engine = make_engine(MODELS["hf_llama"], ref, dtype="bf16", lr=LR, wd=WD)
    run_engine(engine, batches(1))
    engine.save_checkpoint(tmp_path / "ckpt")
    extra = next((tmp_path / "ckpt").glob("*.extra.pt"))
    state = torch.load(extra, weights_only=True)
    _Planted.marker = str(tmp_path / "ran")
    torch.save({**state, "steps": _Planted()}, extra)
    resumed = pstar_core.initialize(MODELS["hf_llama"], engine_config("bf16", lr=LR, wd=WD))
    with pytest.raises(CheckpointError, match="tensors and plain values only"):
        resumed.load_checkpoint(tmp_path / "ckpt")
    assert not (tmp_path / "ran").exists()


def test_state_dict_round_trips_under_the_models_own_names():
    ref = reference_model(MODELS["hf_gpt2"])
    engine = make_engine(MODELS["hf_gpt2"], ref)
    sd = engine.state_dict()
    assert list(sd) == list(ref.state_dict())
    for k, v in ref.state_dict().items():
        assert torch.equal(sd[k], v), k


def test_load_state_dict_names_missing_and_unexpected_keys():
    ref = reference_model(MODELS["gpt"])
    engine = make_engine(MODELS["gpt"], ref)
    sd = ref.state_dict()
    sd["bogus.weight"] = sd.pop("ln_f.weight")
    with pytest.raises(KeyError, match=r"missing \['ln_f.weight'\].*unexpected \['bogus.weight'\]"):
        engine.load_state_dict(sd)


def test_bf16_model_data_is_14_bytes_per_param():
    engine = pstar_core.initialize(MODELS["gpt"], engine_config("bf16"))
    stats = engine.stats()
    assert stats["model_data_bytes_per_param"] == 14
    assert stats["params"] == sum(p.numel() for p in reference_model(MODELS["gpt"]).parameters())


def test_illegal_transition_names_param_and_both_states():
    engine = pstar_core.initialize(MODELS["gpt"], engine_config())
    x = batches(1)[0]
    engine.backward(engine(input_ids=x, labels=x).loss)
    slot = engine.by_name["ln_f.weight"]
    with pytest.raises(
        pstar_core.IllegalTransition, match=r"'ln_f\.weight'.*HOLD_AFTER_BWD -> COMPUTE"
    ):
        slot.set_state(TensorState.COMPUTE)


def test_fp16_overflow_skips_step_and_backs_off_loss_scale():
    ref = reference_model(MODELS["gpt"])
    engine = make_engine(MODELS["gpt"], ref, dtype="fp16", loss_scale={"init_scale": 2.0**100})
    x = batches(1)[0]
    before = engine.state_dict()
    engine.backward(engine(input_ids=x, labels=x).loss)
    assert engine.step() is False
    assert engine.stats()["overflow_count"] == 1
    assert engine.stats()["loss_scale"] == 2.0**99
    after = engine.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    # the params were restored: the next forward sees the weights, not gradients
    engine.scaler.scale = 2.0**8
    engine.backward(engine(input_ids=x, labels=x).loss)
    assert engine.step() is True


def test_fp16_trains_close_to_fp32():
    ref = reference_model(MODELS["gpt"])
    data = batches(10)
    fp32 = run_engine(make_engine(MODELS["gpt"], ref), data)
    fp16 = run_engine(make_engine(MODELS["gpt"], ref, dtype="fp16"), data)
    torch.testing.assert_close(torch.tensor(fp16), torch.tensor(fp32), rtol=5e-3, atol=0)


def test_gradient_clipping_matches_torch_clip_grad_norm():
    ref = reference_model(MODELS["gpt"])
    engine = make_engine(MODELS["gpt"], ref, gradient_clipping=0.05)
    model = reference_model(MODELS["gpt"])
    model.load_state_dict(ref.state_dict())
    from tests.core.helpers import torch_adamw

    opt = torch_adamw(model, LR, WD)
    for x in batches(5):
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        assert norm > 0.05  # clipping really happens in this test
        opt.step()
        opt.zero_grad(set_to_none=True)
        engine.backward(engine(input_ids=x, labels=x).loss)
        engine.step()
    for k, v in model.state_dict().items():
        torch.testing.assert_close(engine.state_dict()[k], v, rtol=1e-5, atol=1e-6)


def test_excluded_params_live_outside_chunks_and_train_the_same():
    ref = reference_model(MODELS["gpt"])
    data = batches(5)
    expected = run_reference(ref, data, LR, WD)
    engine = make_engine(MODELS["gpt"], ref, lr=LR, wd=WD, exclude_from_chunks=["^wpe\\."])
    assert "wpe.weight" not in engine.by_name
    assert engine.module.wpe.weight.numel() > 0  # a plain tensor, always materialized
    got = run_engine(engine, data)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=1e-5, atol=0)


def test_model_fn_with_real_weights_is_copied_into_chunks():
    ref = reference_model(MODELS["gpt"])
    expected = {k: v.clone() for k, v in ref.state_dict().items()}
    engine = pstar_core.initialize(lambda: ref, engine_config())
    for k, v in expected.items():
        assert torch.equal(engine.state_dict()[k], v)


def test_eval_forward_between_backward_and_step_keeps_gradients():
    ref = reference_model(MODELS["gpt"])
    data = batches(3)
    expected = run_reference(ref, data, LR, WD)
    engine = make_engine(MODELS["gpt"], ref, lr=LR, wd=WD)
    got = []
    for x in data:
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        with torch.no_grad():
            engine(input_ids=x, labels=x)  # a look at the model before stepping
        engine.step()
        got.append(loss.item())
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=1e-5, atol=0)


def test_the_engine_imports_nothing_of_the_service():
    """`pstar_core` installs beside a GPU image's own packages: importing it and training
    brings in no Ray, FastAPI, database or HTTP client (nor transformers or peft, which
    only Hugging Face models and LoRA load)."""
    import subprocess
    import sys

    code = (
        "import sys, torch, pstar_core\n"
        "from pstar_core.models import build\n"
        "e = pstar_core.initialize(lambda: build('gpt-tiny'), {'dtype': 'fp32'})\n"
        "x = torch.randint(0, 512, (2, 16))\n"
        "e.backward(e(input_ids=x, labels=x).loss); e.step()\n"
        "bad = ('ray', 'fastapi', 'sqlalchemy', 'httpx', 'uvicorn', 'transformers', 'peft')\n"
        "print(sorted(m for m in bad if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip().splitlines()[-1] == "[]"


# a loop that sets AdamW's settings per step (Tinker's optim_step): they change every step
# (and clip the gradient's norm on some: 0.05 is below every step's norm here)
STEP_HYPERS = [
    pstar_core.StepHyper(
        lr=1e-3 * (1 + i % 3), betas=(0.9, 0.95), eps=1e-12, weight_decay=wd, max_grad_norm=clip
    )
    for i, (wd, clip) in enumerate(
        [(0.0, None), (0.1, 0.05), (0.0, None), (0.05, 0.05), (0.1, None), (0.0, 0.05)]
    )
]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_per_step_adamw_settings_match_torch_adamw_given_the_same(name):
    ref = reference_model(MODELS[name])
    data = batches(len(STEP_HYPERS))
    model = copy.deepcopy(ref)
    opt = torch.optim.AdamW(
        [
            {"params": [p for p in model.parameters() if p.dim() >= 2], "decays": True},
            {"params": [p for p in model.parameters() if p.dim() < 2], "decays": False},
        ],
        foreach=False,
    )
    expected = []
    for x, h in zip(data, STEP_HYPERS, strict=True):
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        if h.max_grad_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), h.max_grad_norm)
            assert norm > h.max_grad_norm  # the clipping is real
        for g in opt.param_groups:
            g.update(lr=h.lr, betas=h.betas, eps=h.eps)
            g["weight_decay"] = h.weight_decay if g["decays"] else 0.0
        opt.step()
        opt.zero_grad(set_to_none=True)
        expected.append(loss.item())
    # the config's own settings (lr, betas, decay, clipping) must not leak into these steps
    engine = make_engine(MODELS[name], ref, lr=0.5, wd=0.3, gradient_clipping=1e-4)
    got = []
    for x, h in zip(data, STEP_HYPERS, strict=True):
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step(h)
        got.append(loss.item())
    # and the last step's update, seen through one more forward (the parameters are not
    # compared one by one: with eps 1e-12, a key bias, which gets no gradient from softmax
    # attention, moves by rounding noise on both sides, and the loss never sees it)
    with torch.no_grad():
        expected.append(model(input_ids=data[0], labels=data[0]).loss.item())
        got.append(engine(input_ids=data[0], labels=data[0]).loss.item())
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=1e-5, atol=0)


def test_step_settings_out_of_range_are_refused():
    with pytest.raises(ValueError, match="betas"):
        pstar_core.StepHyper(lr=1e-3, betas=(0.9, 1.0), eps=1e-8)
    with pytest.raises(ValueError, match="out of range"):
        pstar_core.StepHyper(lr=1e-3, betas=(0.9, 0.95), eps=0.0)
