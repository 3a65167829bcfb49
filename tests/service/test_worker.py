"""The one worker loop's own parts: the supervised objective's micro-batches, the FLOPs
count against independently counted parameters, and the metrics file of `pstar train`."""

from __future__ import annotations

import json
import math

import pytest
import torch

import pstar_core
from pstar_core.hf import load_causal_lm
from service.methods.objectives import Rows, Supervised
from service.worker.loop import flops_per_token
from service.worker.runlog import RunLog
from tests.core.helpers import MODELS, SEQ, VOCAB, engine_config
from tests.service.runs import run_plan


def _rows(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """4 rows; the labels of the first two are mostly ignored, so the two halves carry
    different numbers of labelled tokens (a plain mean over slices would be wrong)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, VOCAB, (4, SEQ), generator=g)
    y = x.clone()
    y[:2, : SEQ - 3] = -100
    return x, y


def _engine():
    """A tiny GPT whose first AdamW step moves each weight by g / (|g| + 1): with eps 1
    the step is (nearly) linear in the gradient, so weights compare gradients (with the
    usual eps, g / |g| is +-1 and a gradient near 0 flips sign on rounding alone)."""
    torch.manual_seed(0)
    cfg = engine_config(wd=0.0)
    cfg["optimizer"] = {**cfg["optimizer"], "lr": 1.0, "eps": 1.0}
    return pstar_core.initialize(MODELS["gpt"], cfg)


def _trained(micro_batches: int, x: torch.Tensor, y: torch.Tensor):
    engine = _engine()
    r = Supervised().train_step(engine, Rows(x, y), micro_batches)
    return engine.state_dict(), (r["loss_sum"], r["correct"], r["count"])


def test_micro_batches_give_the_step_of_the_whole_batch_weighted_by_labelled_tokens():
    x, y = _rows()
    whole, (loss1, correct1, count1) = _trained(1, x, y)
    sliced, (loss2, correct2, count2) = _trained(2, x, y)
    assert count1 == count2 == int((y[:, 1:] != -100).sum())
    assert correct1 == correct2
    # fp32 sums of the same terms in another order: ~1e-7 relative per value (sqrt of
    # the terms summed times 2^-24); 1e-5 relative and 1e-6 absolute leave a margin of 10
    assert loss2 == pytest.approx(loss1, rel=1e-5)
    for name, value in whole.items():
        torch.testing.assert_close(sliced[name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_a_slice_without_labelled_tokens_adds_nothing_and_no_nan():
    x, y = _rows()
    y[:2] = -100  # the first slice of 2 has nothing to learn from
    only, _ = _trained(1, x[2:], y[2:])
    engine = _engine()
    r = Supervised().train_step(engine, Rows(x, y), 2)
    loss, count = r["loss_sum"], r["count"]
    assert count == int((y[2:, 1:] != -100).sum())
    assert math.isfinite(loss)
    for name, value in engine.state_dict().items():
        assert torch.isfinite(value).all(), name
        torch.testing.assert_close(value, only[name], rtol=1e-5, atol=1e-6, msg=name)


def test_flops_count_every_parameter_once_and_frozen_ones_at_four(tmp_path):
    from peft import LoraConfig, get_peft_model

    from tests.tiny import make_tiny_llama

    base = make_tiny_llama(tmp_path / "base")
    lora = {"r": 4, "alpha": 8.0, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}
    # counted independently: the model as transformers and peft build it
    model = load_causal_lm(base)
    cfg = model.config
    full = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    wrapped = get_peft_model(
        model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    )
    params = {id(p): p for p in wrapped.parameters()}.values()
    adapters = sum(p.numel() for p in params if p.requires_grad)
    attention = 12 * cfg.num_hidden_layers * cfg.hidden_size * SEQ

    engine = pstar_core.initialize(base, engine_config())
    assert flops_per_token(engine, SEQ) == 6 * full + attention
    engine = pstar_core.initialize(base, engine_config(lora=lora))
    assert 0 < adapters < full // 10
    assert flops_per_token(engine, SEQ) == 6 * adapters + 4 * full + attention


def test_runlog_writes_every_log_every_step_and_the_last_and_reads_a_step_back(tmp_path):
    seen: list[int] = []
    log = RunLog(run_plan(), tmp_path, log_every=3, on_step=lambda step, _m: seen.append(step))
    log.runtime({"world_size": 2})
    log.metrics(0, {"full_valid_loss": 2.0})  # before training: kept, not a line
    for step in range(1, 8):
        if step == 5:
            log.resumed(4)
        log.metrics(step, {"train_loss": 1.0 / step, "trained_tokens": 10 * step}, total=7)
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [3, 6, 7]
    assert [m["attempt_resumed"] for m in lines] == [0, 1, 1]
    assert all(m["world_size"] == 2 for m in lines)
    assert seen == list(range(1, 8))
    assert log.before == {"full_valid_loss": 2.0}
    assert log.values_at(6)["trained_tokens"] == 60  # what a resumed run continues from
    assert log.values_at(5) == {}  # not a logged step
