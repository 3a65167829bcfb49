"""Reinforcement fine-tuning jobs (OpenAI's `method: reinforcement`) through the unmodified
`openai` SDK: prompts files, the grader and the templates checked at creation, and a job
run as its driver and worker run it (in this process, on the tiny Llama): a model with
random weights learns to name the word it is asked about, as a `string_check` grader
scores it, its metrics and the job object as OpenAI's clients read them."""

from __future__ import annotations

import io
import json
import time

import httpx
import openai
import pytest
import torch

from service.methods.rft_objective import advantages
from tests.api.conftest import api_in_process, run_job
from tests.tiny import WORDS, make_tiny_embedder

STEPS = 40
GRADER = {
    "type": "string_check",
    "name": "names the word",
    "input": "{{sample.output_text}}",
    "reference": "{{item.word}}",
    "operation": "ilike",
}


def prompt_lines(n: int, offset: int = 0, **extra) -> bytes:
    lines = []
    for i in range(offset, offset + n):
        w = WORDS[i % len(WORDS)]
        msgs = [{"role": "user", "content": f"What does {w} mean?"}]
        lines.append(json.dumps({"messages": msgs, "word": w, **extra}))
    return ("\n".join(lines) + "\n").encode()


def upload(client, data: bytes, name: str):
    return client.files.create(file=(name, io.BytesIO(data)), purpose="fine-tune")


def method(grader=GRADER, **hp) -> dict:
    hyper = {
        "batch_size": 4,
        "n_epochs": 50,
        "max_steps": STEPS,
        "learning_rate_multiplier": 100,
        "group_size": 8,
        "max_completion_tokens": 8,
        "eval_interval": 10,
        **hp,
    }
    return {"type": "reinforcement", "reinforcement": {"grader": grader, "hyperparameters": hyper}}


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    # an embedding model, for the cosine metric
    embedder = make_tiny_embedder(tmp_path_factory.mktemp("emb") / "tiny-embedder")
    with api_in_process(tmp_path_factory, "rft", embedding_model=embedder) as server:
        yield server


@pytest.fixture(scope="module")
def files(api):
    c = api.client()
    return upload(c, prompt_lines(32), "p.jsonl").id, upload(c, prompt_lines(8, 100), "v.jsonl").id


@pytest.fixture(scope="module")
def trained(api, files):
    """A reinforcement job through the SDK, run to its end (`run_job`); (the job as
    created, its metric series)."""
    c = api.client()
    job = c.fine_tuning.jobs.create(
        model="tiny-llama",
        training_file=files[0],
        validation_file=files[1],
        seed=1,
        method=method(),
        extra_body={"engine": {"dtype": "fp32"}},
    )
    return job, run_job(api, job.id)


def test_prompt_files_upload_as_prompts_and_a_supervised_job_is_refused_on_them(api, files):
    c = api.client()
    assert c.files.retrieve(files[0]).model_extra["format"] == "prompts"
    with pytest.raises(openai.BadRequestError, match="holds prompts examples") as e:
        c.fine_tuning.jobs.create(model="tiny-llama", training_file=files[0])
    assert e.value.body["param"] == "training_file"


@pytest.mark.parametrize(
    ("grader", "says", "param"),
    [
        (None, "needs method.reinforcement.grader", "method.reinforcement.grader"),
        (
            {**GRADER, "reference": "{{item.answer}}"},
            "uses {{item.answer}}, and the line has no such key (training_file line 1)",
            "method.reinforcement.grader",
        ),
        (
            {**GRADER, "operation": "startswith"},
            "method.reinforcement.grader.operation",
            "method.reinforcement.grader.operation",
        ),
        (
            {"type": "python", "name": "p", "source": "def grade(sample, item):\n    return 1.0\n"},
            "python graders",
            "method.reinforcement.grader",
        ),
        (
            {
                "type": "score_model",
                "name": "judge",
                "model": "no-such-model",
                "input": [{"role": "user", "content": "Score {{sample.output_text}}"}],
            },
            "grader.model: No model with id 'no-such-model'",
            "method.reinforcement.grader.model",
        ),
    ],
)
def test_a_grader_the_job_cannot_run_is_a_400_naming_the_field(api, files, grader, says, param):
    c = api.client()
    m = method()
    if grader is None:
        del m["reinforcement"]
    else:
        m["reinforcement"]["grader"] = grader
    before = len(c.fine_tuning.jobs.list().data)
    with pytest.raises(openai.BadRequestError) as e:
        c.fine_tuning.jobs.create(model="tiny-llama", training_file=files[0], method=m)
    assert says in e.value.body["message"]
    assert e.value.body["param"].startswith(param)
    assert len(c.fine_tuning.jobs.list().data) == before  # nothing stored


