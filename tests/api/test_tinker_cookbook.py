"""tinker-cookbook's own loops (0.6.1, `recipes/sl_loop.py` and `recipes/rl_loop.py`, their
`main` unmodified) against our API, each in a process of its own with the tiny Llama, its
tokenizer and data from this machine (tests/api/cookbook_runner.py says what stands in
for the HF Hub). The loops' own files say how they went: `metrics.jsonl` (the NLL, the
reward) and `checkpoints.jsonl` (the tinker:// paths they resume from and sample)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.api.conftest import TINKER_TOKENS, start_api
from tests.tiny import chat_lines, make_tiny_llama

RUNNER = Path(__file__).with_name("cookbook_runner.py")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from service.settings import Limits

    data_dir = tmp_path_factory.mktemp("cookbook")
    # the recipes never close their ServiceClient: a session whose heartbeats stop is
    # ended after session_lost_s (120 by default; 25 here: two of the SDK's 10 s periods
    # missed, and 5 s more for a loaded machine)
    limits = Limits(max_session_models_per_tenant=4, session_lost_s=25)
    api, stop = start_api(
        data_dir,
        f"sqlite:///{data_dir / 'store.db'}",
        "sqlite",
        models_in_process=True,
        limits=limits,
    )
    api.ctx.sessions.engine_defaults["dtype"] = "fp32"
    # rl_loop's prompt starts with a worked example: over 256 tokens of the tiny BPE
    make_tiny_llama(api.settings.models_dir / "tiny-llama-1k", context=1024)
    yield api
    stop()


def run(
    server, recipe: str, rows: list[dict], log: Path, model: str = "tiny-llama", **config
) -> list[dict]:
    """The recipe's metrics, one dict a step, after it ran to its end."""
    data = log.parent / f"{log.name}.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    env = {**os.environ, "TINKER_API_KEY": TINKER_TOKENS["acme"], "TINKER_TELEMETRY": "0"}
    model_dir = server.settings.models_dir / model
    args = [recipe, server.url, str(model_dir), model, str(data), str(log)]
    proc = subprocess.run(
        [sys.executable, str(RUNNER), *args, json.dumps(config)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    return [json.loads(x) for x in (log / "metrics.jsonl").read_text().splitlines()]


def checkpoints(log: Path) -> list[dict]:
    return [json.loads(x) for x in (log / "checkpoints.jsonl").read_text().splitlines()]


def test_the_cookbooks_sl_loop_trains_saves_and_resumes_where_its_state_was(server, tmp_path):
    """sl_loop: four steps of 4 chats with a state saved before step 2; the NLL falls
    step by step.
    The final record dropped (as if the run had died after step 3), the loop run again
    finds the step-2 state itself and resumes there with Adam's moments: its step 2 has
    the NLL the first run's had, to the bit."""
    rows = [json.loads(x) for x in chat_lines(24)]
    log = tmp_path / "sl"
    config = dict(batch_size=4, lora_rank=4, learning_rate=1e-2, max_length=64, save_every=2)
    sessions = server.ctx.sessions
    before = set(sessions.sessions)
    first = run(server, "sl", rows, log, max_steps=4, **config)
    # its process gone without closing the session: the server ends it on its own once
    # the heartbeats have stopped for session_lost_s, freeing the model's slot
    (mine,) = set(sessions.sessions) - before
    deadline = time.time() + 150
    while mine in sessions.sessions and time.time() < deadline:
        time.sleep(1)
    assert mine not in sessions.sessions
    assert not [m for m in sessions.models if m.startswith(mine)]
    assert sessions.ended[mine][1] == "ended after 25 s without heartbeats"
    nll = [m["train_mean_nll"] for m in first]
    assert [m["step"] for m in first] == [0, 1, 2, 3]
    assert nll == sorted(nll, reverse=True), nll
    assert nll[3] < nll[0] - 0.3, nll
    saved = checkpoints(log)
    assert [c["name"] for c in saved] == ["000002", "final"]
    assert saved[0]["state_path"].startswith("tinker://")
    assert saved[1]["sampler_path"].startswith("tinker://")
    (log / "checkpoints.jsonl").write_text(json.dumps(saved[0]) + "\n")
    (log / "metrics.jsonl").unlink()
    again = run(server, "sl", rows, log, max_steps=3, **config)
    assert [m["step"] for m in again] == [2]
    assert again[0]["train_mean_nll"] == nll[2]


def test_the_cookbooks_rl_loop_samples_grades_and_trains_with_importance_sampling(server, tmp_path):
    """rl_loop: each step saves the weights for a sampler, samples a group of 4 answers to
    each of 2 prompts (stopping at the renderer's "\\n\\nUser:"), grades them, and trains
    on the centred rewards with `importance_sampling`; its final sampler is servable."""
    rows = [{"question": f"Say the letter {c}.", "answer": c} for c in "eaoiea"]
    log = tmp_path / "rl"
    config = dict(batch_size=2, group_size=4, lora_rank=4, learning_rate=1e-2, max_tokens=8)
    metrics = run(
        server, "rl", rows, log, "tiny-llama-1k", max_steps=3, save_every=0,
        loss_fn="importance_sampling", **config,
    )  # fmt: skip
    assert [m["step"] for m in metrics] == [0, 1, 2]
    assert all(0.0 <= m["reward/total"] <= 1.0 for m in metrics)
    # its session outlives the process until the heartbeats are missed: the model trained
    # at each step whose groups' rewards were not all equal
    (model,) = [m for m in server.ctx.sessions.models.values() if m.base.id == "tiny-llama-1k"]
    assert 1 <= model.steps <= 3
    assert model.tokens > 0
    (final,) = checkpoints(log)
    import tinker

    sampler = server.tinker().create_sampling_client(model_path=final["sampler_path"])
    prompt = tinker.types.ModelInput.from_ints([1, 2, 3])
    params = tinker.types.SamplingParams(max_tokens=3, temperature=0.0, stop=[])
    assert len(sampler.sample(prompt, 1, params).result().sequences[0].tokens) == 3
