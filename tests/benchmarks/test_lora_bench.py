"""`pstar bench lora` on a tiny base: both parts measure, every recipe in the dtype asked
for (fp32: not what auto picks on a bf16 CPU, so the peers must follow the flag)."""

from __future__ import annotations

import pytest

from benchmarks.lora import ENGINE_FULL, ENGINE_LORA, PEFT, run
from tests.tiny import make_tiny_llama

TINY_SHAPE = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "tie_word_embeddings": True,
}


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    base = make_tiny_llama(tmp_path_factory.mktemp("lora-bench") / "tiny")
    return run(
        base,
        rounds=2,
        warmup=1,
        batch=1,
        seq=16,
        cap_gib=1.5,
        disk_gib=0.25,
        max_layers=1,
        start_layers=1,
        scale_shape=TINY_SHAPE,
        dtype="fp32",
        json_out=True,
    )


def test_step_part_times_three_recipes_from_the_same_start(result):
    for recipe in (ENGINE_LORA, ENGINE_FULL, PEFT):
        assert result["s_per_step"][recipe] > 0
        assert result["model_data_bytes"][recipe] > 0
    # the same base, and adapters that start at zero: the first loss is the base's
    first = result["first_losses"]
    assert first[ENGINE_LORA] == pytest.approx(first[PEFT], rel=1e-4)
    assert first[ENGINE_LORA] == pytest.approx(first[ENGINE_FULL], rel=1e-6)
    # fp32: the frozen base 4 bytes a param; trained ones fp32 param + master + 2 moments
    assert result["bytes_per_param_split"] == {"frozen": 4.0, "trainable": 16.0}
    assert result["bytes_per_param_full"] == 16.0
    assert 4.0 < result["bytes_per_param_lora"] < 16.0


def test_every_recipe_computes_in_the_dtype_asked_for(result):
    assert result["compute_dtype"] == result["engine_dtype"] == "fp32"
    assert set(result["compute_dtype_seen"].values()) == {"fp32"}  # peft's base too
    assert result["scale_compute_dtype_seen"] == {"ours_lora": "fp32", "peft_lora": "fp32"}


def test_scale_part_trains_both_recipes_under_the_cap(result):
    for recipe, trials in result["scale_runs"].items():
        assert [t["layers"] for t in trials] == [1], recipe
        for t in trials:
            assert t["ok"], t
            assert 0 < t["peak_rss_bytes"] <= result["cap_bytes"]
            assert 0 < t["init_peak_bytes"] < t["peak_rss_bytes"]
    largest = result["largest_params"]
    assert largest["ours_lora"] == largest["peft_lora"] > 0
