"""Tensors larger than a chunk span chunks ([Note: tensors spanning chunks] in mapping.py):
the engine trains, saves, loads and exports exactly as when each tensor fits one chunk."""

from __future__ import annotations

import pytest
import torch

import pstar_core
from pstar_core.chunk import TensorState
from pstar_core.hf import load_causal_lm
from tests.core.helpers import (
    MODELS,
    batches,
    engine_config,
    lora_model,
    reference_model,
    run_engine,
    spawn_ranks,
)

LR, WD = 1e-3, 0.1
SMALL = 1024  # elements: the tiny models' embeddings (4096) and MLP weights span chunks


def make(model_fn, ref, chunk_size, **cfg):
    engine = pstar_core.initialize(
        model_fn, engine_config(lr=LR, wd=WD, chunk_size=chunk_size, **cfg)
    )
    engine.load_state_dict(ref.state_dict())
    return engine


def spanning_names(engine):
    return {span.name for span in engine.spans.values()}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_losses_are_bitwise_those_of_chunks_that_hold_every_tensor(name):
    ref = reference_model(MODELS[name])
    data = batches(4)
    whole = make(MODELS[name], ref, "auto")
    spanned = make(MODELS[name], ref, SMALL)
    assert not whole.spans
    emb = (
        "wte.weight"
        if name == "gpt"
        else next(n for n in ref.state_dict() if "wte" in n or "embed" in n)
    )
    assert emb in spanning_names(spanned)
    assert {n for n, _ in spanned.plan.spanning} == spanning_names(spanned)
    assert run_engine(spanned, data) == run_engine(whole, data)
    assert all(s.capacity == SMALL for s in spanned.manager.chunks())


def test_bf16_with_activation_checkpointing_and_micro_batches_is_bitwise_the_same():
    ref = reference_model(MODELS["hf_llama"])
    data = batches(4)
    extra = {"dtype": "bf16", "activation_checkpointing": True}
    whole = run_engine(make(MODELS["hf_llama"], ref, "auto", **extra), data, micro_batches=2)
    spanned = run_engine(make(MODELS["hf_llama"], ref, SMALL, **extra), data, micro_batches=2)
    assert spanned == whole


def test_evicting_under_a_device_budget_is_bitwise_the_same():
    ref = reference_model(MODELS["hf_gpt2"])
    data = batches(5)
    whole = run_engine(make(MODELS["hf_gpt2"], ref, "auto"), data)
    probe = make(MODELS["hf_gpt2"], ref, SMALL)
    budget = probe.stats()["chunk_bytes"] // 3
    engine = make(MODELS["hf_gpt2"], ref, SMALL, memory={"device_budget": 2_000_000 + budget})
    assert run_engine(engine, data) == whole
    assert engine.stats()["bytes_moved"].get("device->host", 0) > 0


def test_the_parameter_has_memory_only_while_its_operator_runs():
    """A span's contiguous copy lives for its operator: none between operators. Backward
    reads the head's saved weight (a reference packed in forward) from the copy its own
    Access makes: the parameter points at the empty placeholder in between."""
    ref = reference_model(MODELS["hf_llama"])
    engine = make(MODELS["hf_llama"], ref, SMALL)
    head = next(s for s in engine.spans.values() if s.name == "lm_head.weight")
    seen = []
    # runs after the engine's own pre-hook (registered first): the operator's view
    engine.module.lm_head.register_forward_pre_hook(
        lambda mod, args: seen.append(mod.weight.numel())
    )
    x = batches(1)[0]
    loss = engine(input_ids=x, labels=x).loss
    assert seen == [head.numel]  # the operator saw the whole weight
    assert head.buffer is None
    assert head.param.numel() == 0
    assert all(p.state is TensorState.HOLD for p in head.pieces)
    engine.backward(loss)
    assert head.buffer is None
    assert head.param.numel() == 0
    assert all(p.state is TensorState.HOLD_AFTER_BWD for p in head.pieces)
    engine.step()


