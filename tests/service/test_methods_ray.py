"""Training methods and job control end to end, on a real local Ray through the unmodified
`openai` SDK: DPO on preference pairs (LoRA, 2 workers), early stopping that exports the
best evaluation's model, pause and resume with bitwise the losses of an uninterrupted run,
and `estimated_finish` against the real finish. One `pstar serve` (and Ray head) for the
module; the jobs of a test run side by side."""

from __future__ import annotations

import io
import json
import time

import httpx
import pytest
import torch

from pstar_core.hf import load_causal_lm
from tests.served import (
    TOKEN,
    create_job,
    ended,
    start_serve,
    stop_serve,
    upload_chat_files,
    wait_for,
)
from tests.tiny import WORDS

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def serve(tmp_path_factory):
    s = start_serve(tmp_path_factory.mktemp("methods"))
    yield s
    stop_serve(s)


@pytest.fixture(scope="module")
def files(serve):
    return upload_chat_files(serve)


def store_of(serve):
    from service.store import Store

    return Store(f"sqlite:///{serve.data_dir / 'store.db'}")


def points(serve, job_id: str) -> dict[int, dict]:
    return {p.step: p.values for p in store_of(serve).events.metric_points(job_id)}


def messages(serve, job_id: str) -> list[str]:
    c = serve.client()
    return [e.message for e in c.fine_tuning.jobs.list_events(job_id, limit=200)][::-1]


# -- DPO --------------------------------------------------------------------------------------


def preference_lines(n: int, offset: int = 0) -> list[str]:
    """'What does <word> mean?' with a preferred answer in the training data's style and
    a dispreferred one that is always the same."""
    out = []
    for i in range(offset, offset + n):
        w = WORDS[i % len(WORDS)]
        out.append(
            json.dumps(
                {
                    "input": {"messages": [{"role": "user", "content": f"What does {w} mean?"}]},
                    "preferred_output": [
                        {"role": "assistant", "content": f"{w} is a word about {w} things."}
                    ],
                    "non_preferred_output": [
                        {"role": "assistant", "content": "I do not know that word at all."}
                    ],
                }
            )
        )
    return out


def upload(serve, lines: list[str], name: str):
    data = ("\n".join(lines) + "\n").encode()
    return serve.client().files.create(file=(name, io.BytesIO(data)), purpose="fine-tune")


@pytest.fixture(scope="module")
def dpo_job(serve):
    """A LoRA DPO job on 2 workers, created through the SDK, and the job once it ended."""
    c = serve.client()
    train = upload(serve, preference_lines(48), "pairs.jsonl")
    valid = upload(serve, preference_lines(16, 300), "pairs-valid.jsonl")
    assert train.model_extra["format"] == "preference"
    job = c.fine_tuning.jobs.create(
        model="tiny-llama",
        training_file=train.id,
        validation_file=valid.id,
        seed=5,
        method={
            "type": "dpo",
            "dpo": {
                "hyperparameters": {"beta": 0.5, "batch_size": 8, "learning_rate_multiplier": 30},
                "lora": {"r": 8, "alpha": 16, "target_modules": "all-linear"},
            },
        },
        extra_body={"resources": {"num_workers": 2}, "engine": {"dtype": "fp32"}},
    )
    return job, ended(serve, job.id)


