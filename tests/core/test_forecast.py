"""The planner's forecast of an iteration against what the engine measures, with CPU
budgets standing in for the GPU and host tiers: device and host peaks and the bytes moved
each way, for three zoo models under three budget splits, within 10%."""

from __future__ import annotations

import pytest

from pstar_core.capacity import rank_forecast
from pstar_core.plan_check import (
    SPLITS,
    VALIDATION,
    VALIDATION_WORK,
    check_split,
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
    f = {
        s: rank_forecast(model, split_budgets(model, chunk, s)[0], 1, VALIDATION_WORK, chunk, False)
        for s in SPLITS
    }
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