def test_state_dict_checkpoint_and_hf_export_see_whole_tensors(tmp_path):

    ref = reference_model(MODELS["hf_gpt2"])
    data = batches(6)
    straight = make(MODELS["hf_gpt2"], ref, SMALL)
    sd = straight.state_dict()
    assert list(sd) == list(ref.state_dict())
    for k, v in ref.state_dict().items():
        assert torch.equal(sd[k], v), k
    expected = run_engine(straight, data)

    first = make(MODELS["hf_gpt2"], ref, SMALL)
    run_engine(first, data[:3])
    first.save_checkpoint(tmp_path / "ckpt")
    resumed = pstar_core.initialize(
        MODELS["hf_gpt2"], engine_config(lr=LR, wd=WD, chunk_size=SMALL)
    )
    resumed.load_checkpoint(tmp_path / "ckpt")
    assert run_engine(resumed, data[3:]) == expected[3:]

    out = resumed.export_hf(tmp_path / "out")
    loaded = load_causal_lm(out)
    for k, v in loaded.state_dict().items():
        assert torch.equal(v, resumed.state_dict()[k]), k
    # tied: the embedding and the head are one span, exported once and tied again
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()


def test_weights_stream_from_a_model_dir_into_the_pieces(tmp_path):
    model = reference_model(MODELS["hf_llama"])
    model.save_pretrained(tmp_path / "src", max_shard_size="20KB")
    engine = pstar_core.initialize(tmp_path / "src", engine_config(chunk_size=SMALL))
    assert "model.embed_tokens.weight" in spanning_names(engine)
    sd = engine.state_dict()
    for k, v in model.state_dict().items():
        assert torch.equal(sd[k], v), k
    x = batches(1)[0]
    with torch.no_grad():
        torch.testing.assert_close(
            engine(input_ids=x).logits, model(input_ids=x).logits, rtol=1e-5, atol=1e-6
        )


def test_random_init_writes_the_same_weights_into_the_pieces():
    torch.manual_seed(3)
    whole = pstar_core.initialize(MODELS["hf_llama"], engine_config()).state_dict()
    torch.manual_seed(3)
    spanned = pstar_core.initialize(MODELS["hf_llama"], engine_config(chunk_size=SMALL))
    assert spanning_names(spanned)
    for k, v in spanned.state_dict().items():
        assert torch.equal(v, whole[k]), k


def test_a_frozen_base_that_spans_chunks_trains_its_adapters_the_same():
    ref = lora_model("hf_llama")
    data = batches(4)
    whole = make(lambda: lora_model("hf_llama"), ref, 4096)
    spanned = make(lambda: lora_model("hf_llama"), ref, SMALL)
    frozen = [s for s in spanned.spans.values() if not s.trainable]
    assert frozen  # the base's embedding and MLP weights span
    assert run_engine(spanned, data) == run_engine(whole, data)


def test_two_ranks_whose_tensors_span_chunks_match_one_rank(tmp_path):
    """ZeRO: a span's pieces lie in chunks that different ranks own; each is gathered.
    The ranks train `zero_worker`'s run (hf_gpt2, 20 batches of 8, half each); one rank
    here trains the same batches whole."""
    from tests.core.zero_worker import STEPS

    two = spawn_ranks("tests.core.zero_worker", 2, tmp_path, "train", PSTAR_TEST_CHUNK=str(SMALL))
    assert two[0]["stats_before"]["chunk_size"] == SMALL
    assert two[0]["losses"] == two[1]["losses"]
    ref = reference_model(MODELS["hf_gpt2"])
    one = run_engine(make(MODELS["hf_gpt2"], ref, 8192), batches(STEPS, batch=8))
    torch.testing.assert_close(torch.tensor(two[0]["losses"]), torch.tensor(one), rtol=1e-5, atol=0)


def test_the_forecast_loads_every_piece_and_counts_the_operators_copy():
    """The planner's iteration: an operator using a spanning tensor needs all the chunks
    its pieces lie in, and the tensor's contiguous copy is non-model memory then."""
    from pstar_core.forecast import Moment, forecast
    from pstar_core.mapping import make_plan

    numels = [512, 3000, 512]  # the middle one spans 4 chunks of 1024, from a's rest on
    plan = make_plan(numels, [True] * 3, ["a", "big", "b"], "fp32", 1024)
    assert plan.spanning == (("big", 4),)
    steps = [Moment("op:a", (0,), 100), Moment("op:big", (1,), 100), Moment("op:b", (2,), 100)]
    f = forecast(plan, [True] * 3, steps, 1 << 30)
    assert f.non_model_peak_bytes == 100 + 3000 * 4  # the copy, in fp32
    # the big tensor's operator needs its 4 chunks and room for its copy
    assert f.least_device_bytes == 4 * 1024 * 4 + 100 + 3000 * 4
