"""`pstar bench packing` on a tiny Llama and short chat examples: both layouts train on one
engine, the packed rows are fewer and fuller, every packed example's loss matches its loss
alone, and the speedup is the epoch's step counts over the two layouts' own step times."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from benchmarks.report import median
from pstar.cli import app
from tests.tiny import chat_lines, make_tiny_llama


def test_bench_packing_compares_both_layouts_of_the_same_data(tmp_path):
    model = make_tiny_llama(tmp_path / "m")
    data = tmp_path / "train.jsonl"
    data.write_text("\n".join(chat_lines(64)) + "\n")
    args = ["bench", "packing", str(model), "--data", str(data), "--steps", "3", "--batch", "4"]
    more = ["--seq-len", "128", "--check-examples", "8", "--json"]
    res = CliRunner().invoke(app, [*args, *more], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    r = json.loads(res.output.strip().splitlines()[-1])
    padded, packed = r["layouts"]["padded"], r["layouts"]["packed"]
    assert padded["rows"] == 64  # one example per row
    assert packed["rows"] < padded["rows"] / 3  # short examples: several per row of 128
    assert packed["fill_ratio"] > 2 * padded["fill_ratio"]
    assert packed["examples_per_row"] == pytest.approx(64 / packed["rows"])
    # the speedup comes from the two layouts' own step times, interleaved, and the epochs'
    # step counts; nothing else
    times = r["step_times_s"]
    assert len(times["padded"]) == len(times["packed"]) == 3
    assert times["padded"] != times["packed"]  # two measurements, not one reported twice
    ratio = median([a / b for a, b in zip(times["packed"], times["padded"], strict=True)])
    assert r["step_time_ratio_packed_vs_padded"] == ratio
    assert packed["s_per_step"] == median(times["packed"])
    steps = padded["steps_per_epoch"] / packed["steps_per_epoch"]
    assert r["speedup_trained_tokens_per_s"] == steps / ratio
    # an epoch trains the same tokens either way
    assert padded["trained_tokens_per_s"] * padded["epoch_s"] == pytest.approx(
        packed["trained_tokens_per_s"] * packed["epoch_s"]
    )
    # fp32 losses of each example packed and alone: a few ulp apart (see test_packing)
    assert r["loss_agreement"]["examples_checked"] == 8
    assert r["loss_agreement"]["max_rel_diff"] < 1e-5
    assert r["compute_dtype"] in ("bf16", "fp32")
    assert "trained tok/s" in res.output  # the table
    assert "trained tokens/s over an epoch" in res.output