def test_a_label_model_judge_whose_tokenizer_cannot_constrain_answers_is_a_400(api, files):
    """A label_model grader's answers are decoded to its labels, which needs a fast
    tokenizer: a judge without one is refused when the job is created, not at its first
    graded batch; the same model as a score_model judge (free text) is taken."""
    import shutil

    from transformers import ByT5Tokenizer

    from tests.tiny import make_tiny_llama

    judge = api.settings.models_dir / "byte-llama"
    make_tiny_llama(judge)
    for f in judge.glob("tokenizer*"):
        f.unlink()
    ByT5Tokenizer().save_pretrained(judge)  # a tokenizer transformers has no fast form of
    c = api.client()
    ask = [{"role": "user", "content": "Is {{sample.output_text}} kind?"}]
    label = {"type": "label_model", "name": "tone", "model": "byte-llama", "input": ask,
             "labels": ["kind", "rude"], "passing_labels": ["kind"]}  # fmt: skip
    try:
        with pytest.raises(openai.BadRequestError) as e:
            c.fine_tuning.jobs.create(
                model="tiny-llama", training_file=files[0], method=method(grader=label)
            )
        assert "not a fast tokenizer" in e.value.body["message"]
        assert e.value.body["param"] == "method.reinforcement.grader.model"
        score = {"type": "score_model", "name": "s", "model": "byte-llama", "input": ask}
        job = c.fine_tuning.jobs.create(
            model="tiny-llama", training_file=files[0], method=method(grader=score)
        )
        c.fine_tuning.jobs.cancel(job.id)
    finally:
        shutil.rmtree(judge)


def test_group_advantages_are_normalized_within_each_group_and_zero_when_it_agrees():
    got = advantages([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0], 4)
    r = torch.tensor([1.0, 0.0, 0.0, 0.0])
    want = ((r - r.mean()) / r.std(unbiased=False)).tolist()
    assert got[:4] == pytest.approx(want)
    assert got[4:] == [0.0] * 4  # every answer scored the same: nothing to learn


def test_the_job_object_echoes_the_grader_and_the_decided_hyperparameters(api, trained):
    job, _ = trained
    assert job.method.type == "reinforcement"
    assert job.method.reinforcement.grader.reference == "{{item.word}}"
    hp = job.method.reinforcement.hyperparameters
    assert (hp.batch_size, hp.learning_rate_multiplier, hp.compute_multiplier) == (4, 100.0, 1.0)
    assert hp.model_extra["group_size"] == 8
    assert hp.eval_interval == 10  # as asked, not "auto"


def test_a_model_learns_what_the_grader_rewards(api, trained):
    job, series = trained
    done = api.client().fine_tuning.jobs.retrieve(job.id)
    assert done.model_extra["progress"] == {"step": STEPS, "total": STEPS}
    rewards = series["train_reward_mean"]["values"]
    assert series["train_reward_mean"]["steps"] == list(range(1, STEPS + 1))
    # string_check scores 1 or 0: the mean reward is the share of answers that pass
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert last >= 3 * max(first, 0.02), (first, last, rewards)
    assert last >= 0.12
    # answers are at most max_completion_tokens long; groups that disagree teach
    assert all(0 < v <= 8 for v in series["train_answer_tokens_mean"]["values"])
    assert max(series["train_groups_learning"]["values"]) > 0
    said = [e.message for e in api.client().fine_tuning.jobs.list_events(job.id, limit=100)]
    assert any(m.startswith("Data: 32 training prompts -> 32 rows of") for m in said), said
    # the validation reward, before training, at each eval_interval and at the end
    assert series["valid_reward_mean"]["steps"] == [0, 10, 20, 30]
    assert series["full_valid_reward_mean"]["steps"] == [0, STEPS]