def test_a_lora_dpo_job_on_two_workers_raises_the_held_out_preferred_answers(serve, dpo_job):
    c = serve.client()
    job, done = dpo_job
    # OpenAI's echo of the method, beta decided
    assert job.method.type == "dpo"
    assert job.method.dpo.hyperparameters.beta == 0.5
    assert done.status == "succeeded", done.error
    got = points(serve, job.id)
    total = done.model_extra["progress"]["total"]
    first, last = got[0], got[total]
    for name in (
        "train_loss",
        "reward_margin",
        "chosen_reward",
        "rejected_reward",
        "reward_accuracy",
    ):
        assert name in got[1], name
    # the last step carries the whole validation file's numbers, as OpenAI's last event
    for name in ("valid_loss", "valid_reward_margin", "valid_logp_margin", "valid_reward_accuracy"):
        assert f"full_{name}" in last, name
    # before training the policy is the reference: no margin, the loss is ln 2
    assert first["valid_reward_margin"] == pytest.approx(0.0, abs=1e-6)
    assert first["valid_loss"] == pytest.approx(0.6931, abs=1e-3)
    # held out: the preferred answers became more likely than the others
    assert last["full_valid_logp_margin"] > first["valid_logp_margin"] + 1.0
    assert last["full_valid_reward_accuracy"] > 0.9
    assert last["full_valid_loss"] < first["valid_loss"]
    # and rose along the way (the interval evaluations)
    margins = [got[s]["valid_logp_margin"] for s in sorted(got) if "valid_logp_margin" in got[s]]
    assert len(margins) >= 3
    assert margins[-1] > margins[0]
    assert any("DPO: computing the reference" in m for m in messages(serve, job.id))
    # the metrics events carry the rewards, as OpenAI's DPO events do
    evs = [e for e in c.fine_tuning.jobs.list_events(job.id, limit=200) if e.type == "metrics"]
    assert all("reward_margin" in e.data for e in evs if e.data.get("step"))
    # the /metrics series carry them too
    r = httpx.get(
        f"{serve.url}/v1/fine_tuning/jobs/{job.id}/metrics",
        params={"names": "reward_margin,valid_logp_margin"},
        headers={"Authorization": f"Bearer {TOKEN}"},
    )
    series = r.json()["series"]
    assert series["reward_margin"]["steps"] == list(range(1, total + 1))
    assert series["valid_logp_margin"]["steps"][0] == 0


def test_a_dpo_job_refuses_chat_examples_and_a_supervised_job_refuses_pairs(serve, files):
    import openai

    c = serve.client()
    pairs = upload(serve, preference_lines(8), "p.jsonl")
    with pytest.raises(openai.BadRequestError, match="trains on preference pairs"):
        c.fine_tuning.jobs.create(
            model="tiny-llama", training_file=files[0], method={"type": "dpo"}
        )
    with pytest.raises(openai.BadRequestError, match="holds preference examples"):
        c.fine_tuning.jobs.create(model="tiny-llama", training_file=pairs.id)
    assert not [j for j in c.fine_tuning.jobs.list() if j.training_file == pairs.id]


# -- reinforcement ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def rft_job(serve):
    """A reinforcement job on 2 workers through the SDK, and the job once it ended."""
    from tests.service.test_reinforcement import method, prompt_lines

    c = serve.client()
    train = c.files.create(file=("p.jsonl", io.BytesIO(prompt_lines(32))), purpose="fine-tune")
    valid = c.files.create(file=("v.jsonl", io.BytesIO(prompt_lines(8, 100))), purpose="fine-tune")
    job = c.fine_tuning.jobs.create(
        model="tiny-llama",
        training_file=train.id,
        validation_file=valid.id,
        seed=1,
        suffix="rft",
        # this module's tiny Llama is larger than test_reinforcement's: more prompts a
        # step, a lower learning rate
        method=method(max_steps=40, eval_interval=20, batch_size=8, learning_rate_multiplier=30),
        extra_body={"resources": {"num_workers": 2}, "engine": {"dtype": "fp32"}},
    )
    return job, ended(serve, job.id)


def test_a_reinforcement_job_on_two_workers_learns_what_its_grader_rewards(serve, rft_job):
    """OpenAI's `method: reinforcement` on 2 Ray Train workers with chunk ZeRO: each rank
    samples its prompts' groups on the sharded model, grades them, and the step is the
    primitives' loss; the share of answers that pass a string_check grader rises, and the
    job ends with a fine-tuned model like any other."""
    job, done = rft_job
    assert done.status == "succeeded", done.error
    assert done.fine_tuned_model == f"ft:tiny-llama:rft:{job.id}"
    got = points(serve, job.id)
    rewards = [got[s]["train_reward_mean"] for s in range(1, 41)]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert last >= 2 * max(first, 0.02), (first, last, rewards)
    assert last >= 0.08
    assert "full_valid_reward_mean" in got[40]
    assert got[40]["comm_bytes_sent"] > 0  # chunk ZeRO between the 2 workers
    assert any(m.startswith("Data: 32 training prompts") for m in messages(serve, job.id))
    # each evaluation shows a few graded answers, rank 0's, in an event of the job
    graded = [
        e.data for e in serve.client().fine_tuning.jobs.list_events(job.id, limit=200)
        if e.data and "graded" in e.data
    ]  # fmt: skip
    assert sorted(g["step"] for g in graded) == [0, 20, 40]
    for g in graded:
        assert len(g["graded"]) == 4
        assert all(x["prompt"].endswith("mean?") or "What does" in x["prompt"] for x in g["graded"])
        assert all(x["reward"] in (0.0, 1.0) for x in g["graded"])
    # and nothing of the prompts or answers is in the job's logs
    logs = httpx.get(
        f"{serve.url}/v1/fine_tuning/jobs/{job.id}/logs",
        headers={"Authorization": f"Bearer {TOKEN}"},
        timeout=60,
    ).text
    assert graded[0]["graded"][0]["prompt"] not in logs


