"""What the benchmarks share (`benchmarks.report`): one dtype for the engine and every peer,
what a recipe was seen computing in, and the peak memory a block adds."""

from __future__ import annotations

import pytest
import torch

from benchmarks.report import (
    bench_dtype,
    deepspeed_precision,
    fsdp2_precision,
    peak_rss_growth,
    watch_compute_dtype,
)


def test_bench_dtype_keeps_a_concrete_dtype_resolves_auto_and_rejects_others():
    assert bench_dtype("fp32") == "fp32"
    assert bench_dtype("bf16") == "bf16"
    assert bench_dtype("auto") in ("fp32", "bf16")  # a CPU never resolves to fp16
    with pytest.raises(ValueError, match="fp8"):
        bench_dtype("fp8")


def test_deepspeed_trains_in_fp32_by_enabling_neither_reduced_precision():
    assert deepspeed_precision("fp32") == {}
    assert deepspeed_precision("bf16") == {"bf16": {"enabled": True}}
    assert deepspeed_precision("fp16") == {"fp16": {"enabled": True}}


def test_fsdp2_casts_params_to_the_dtype_and_nothing_in_fp32():
    assert fsdp2_precision("fp32").param_dtype is None
    bf16 = fsdp2_precision("bf16")
    assert bf16.param_dtype == torch.bfloat16
    assert bf16.reduce_dtype == torch.float32


def test_watch_compute_dtype_reports_what_the_first_linear_layer_computed_in():
    net = torch.nn.Sequential(torch.nn.Embedding(8, 4), torch.nn.Linear(4, 4)).to(torch.bfloat16)
    seen = watch_compute_dtype(net)
    assert seen() is None  # no forward yet
    net(torch.tensor([1, 2]))
    assert seen() == "bf16"


def test_peak_rss_growth_sees_memory_a_block_touched_and_freed_again():
    with peak_rss_growth() as grew:
        block = torch.ones(64 * 2**20 // 4)  # 64 MiB, written, then freed
        del block
    assert grew["bytes"] >= 60 * 2**20
    with peak_rss_growth() as idle:
        pass
    # the peak was reset to the current RSS first: the earlier block does not count again
    assert idle["reset"] is True
    assert idle["bytes"] < 8 * 2**20
