"""The `pstar` CLI: plan prints a JSON line last, train runs a job end to end, bad specs fail."""

from __future__ import annotations

import json
import os

import pytest
from typer.testing import CliRunner

from pstar.cli import app
from pstar_core.hf import load_causal_lm

runner = CliRunner()


def test_plan_prints_one_json_object_last_for_the_68b_model():
    result = runner.invoke(app, ["plan", "gpt-68b", "--json"])
    assert result.exit_code == 0, result.output
    last = json.loads(result.output.strip().splitlines()[-1])
    assert last["params"] > 60e9
    assert last["utilization"] >= 0.9
    assert last["chunk_size"] >= 9126 * 4 * 9126  # the largest tensor fits


def test_plan_of_a_hf_config(tmp_path):
    from transformers import LlamaConfig

    LlamaConfig(
        vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2,
    ).save_pretrained(tmp_path)  # fmt: skip
    result = runner.invoke(app, ["plan", str(tmp_path / "config.json"), "--json"])
    assert result.exit_code == 0, result.output
    last = json.loads(result.output.strip().splitlines()[-1])
    # untied Llama: 2 embeddings + 3 layers of (4 attn + 3 mlp + 2 norms) + final norm
    per_layer = 64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 128 + 2 * 64
    assert last["params"] == 2 * 1000 * 64 + 3 * per_layer + 64