def test_a_lora_reinforcement_job_on_two_workers_samples_on_the_base_models_serve_app(serve):
    """`sampler: auto` on a LoRA job: each step both ranks export the adapters together
    (ZeRO), then each asks the API's rollouts route for its prompts' answers, which the
    base model's Serve application samples with those adapters loaded by path; the
    sampler's log-probabilities are the trained policy's at every step."""
    from service.serving.deployments import base_app
    from tests.service.test_reinforcement import method, prompt_lines

    c = serve.client()
    train = c.files.create(file=("p.jsonl", io.BytesIO(prompt_lines(16))), purpose="fine-tune")
    m = method(max_steps=3, batch_size=4, group_size=2, max_completion_tokens=4)
    m["reinforcement"]["lora"] = {"r": 4, "alpha": 8}
    job = c.fine_tuning.jobs.create(
        model="tiny-llama",
        training_file=train.id,
        seed=2,
        method=m,
        extra_body={"resources": {"num_workers": 2}, "engine": {"dtype": "fp32"}},
    )
    assert job.method.reinforcement.hyperparameters.model_extra["sampler"] == "server"
    done = ended(serve, job.id)
    assert done.status == "succeeded", done.error
    got = points(serve, job.id)
    assert [abs(got[s]["train_sampler_kl"]) < 1e-4 for s in (1, 2, 3)] == [True] * 3, got
    assert got[3]["comm_bytes_sent"] > 0  # chunk ZeRO between the 2 workers
    said = messages(serve, job.id)
    assert not [x for x in said if "could not sample" in x], said  # no fallback to the engine
    # the base's application answered with the adapters of step 2 (what step 3 sampled
    # with) loaded; the earlier steps' went with their directories
    app = base_app(serve.data_dir / "models" / "tiny-llama", "tiny-llama")
    (status,) = (serve.data_dir / "serving" / app).glob("*.json")
    mine = f"runs/{job.id}/sampler/attempt-1/step-"
    assert (serve.data_dir / f"{mine}2").is_dir()
    assert not (serve.data_dir / f"{mine}1").exists()

    def held() -> list[str]:
        return [a for a in json.loads(status.read_text())["adapters"] if a.startswith(mine)]

    wait_for(lambda: held() == [f"{mine}2"], 10, "the replica to hold step 2's adapters only")


def test_the_job_page_charts_a_reinforcement_jobs_reward_and_shows_graded_answers(
    serve, rft_job, browser
):
    from tests.browser import shot, sign_in, wait_page

    _job, done = rft_job
    sign_in(browser, serve, TOKEN)
    browser.get(f"{serve.url}/ui/#/jobs/{done.id}")
    wait_page(browser, "return window.pstar.streamState === 'ended'", "the stream's end")
    assert "method reinforcement" in browser.find_element("css selector", "#job-method").text
    plotted = browser.execute_script("return window.pstar.plotted")["grades"]
    r = httpx.get(
        f"{serve.url}/v1/fine_tuning/jobs/{done.id}/metrics",
        headers={"Authorization": f"Bearer {TOKEN}"},
    ).json()["series"]
    for name in ("train_reward_mean", "valid_reward_mean", "full_valid_reward_mean"):
        got = plotted["series"][name]
        want = dict(zip(r[name]["steps"], r[name]["values"], strict=True))
        steps = plotted["steps"]
        assert [v for s, v in zip(steps, got, strict=True) if v is not None] == pytest.approx(
            [want[s] for s in steps if s in want]
        )
    assert browser.find_element("css selector", "#card-grades").is_displayed()
    assert browser.find_element("css selector", "#card-graded").is_displayed()
    assert browser.find_element("css selector", "#graded-step").text == "at step 40"
    rows = browser.find_elements("css selector", "#graded tbody tr")
    assert len(rows) == 4
    shown = browser.execute_script("return window.pstar.graded")
    # as the page shows text: whitespace runs as one space, none at the ends
    assert [" ".join(row.find_elements("css selector", "td")[1].text.split()) for row in rows] == [
        " ".join(g["answer"].split()) for g in shown
    ]
    shot(browser, "job-rft")


