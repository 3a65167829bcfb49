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
    # the same base, and adapters that start at zero: the first loss is the base's. The
    # same fp32 operations on the same values; only a matmul kernel's summation order may
    # depend on where a weight lies (a chunk view, or a tensor of its own). A K-term fp32
    # sum added in another order moves by ~sqrt(K) x eps relative (rounding errors as a
    # random walk; K <= 128 here, eps = 2^-24: ~7e-7), and the loss averages 16 tokens'
    # (/ sqrt(16)): ~2e-7, so 1e-6 has a margin of 5. (Here they come out bitwise equal.)
    first = result["first_losses"]
    assert first[ENGINE_LORA] == pytest.approx(first[PEFT], rel=1e-6)
    assert first[ENGINE_LORA] == pytest.approx(first[ENGINE_FULL], rel=1e-6)
    # measured from the chunks' storages: each chunk element of the fp32 frozen base holds
    # 4 bytes, of the trained lists 16 (fp32 param + master + 2 moments)
    per_elem = result["allocated_bytes_per_chunk_elem_split"]
    assert per_elem == {"frozen": 4.0, "trainable": 16.0}
    assert result["allocated_bytes_per_chunk_elem_full"] == 16.0
    # what the engine accounts per parameter (no padding) is what it really allocates
    assert result["bytes_per_param_split"] == per_elem
    assert result["bytes_per_param_full"] == 16.0
    # per parameter, the chunks' padding comes on top: the auto chunk size is held to at
    # most 10% waste per list (tests/core/test_mapping.py, on the zoo), so at most / 0.9;
    # a base it packed worse than that would fail here too
    per_param = result["allocated_bytes_per_param_split"]
    for part, b in per_elem.items():
        assert b <= per_param[part] <= b / 0.9, part
    assert 16.0 <= result["allocated_bytes_per_param_full"] <= 16.0 / 0.9
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