def test_plan_forecasts_the_step_time_and_tflops_of_a_named_gpu():
    """`--gpu` names the figures (peak, link, memory) and each can be overridden: a
    faster link never makes the step slower, a lower peak makes it slower."""
    args = ["plan", "gpt-4b", "--gpus", "1", "--gpu", "h100", "--host-memory", "256", "--json"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "TFLOPS per GPU" in result.output
    assert "h100" in result.output
    plan = json.loads(result.output.strip().splitlines()[-1])
    assert plan["device_bytes"] == int(0.9 * 80 * 2**30)  # the h100's memory
    assert 0 < plan["compute_seconds"] <= plan["step_seconds"]
    assert plan["tflops_per_gpu"] < 989
    slow = runner.invoke(app, [*args, "--tflops", "400"])
    assert json.loads(slow.output.strip().splitlines()[-1])["step_seconds"] > plan["step_seconds"]


def test_plan_largest_with_a_tflops_bar_names_the_model_and_why_the_next_misses_it():
    # a host whose Adam (1 G parameters a second) is slower than the GPU's compute: with
    # Adam beside backward the A100's own figures keep 180 TFLOPS at every size, so only a
    # host that falls behind makes throughput fall as the model grows
    base = ["plan", "--largest", "--gpus", "1", "--gpu", "a100", "--host-memory", "1024"]
    base += ["--host-adam-gparams", "1"]
    memory = json.loads(runner.invoke(app, [*base, "--json"]).output.strip().splitlines()[-1])
    barred = runner.invoke(app, [*base, "--min-tflops", "150", "--json"])
    assert barred.exit_code == 0, barred.output
    got = json.loads(barred.output.strip().splitlines()[-1])
    assert got["plan"]["tflops_per_gpu"] >= 150
    assert got["params"] < memory["params"]
    assert "under the bar of 150" in got["next_why"]
    assert "150 TFLOPS per GPU or more" in barred.output
    unreachable = runner.invoke(app, [*base, "--min-tflops", "5000", "--json"])
    assert json.loads(unreachable.output.strip().splitlines()[-1])["largest_model"] is None


@pytest.mark.parametrize(
    ("extra", "said"),
    [
        (["--gpu", "b200"], "--gpu must be one of"),
        (["--gpu-efficiency", "1.5"], "at most 1"),
        (["--min-tflops", "50"], "--min-tflops is a bar for --largest"),
    ],
)
def test_plan_refuses_speed_figures_it_cannot_use(extra, said):
    result = runner.invoke(app, ["plan", "gpt-1b", "--gpus", "1", *extra])
    assert result.exit_code == 2
    assert said in result.output


def test_unknown_model_lists_the_zoo():
    result = runner.invoke(app, ["plan", "gpt-3000b"])
    assert result.exit_code == 2
    assert "gpt-68b" in result.output


@pytest.fixture
def text_file(tmp_path):
    who = ("lord", "king", "people", "prophet")
    where = ("city", "land", "house", "sea")
    lines = [
        f"And the {w} said unto the {v}, behold the {w} of the {v}." for w in who for v in where
    ]
    path = tmp_path / "corpus.txt"
    path.write_text("\n".join(lines * 40))
    return path


def test_train_runs_a_spec_end_to_end_and_the_loss_goes_down(tmp_path, text_file):
    spec = tmp_path / "job.yaml"
    spec.write_text(
        f"""
name: tiny
model: gpt-tiny
data: {{path: {text_file}, seq_len: 32, vocab_size: 300}}
train: {{steps: 12, batch_size: 4, eval_batches: 2, log_every: 4}}
engine: {{dtype: bf16, optimizer: {{lr: 0.01}}}}
output_dir: {tmp_path / "runs"}
"""
    )
    result = runner.invoke(app, ["train", str(spec)])
    assert result.exit_code == 0, result.output
    summary = json.loads((tmp_path / "runs" / "tiny" / "summary.json").read_text())
    assert summary["heldout_ppl_after"] < summary["heldout_ppl_before"]
    assert (tmp_path / "runs" / "tiny" / "checkpoint" / "pstar_checkpoint.json").exists()
    metrics = [
        json.loads(x) for x in (tmp_path / "runs/tiny/metrics.jsonl").read_text().splitlines()
    ]
    assert [m["step"] for m in metrics] == [4, 8, 12]


def test_train_with_a_bad_spec_says_what_is_wrong(tmp_path, text_file):
    spec = tmp_path / "job.yaml"
    spec.write_text(f"model: gpt-tiny\ndata: {{path: {text_file}}}\nengine: {{dtype: fp64}}\n")
    result = runner.invoke(app, ["train", str(spec)])
    assert result.exit_code == 2
    assert "dtype" in result.output
    assert "fp64" in result.output


def test_train_fine_tunes_a_hf_dir_and_exports_a_loadable_model(tmp_path, text_file):
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        PreTrainedTokenizerFast,
    )

    from service.data.text import train_tokenizer

    src = tmp_path / "pretrained"
    tok = train_tokenizer(text_file.read_text(), 300, tmp_path / "tok.json")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    fast.save_pretrained(src)
    cfg = LlamaConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=32, intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64, tie_word_embeddings=True,
    )  # fmt: skip
    LlamaForCausalLM(cfg).save_pretrained(src)
    spec = tmp_path / "job.yaml"
    spec.write_text(
        f"""
name: ft
model: {src}
data: {{path: {text_file}, seq_len: 32}}
train: {{steps: 10, batch_size: 4, eval_batches: 2, log_every: 5}}
engine: {{dtype: bf16, optimizer: {{lr: 0.01}}}}
output_dir: {tmp_path / "runs"}
"""
    )
    result = runner.invoke(app, ["train", str(spec)])
    assert result.exit_code == 0, result.output
    summary = json.loads((tmp_path / "runs/ft/summary.json").read_text())
    assert summary["heldout_ppl_after"] < summary["heldout_ppl_before"]
    export = tmp_path / "runs/ft/hf"
    assert (export / "tokenizer.json").exists()
    model = load_causal_lm(export)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_serve_on_a_port_in_use_fails_at_once_naming_it_and_starts_no_ray(monkeypatch, tmp_path):
    """The API's socket is bound before the local Ray head starts (whose ports could
    otherwise take it): a port already in use is an error before anything else runs."""
    import socket

    import pstar.server

    def no_ray(*_args, **_kwargs):
        raise AssertionError("the control plane was built on a port it cannot listen on")

    monkeypatch.setattr(pstar.server, "build", no_ray)
    monkeypatch.setenv("PSTAR_DATA_DIR", str(tmp_path))
    monkeypatch.delenv("PSTAR_API_URL", raising=False)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = runner.invoke(app, ["serve", "--port", str(port)])
    # this process's environment is left alone (a PSTAR_API_URL left there once sent the
    # workers of every later `pstar serve` started from it to this dead port)
    assert "PSTAR_API_URL" not in os.environ
    assert result.exit_code == 2, result.output
    assert f"cannot listen on 127.0.0.1:{port}" in result.output
    assert "--port" in result.output