# -- early stopping ---------------------------------------------------------------------------


def test_early_stopping_stops_and_exports_the_best_evaluations_model(serve, files):
    c = serve.client()
    # a min_delta no loss can beat: the evaluation at step 10 sets the best (it is within
    # the warm-up), the one at 20 does not improve on it, and patience 1 stops the job
    job = create_job(
        serve,
        files,
        steps=60,
        suffix="early",
        early_stopping={"patience": 1, "min_delta": 100.0, "warmup_evals": 1},
    )
    assert job.model_extra["early_stopping"]["stopped"] is False
    done = ended(serve, job.id)
    assert done.status == "succeeded", done.error
    es = done.model_extra["early_stopping"]
    assert (es["stopped"], es["best_step"], es["stopped_at_step"], es["evals"]) == (True, 10, 20, 2)
    assert done.model_extra["progress"]["step"] == 20
    assert max(points(serve, job.id)) == 20  # no step after the stop
    said = [m for m in messages(serve, job.id) if m.startswith("Early stopping at step 20")]
    assert said, messages(serve, job.id)
    assert "step 10 is the fine-tuned model" in said[0]
    # the model it ends with is the model of step 10: the whole validation file (16 rows,
    # the interval sample too) has step 10's loss again, not step 20's
    got = points(serve, job.id)
    final = [
        e
        for e in c.fine_tuning.jobs.list_events(job.id, limit=200)
        if e.data and "full_valid_loss" in e.data
    ]
    full = final[0].data["full_valid_loss"]
    assert full == pytest.approx(got[10]["valid_loss"], rel=1e-6)
    assert abs(got[20]["valid_loss"] - got[10]["valid_loss"]) > 1e-3
    assert es["best_valid_loss"] == pytest.approx(got[10]["valid_loss"])
    # and so is the exported model, loaded by transformers on the same rows
    assert exported_valid_loss(serve, job.id) == pytest.approx(got[10]["valid_loss"], rel=1e-4)


def exported_valid_loss(serve, job_id: str) -> float:
    """The fine-tuned model's token-mean loss on the job's validation rows, as the job
    prepared them, computed by transformers from the exported directory."""

    from service.data.prepare import prepare
    from service.methods.objectives import Rows
    from service.spec.job import spec_of

    store = store_of(serve)
    job = store.jobs.get(job_id)
    stored = [serve.data_dir / "files" / store.files.get(job.tenant, fid).storage_name
              for fid in (job.training_file, job.validation_file)]  # fmt: skip
    prep = prepare(spec_of(job), *stored)
    v = prep.valid
    model = load_causal_lm(serve.data_dir / "models" / ".ft" / job_id, dtype=torch.float32).eval()
    pos = v.position_ids.long() if v.position_ids is not None else None
    rows = Rows(v.input_ids.long(), v.labels.long(), pos)  # stored int32
    with torch.no_grad():
        out = model(**rows.model_inputs())
    return float(out.loss)


# -- pause, resume and the estimate of the finish ----------------------------------------------


def test_a_paused_and_resumed_job_has_the_losses_of_an_uninterrupted_one(serve, files):
    c = serve.client()
    steps = 40
    plain = create_job(serve, files, steps=steps, suffix="plain")
    paused = create_job(serve, files, steps=steps, suffix="paused")
    wait_for(lambda: max(points(serve, paused.id), default=0) >= 12, 240, "step 12")
    asked = c.fine_tuning.jobs.pause(paused.id)
    assert asked.status in ("running", "paused")
    got = wait_for(
        lambda: (j := c.fine_tuning.jobs.retrieve(paused.id)).status == "paused" and j,
        120,
        "the pause",
    )
    assert got.model_extra["pause_requested"] is False
    at = max(points(serve, paused.id))
    assert 12 <= at < steps
    assert any(m.startswith(f"Job paused at step {at}") for m in messages(serve, paused.id))
    # paused, it holds no workers: no step trains meanwhile
    time.sleep(4)
    assert max(points(serve, paused.id)) == at
    assert c.fine_tuning.jobs.retrieve(paused.id).status == "paused"
    # another pause is no change; a resume of a running job is refused, saying its state
    assert c.fine_tuning.jobs.pause(paused.id).status == "paused"
    import openai

    with pytest.raises(openai.BadRequestError, match=r"is (running|queued|succeeded)"):
        c.fine_tuning.jobs.resume(plain.id)
    assert c.fine_tuning.jobs.resume(paused.id).status == "queued"
    a, b = ended(serve, plain.id), ended(serve, paused.id)
    assert a.status == b.status == "succeeded", (a.error, b.error)
    assert b.model_extra["attempt"] == 2  # the resume's own attempt, no attempt lost
    pa, pb = points(serve, plain.id), points(serve, paused.id)
    assert sorted(pa) == sorted(pb) == list(range(steps + 1))
    for step in range(1, steps + 1):
        assert pb[step]["train_loss"] == pa[step]["train_loss"], step  # bit for bit
    with pytest.raises(openai.BadRequestError, match="is succeeded"):
        c.fine_tuning.jobs.pause(plain.id)


