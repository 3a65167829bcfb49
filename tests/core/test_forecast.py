"""The planner's forecast of an iteration against what the engine measures, with CPU
budgets standing in for the GPU and host tiers: device and host peaks and the bytes moved
each way, for three zoo models under three budget splits, within 10%."""

from __future__ import annotations

import pytest

from benchmarks.plan_check import (
    SPLITS,
    VALIDATION,
    check_split,
    cpu_forecast,
    resolved_chunk,
    split_budgets,
)


@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize(("model", "chunk_size"), VALIDATION)
def test_forecast_is_within_ten_percent_of_the_engine(model, chunk_size, split):
    row = check_split(model, chunk_size, split)
    for figure, error in row["error"].items():
        assert error <= 0.10, (figure, row["predicted"][figure], row["measured"][figure])


@pytest.mark.parametrize(("model", "chunk_size"), VALIDATION)
def test_the_three_splits_are_three_regimes(model, chunk_size):
    """A roomy device keeps every optimizer state (nothing moves); one that holds only the
    param chunks moves each of them out for Adam and back; the least budget moves at
    least as much, and the forecast says it cannot run in less."""
    chunk = resolved_chunk(model, chunk_size)
    f = {s: cpu_forecast(model, split_budgets(model, chunk, s)[0], chunk) for s in SPLITS}
    param_list = f["params"].device_chunk_peak_bytes
    assert f["roomy"].device_adam_chunks > 0
    assert f["roomy"].host_to_device_bytes == f["roomy"].host_peak_bytes == 0
    assert f["params"].device_adam_chunks == 0
    assert f["params"].host_to_device_bytes == param_list
    assert f["tight"].host_to_device_bytes >= param_list
    assert f["tight"].device_peak_bytes <= split_budgets(model, chunk, "tight")[0]
    assert f["tight"].least_device_bytes == f["params"].least_device_bytes


def test_a_small_device_evicts_chunks_in_forward_and_backward():
    """gpt-small's two chunks do not both fit beside its output layer's logits in the
    least budget: each iteration moves both in and out twice (measured the same)."""
    row = check_split("gpt-small", "auto", "tight")
    chunk_bytes = row["chunk_size"] * 4
    assert row["predicted"]["host_to_device_bytes"] == 4 * chunk_bytes
    assert row["measured"]["host_to_device_bytes"] == 4 * chunk_bytes


@pytest.mark.parametrize("checkpointing", [False, True])
def test_a_llama_models_activation_peak_is_forecast_within_fifteen_percent(tmp_path, checkpointing):
    """The activation model of a transformers Llama (a gated MLP, an untied output
    layer), built from its config on meta, against the tracer's peak of the engine
    training it. Measured here: -8.6% without checkpointing, +4.7% with it (SmolLM2-135M
    at 8 x 256: -4.0% and -1.1%); 15% leaves room for another CPU's attention kernel."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    import pstar_core
    from pstar_core.capacity import Workload, arch_of, module_tensors, tensors_forecast
    from tests.tiny import make_tiny_llama

    make_tiny_llama(tmp_path, hidden=128, layers=4)
    config = AutoConfig.from_pretrained(tmp_path)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config)
    t = module_tensors(meta, arch_of(config), 128)
    assert t.arch.gated
    assert not t.arch.tied
    work = Workload(batch=8, seq=128, activation_checkpointing=checkpointing, dtype="fp32")
    predicted = tensors_forecast(t, 1 << 40, 1, work, 1 << 20, False).non_model_peak_bytes

    engine = pstar_core.initialize(
        tmp_path, {"dtype": "fp32", "activation_checkpointing": checkpointing}
    )
    x = torch.randint(0, config.vocab_size, (8, 128), generator=torch.Generator().manual_seed(0))
    engine.backward(engine(input_ids=x, labels=x).loss)
    engine.step()
    measured = engine.stats()["tracer"]["peak_non_model_bytes"]
    assert abs(predicted / measured - 1) <= 0.15, (predicted, measured)