def test_the_same_seed_samples_and_trains_the_same_steps(api, files, trained):
    """Sampling is seeded by the run's seed, the step and the rank: a second job with the
    same request trains bitwise the same first steps (what a resume relies on)."""
    _job, series = trained
    c = api.client()
    again = c.fine_tuning.jobs.create(
        model="tiny-llama",
        training_file=files[0],
        seed=1,
        method=method(max_steps=5),
        extra_body={"engine": {"dtype": "fp32"}},
    )
    mine = run_job(api, again.id)["train_reward_mean"]["values"]
    assert len(mine) == 5
    # the schedule differs (5 steps, not 40), so only the first step's samples, drawn
    # before any update, must agree
    assert mine[0] == series["train_reward_mean"]["values"][0]


def test_the_samplers_log_probabilities_are_the_policys_under_a_whole_forward(api):
    """Sampling prefills left-padded prompts and decodes with the key-value cache; each
    sampled token's log-probability must be what one forward over the whole sequence (the
    loss's) gives it, or the importance ratio of an on-policy step would not be 1."""
    import pstar_core
    from service.methods.rft_objective import sample
    from service.sessions import losses

    engine = pstar_core.initialize(api.settings.models_dir / "tiny-llama", {"dtype": "fp32"})
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12], [13, 14, 15]]  # unequal: padding on the left
    gen = torch.Generator().manual_seed(0)
    answers = sample(engine, prompts, 2, 6, 1.0, stop=set(), pad=0, gen=gen)
    assert [len(a.tokens) for a in answers] == [6] * 6
    data = []
    for k, a in enumerate(answers):
        full = prompts[k // 2] + a.tokens
        data.append(
            losses.Datum(full[:-1], {"target_tokens": full[1:], "weights": [0.0] * (len(full) - 1)})
        )
    got = losses.run(engine, data, "cross_entropy", backward=False).logprobs
    for k, a in enumerate(answers):
        whole = got[k][len(prompts[k // 2]) - 1 :]
        assert whole == pytest.approx(a.logprobs, abs=1e-4), k


def test_a_kl_penalty_trains_adapters_against_the_base_and_says_how_far_they_went(api, files):
    c = api.client()
    m = method(max_steps=6, kl_coef=0.5)
    with pytest.raises(openai.BadRequestError, match="a KL penalty needs") as e:
        c.fine_tuning.jobs.create(model="tiny-llama", training_file=files[0], method=m)
    assert e.value.body["param"] == "method.reinforcement.hyperparameters.kl_coef"
    m["reinforcement"]["lora"] = {"r": 4, "alpha": 8}
    job = c.fine_tuning.jobs.create(
        model="tiny-llama",
        training_file=files[0],
        seed=2,
        method=m,
        extra_body={"engine": {"dtype": "fp32"}},
    )
    kl = run_job(api, job.id)["train_kl"]["values"]
    assert len(kl) == 6
    # the adapters start at zero (B = 0): the policy is the reference until the first step
    assert kl[0] == pytest.approx(0.0, abs=1e-6)
    assert max(kl[1:]) > 1e-4  # then it moves away from it


def test_a_lora_jobs_answers_come_from_the_model_server_with_each_steps_adapters(api, files):
    """`sampler: auto` on a LoRA job: the model server that answers chat completions
    samples every step's answers with the adapters the step starts from (exported each
    step, loaded by the server beside its others). The sampler's log-probabilities are
    the trained policy's (`train_sampler_kl` 0 at every step while the adapters move),
    and the last step's, asked of the route again, are what peft gives those adapters."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    c = api.client()
    m = method(max_steps=4, eval_interval=100, group_size=4)
    m["reinforcement"]["lora"] = {"r": 4, "alpha": 8}
    job = c.fine_tuning.jobs.create(
        model="tiny-llama",
        training_file=files[0],
        validation_file=files[1],
        seed=4,
        method=m,
        extra_body={"engine": {"dtype": "fp32"}},
    )
    assert job.method.reinforcement.hyperparameters.model_extra["sampler"] == "server"
    series = run_job(api, job.id)
    gaps = series["train_sampler_kl"]["values"]
    assert len(gaps) == 4
    assert max(abs(g) for g in gaps) < 1e-4, gaps
    # the server loaded the job's adapters of each step: 0 (and the first evaluation),
    # 1, 2, 3, and 4 (the final evaluation's); the directories of all but the last are gone
    where = api.settings.job_dir(job.id) / "sampler" / "attempt-1"
    gen = next(g for d, g in api.models.gens.items() if d.name == "tiny-llama")  # the base's
    mine = str(where.relative_to(api.settings.data_dir))
    loaded = [k for k in gen.adapters if k.startswith(mine)]
    assert [k.rsplit("-", 1)[1] for k in loaded] == ["0", "1", "2", "3", "4"], loaded
    assert sorted(p.name for p in where.iterdir()) == ["step-4"]

    # the route again, with a key of the job's: answers by the last adapters
    from service.control.grader_access import key_name

    _, secret = api.store.keys.create("acme", role="grader", name=key_name(job.id, 1))
    as_job = {"Authorization": f"Bearer {secret}"}
    url = f"{api.base}/internal/jobs/{job.id}/rollouts"
    prompt = [1, 5, 9, 14, 20]
    ask = {"attempt": 1, "step": 4, "prompts": [prompt], "n": 2, "max_tokens": 5, "seed": 3}
    got = httpx.post(url, headers=as_job, json=ask, timeout=60)
    assert got.status_code == 200, got.text
    samples = got.json()["samples"]
    assert len(samples) == 2
    assert all(len(x["tokens"]) == len(x["logprobs"]) for x in samples)
    base = AutoModelForCausalLM.from_pretrained(api.settings.models_dir / "tiny-llama")
    tuned = PeftModel.from_pretrained(base, where / "step-4").eval()
    for x in samples:
        ids = torch.tensor([prompt + x["tokens"]])
        with torch.no_grad():
            logp = torch.log_softmax(tuned(ids).logits[0].float(), -1)
        k = len(prompt)
        want = [float(logp[k - 1 + j, t]) for j, t in enumerate(x["tokens"])]
        assert x["logprobs"] == pytest.approx(want, abs=1e-4)
        with torch.no_grad(), tuned.disable_adapter():
            plain = torch.log_softmax(tuned(ids).logits[0].float(), -1)
        moved = max(
            abs(float(plain[k - 1 + j, t]) - w)
            for j, (t, w) in enumerate(zip(x["tokens"], want, strict=True))
        )
        assert moved > 1e-3  # the adapters trained: the base would have answered otherwise
    # the same seed repeats; what the route refuses
    assert httpx.post(url, headers=as_job, json=ask, timeout=60).json()["samples"] == samples
    refused = {
        "a tenant's own key": (api.headers(), ask, 403),
        "another job's key": (
            {"Authorization": "Bearer " + api.store.keys.create(
                "acme", role="grader", name=key_name("ftjob-other", 1))[1]},
            ask, 403,
        ),
        "weights never exported": (as_job, {**ask, "step": 3}, 404),
        "an earlier attempt": (as_job, {**ask, "attempt": 2}, 409),
        "no prompt": (as_job, {**ask, "prompts": []}, 400),
    }  # fmt: skip
    for why, (headers, body, status) in refused.items():
        r = httpx.post(url, headers=headers, json=body, timeout=60)
        assert r.status_code == status, (why, r.text)
        assert r.json()["error"]["message"], why


def test_a_server_that_cannot_answer_leaves_auto_to_the_engine_and_fails_one_asked_for(
    api, files, monkeypatch
):
    """`auto` decided the server: when it cannot answer, the engine samples for the rest
    of the attempt and an event says why. Asked for by name, the job fails saying so."""
    from service.errors import Unavailable
    from service.methods import rft_objective

    async def no_replica(*_a, **_k):
        raise Unavailable("model tiny-llama did not answer within 180 s (no replica could start?)")

    monkeypatch.setattr(api.models, "open", no_replica)
    monkeypatch.setattr(rft_objective, "FALLBACK_PATIENCE_S", 0.5)
    monkeypatch.setattr(rft_objective, "SERVER_PATIENCE_S", 0.5)
    c = api.client()
    lora = {"r": 4, "alpha": 8}
    m = method(max_steps=2, group_size=2, eval_interval=100)
    m["reinforcement"]["lora"] = lora
    kw = {"model": "tiny-llama", "training_file": files[0], "seed": 6}
    job = c.fine_tuning.jobs.create(**kw, method=m, extra_body={"engine": {"dtype": "fp32"}})
    series = run_job(api, job.id)
    assert series["train_sampler_kl"]["steps"] == [1, 2]
    assert max(abs(v) for v in series["train_sampler_kl"]["values"]) < 1e-4  # the engine's
    said = [e.message for e in c.fine_tuning.jobs.list_events(job.id, limit=100).data]
    left = [x for x in said if x.startswith("The model server could not sample the answers")]
    assert len(left) == 1, said
    assert "no replica could start" in left[0]
    assert "the engine samples them for the rest of this attempt" in left[0]
    c.fine_tuning.jobs.cancel(job.id)

    m = method(max_steps=2, group_size=2, eval_interval=100, sampler="server")
    m["reinforcement"]["lora"] = lora
    job = c.fine_tuning.jobs.create(**kw, method=m, extra_body={"engine": {"dtype": "fp32"}})
    with pytest.raises(RuntimeError, match="sampler 'server': the model server sampling") as e:
        run_job(api, job.id)
    assert "no replica could start" in str(e.value)
    c.fine_tuning.jobs.cancel(job.id)


def test_a_full_fine_tune_cannot_sample_on_the_server(api, files):
    m = method(sampler="server")
    with pytest.raises(openai.BadRequestError, match=r"needs method\.reinforcement\.lora") as e:
        api.client().fine_tuning.jobs.create(model="tiny-llama", training_file=files[0], method=m)
    assert e.value.body["param"] == "method.reinforcement.hyperparameters.sampler"
    job = api.client().fine_tuning.jobs.create(
        model="tiny-llama", training_file=files[0], method=method(max_steps=1)
    )
    assert job.method.reinforcement.hyperparameters.model_extra["sampler"] == "engine"
    api.client().fine_tuning.jobs.cancel(job.id)


def test_hyperparameters_no_model_here_takes_are_a_400(api, files):
    c = api.client()
    with pytest.raises(openai.BadRequestError) as e:
        c.fine_tuning.jobs.create(
            model="tiny-llama", training_file=files[0], method=method(reasoning_effort="low")
        )
    assert e.value.body["param"] == "method.reinforcement.hyperparameters.reasoning_effort"


def test_any_seed_the_service_picks_seeds_sampling_and_the_same_seed_repeats():
    from service.methods.rft_objective import generator

    for seed in (0, 18_446_634, 2**31 - 1):  # the server picks seeds below 2**31
        a, b = generator(seed, 7, 1), generator(seed, 7, 1)
        assert torch.equal(torch.rand(4, generator=a), torch.rand(4, generator=b))
    draws = {
        tuple(torch.rand(2, generator=generator(5, s, r)).tolist()) for s in (0, 1) for r in (0, 1)
    }
    assert len(draws) == 4  # each step and rank its own stream


def test_multi_grader_names_that_would_be_one_metric_get_their_own():
    from service.methods.rft_objective import metric_names

    got = metric_names(["a-b", "a_b", "ß", "é", "ok"])
    assert got == {"a-b": "a_b", "a_b": "a_b_2", "ß": "grader", "é": "grader_2", "ok": "ok"}


def test_a_later_line_missing_a_key_the_grader_names_fails_the_job_saying_which(api):
    """Creation checks the first lines; the rest are checked as the data is prepared, so
    the job fails before training with the line, not in the middle with a worker's error."""
    from service.control.driver import prepare_run
    from service.data.datasets import DataError
    from tests.service.test_store import driver_attempt

    c = api.client()
    data = prompt_lines(24) + prompt_lines(1, 50).replace(b'"word"', b'"wrd"')
    data += b'{"messages": [{"role": "user", "content": "hi"}], "word": "\\ud800x"}\n'
    f = upload(c, data, "late.jsonl")
    job = c.fine_tuning.jobs.create(model="tiny-llama", training_file=f.id, method=method())
    attempt = driver_attempt(api.store, job.id)
    with pytest.raises(DataError, match=r"the train file's line 25: .*uses \{\{item.word\}\}"):
        prepare_run(api.settings, api.store, api.store.jobs.get(job.id), attempt)


JUDGE = {
    "type": "multi",
    "name": "named and judged",
    "graders": {
        "exact": GRADER,
        "judge": {
            "type": "score_model",
            "name": "judge",
            "model": "tiny-llama",
            "input": [
                {
                    "role": "system",
                    "content": "Score from 0 to 1 how well the answer names the word.",
                },
                {"role": "user", "content": "Word: {{item.word}}. Answer: {{sample.output_text}}"},
            ],
            "range": [0, 1],
            "sampling_params": {"temperature": 0, "max_completions_tokens": 4, "seed": 0},
        },
    },
    "calculate_output": "exact + judge",
}


def two_graded_steps(api, files, grader: dict, seed: int):
    """A job of 2 steps (2 answers a prompt, an evaluation at step 2) graded by `grader`,
    run to its end; (the job, its metric series)."""
    job = api.client().fine_tuning.jobs.create(
        model="tiny-llama",
        training_file=files[0],
        validation_file=files[1],
        seed=seed,
        method=method(grader, max_steps=2, group_size=2, eval_interval=2),
        extra_body={"engine": {"dtype": "fp32"}},
    )
    return job, run_job(api, job.id)


def shown_answers(client, job_id: str) -> list[tuple[dict, str]]:
    """The first evaluation's graded answers the job shows, each with its prompt's word."""
    import re

    shown = [
        e.data for e in client.fine_tuning.jobs.list_events(job_id, limit=100).data
        if e.data and "graded" in e.data
    ]  # fmt: skip
    assert shown
    return [(x, re.search(r"What does (\S+) mean\?", x["prompt"])[1]) for x in shown[0]["graded"]]


def test_score_model_graders_ask_through_the_api_with_a_key_that_reaches_nothing_else(api, files):
    """A job's score_model grader asks its model through this API's chat completions, as
    /graders/run does (the same scores for the same answers), with a key of the job's own
    that can ask nothing else and is revoked once the job has ended."""

    from service.control import grader_access
    from service.control.driver import finish_success

    c = api.client()
    job, series = two_graded_steps(api, files, JUDGE, seed=3)
    tokens = series["train_grader_model_tokens"]["values"]
    assert len(tokens) == 2
    assert min(tokens) > 0
    (key,) = [k for k in api.store.keys.live("grader") if job.id in k.name]
    assert key.tenant == "acme"
    assert key.name.startswith(f"grader of {job.id} attempt ")
    attempt = key_attempt(key.name)
    secret_file = api.settings.job_dir(job.id) / "secrets" / f"grader_key.{attempt}"
    secret = secret_file.read_text().strip()
    as_job = {"Authorization": f"Bearer {secret}"}
    root = api.base.removesuffix("/v1")
    for verb, path in [
        ("GET", "/v1/files"), ("POST", "/v1/completions"), ("GET", "/v1/fine_tuning/jobs"),
        ("POST", "/v1/fine_tuning/alpha/graders/run"), ("GET", "/metrics"),
        ("GET", "/v1/admin/keys"), ("POST", "/api/v1/create_session"),
    ]:  # fmt: skip
        elsewhere = httpx.request(verb, root + path, headers=as_job, json={})
        assert elsewhere.status_code == 403, (path, elsewhere.text)
    # besides chat completions, it embeds (a cosine metric's texts)
    embedded = httpx.post(
        f"{api.base}/embeddings", headers=as_job, json={"model": "tiny-embedder", "input": "apple"}
    )
    assert embedded.status_code == 200, embedded.text
    # each shown answer's judge score is what /graders/run gives the same answer
    for x, word in shown_answers(c, job.id):
        got = httpx.post(
            f"{api.base}/fine_tuning/alpha/graders/run",
            headers=api.headers(),
            json={"grader": JUDGE, "model_sample": x["answer"], "item": {"word": word}},
            timeout=120,
        ).json()
        assert got["sub_rewards"]["judge"] == x["scores"]["judge"], x
        assert got["reward"] == x["reward"]
    # the job ends: the reconciler's sweep revokes the key
    finish_success(api.settings, api.store, api.store.jobs.get(job.id), key_attempt(key.name))
    grader_access.sweep(api.store)  # (the server's reconciler may have swept it first)
    assert not [k for k in api.store.keys.live("grader") if job.id in k.name]
    ask = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    # refused within the key cache's time to live (api.auth.KeyCache: 5 s)
    deadline = time.monotonic() + 30
    while (
        after := httpx.post(f"{api.base}/chat/completions", headers=as_job, json=ask)
    ).is_success:
        assert time.monotonic() < deadline, "the revoked key still asks"
        time.sleep(0.5)
    assert after.status_code == 401


NEAR = {
    "type": "multi",
    "name": "near",
    "graders": {
        "exact": GRADER,
        "near": {
            "type": "text_similarity", "name": "near", "evaluation_metric": "cosine",
            "input": "{{sample.output_text}}", "reference": "{{item.word}} is a word",
        },
    },
    "calculate_output": "0.5 * exact + 0.5 * near",
}  # fmt: skip


def test_a_cosine_metric_embeds_through_the_api_as_graders_run_does(api, files):
    """A job's cosine metric embeds its answers with the configured model through this
    API's /v1/embeddings, with the job's grader key: each shown answer's score is what
    /graders/run gives it."""
    c = api.client()
    job, series = two_graded_steps(api, files, NEAR, seed=5)
    assert len(series["train_reward_mean_near"]["values"]) == 2
    for x, word in shown_answers(c, job.id):
        got = c.fine_tuning.alpha.graders.run(
            grader=NEAR, model_sample=x["answer"], item={"word": word}
        )
        assert got.sub_rewards["near"] == pytest.approx(x["scores"]["near"], abs=1e-6), x
        assert -1.0 <= x["scores"]["near"] <= 1.0


def key_attempt(name: str) -> int:
    return int(name.rsplit(" ", 1)[1])


def test_a_paused_and_resumed_reinforcement_job_trains_the_steps_of_an_uninterrupted_one(
    api, files
):
    """A pause checkpoints at a step boundary; the resumed attempt samples, grades and
    trains what the uninterrupted run did: every step's loss and reward, bit for bit."""
    c = api.client()
    kw = {
        "model": "tiny-llama",
        "training_file": files[0],
        "seed": 5,
        "method": method(max_steps=6, eval_interval=100),
        "extra_body": {"engine": {"dtype": "fp32"}},
    }
    straight = run_job(api, c.fine_tuning.jobs.create(**kw).id)
    job = c.fine_tuning.jobs.create(**kw)
    run_job(api, job.id, pause_at=3)
    got = c.fine_tuning.jobs.retrieve(job.id)
    assert (got.status, got.model_extra["progress"]["step"]) == ("paused", 3)
    # the module's other jobs never end here (no driver): out of the tenant's running quota
    for other in c.fine_tuning.jobs.list(limit=100):
        if other.id != job.id and other.status in ("validating_files", "queued", "running"):
            c.fine_tuning.jobs.cancel(other.id)
    assert c.fine_tuning.jobs.resume(job.id).status == "queued"
    deadline = time.monotonic() + 60  # the server's reconciler starts attempt 2
    while api.store.jobs.get(job.id).attempt < 2:
        assert time.monotonic() < deadline, "no second attempt"
        time.sleep(0.1)
    resumed = run_job(api, job.id)
    said = [e.message for e in c.fine_tuning.jobs.list_events(job.id, limit=100).data]
    assert "Attempt 2 resumed from the checkpoint at step 3" in said  # not from scratch
    for name in ("train_loss", "train_reward_mean"):
        assert resumed[name]["steps"] == straight[name]["steps"] == [1, 2, 3, 4, 5, 6]
        assert resumed[name]["values"] == straight[name]["values"], name