def test_a_queued_job_paused_leaves_the_queue_and_a_paused_job_can_be_cancelled(serve, files):
    c = serve.client()
    # more CPUs than the head has: it can only wait
    job = create_job(serve, files, steps=10, resources={"num_workers": 2, "cpus_per_worker": 3})
    wait_for(lambda: c.fine_tuning.jobs.retrieve(job.id).model_extra["attempt"] == 1, 60, "submit")
    c.fine_tuning.jobs.pause(job.id)
    got = wait_for(
        lambda: (j := c.fine_tuning.jobs.retrieve(job.id)).status == "paused" and j, 60, "pause"
    )
    assert got.model_extra["attempt"] == 1
    assert c.fine_tuning.jobs.cancel(job.id).status == "cancelled"


def test_estimated_finish_is_within_half_the_remaining_time_after_a_quarter_of_the_steps(
    serve, files
):
    c = serve.client()
    steps = 60
    job = create_job(serve, files, steps=steps, suffix="eta")
    seen = []  # (when, step, estimated_finish)
    deadline = time.time() + 300
    while time.time() < deadline:
        j = c.fine_tuning.jobs.retrieve(job.id)
        if j.status in ("succeeded", "failed", "cancelled"):
            break
        if j.estimated_finish:
            seen.append((time.time(), j.model_extra["progress"]["step"], j.estimated_finish))
        time.sleep(0.5)
    done = ended(serve, job.id)
    assert done.status == "succeeded", done.error
    after_quarter = [s for s in seen if s[1] >= steps // 4 and s[1] < steps]
    assert after_quarter, seen
    when, step, eta = after_quarter[0]
    remaining = done.finished_at - when
    assert abs(eta - done.finished_at) <= 0.5 * remaining + 1, (step, eta, done.finished_at, when)
    # and the metrics events carry it, kept current
    events = [e for e in c.fine_tuning.jobs.list_events(job.id, limit=200) if e.type == "metrics"]
    assert sum(1 for e in events if (e.data or {}).get("estimated_finish")) >= steps // 2


def test_the_job_page_shows_a_dpo_jobs_method_rewards_and_data(serve, dpo_job, browser):
    from tests.browser import shot, sign_in, wait_page

    _job, done = dpo_job
    sign_in(browser, serve, TOKEN)
    browser.get(f"{serve.url}/ui/#/jobs/{done.id}")
    wait_page(browser, "return window.pstar.streamState === 'ended'", "the stream's end")
    method = browser.find_element("css selector", "#job-method").text
    assert "method dpo (β 0.5), LoRA r 8" in method
    data = done.model_extra["data"]
    assert f"{data['rows']} preference pairs, a row of {data['seq_len']} per answer" in method
    plotted = browser.execute_script("return window.pstar.plotted")
    r = httpx.get(
        f"{serve.url}/v1/fine_tuning/jobs/{done.id}/metrics",
        headers={"Authorization": f"Bearer {TOKEN}"},
    ).json()["series"]
    for name in ("reward_margin", "chosen_reward", "rejected_reward"):
        got = plotted["rewards"]["series"][name]
        steps = plotted["rewards"]["steps"]
        want = dict(zip(r[name]["steps"], r[name]["values"], strict=True))
        assert [v for s, v in zip(steps, got, strict=True) if v is not None] == pytest.approx(
            [want[s] for s in steps if s in want]
        )
    assert browser.find_element("css selector", "#card-rewards").is_displayed()
    assert browser.find_element("css selector", "#card-accuracy").is_displayed()
    assert not browser.find_element("css selector", "#pause").is_displayed()  # it ended
    shot(browser, "job-dpo")
