"""Chat and text completions through the unmodified `openai` SDK (and plain HTTP where the
SDK does not go), on the real API with the models in the test process: the answers equal
`transformers`' greedy `generate` on the exported directories (the base, a LoRA adapter on
its base and merged, a checkpoint's adapter, a full fine-tune), streaming equals the
whole answer, sampling repeats with a seed, and every mistake a client can make is a 4xx
naming the field. Deleting a model as OpenAI does. Ray Serve's side is
tests/service/test_serving_ray.py."""

from __future__ import annotations

import httpx
import openai
import pytest

from benchmarks.models_made import full_model, greedy, lora_model
from tests.api.conftest import api_in_process

ASK = [{"role": "user", "content": "What does apple mean?"}]


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    with api_in_process(tmp_path_factory, "completions") as server:
        yield server


@pytest.fixture(scope="module")
def lora(api):
    return lora_model(api.store, api.settings.data_dir)


@pytest.fixture(scope="module")
def full(api):
    return full_model(api.store, api.settings.data_dir)


def chat(api, model: str, tenant: str = "acme", **kw):
    kw.setdefault("max_tokens", 12)
    kw.setdefault("temperature", 0)
    return api.client(tenant).chat.completions.create(model=model, messages=ASK, **kw)


def test_base_model_greedy_answer_equals_transformers_generate(api):
    got = chat(api, "tiny-llama")
    want = greedy(api.settings.models_dir / "tiny-llama", ASK, 12)
    assert got.choices[0].message.content == want
    assert got.object == "chat.completion"
    assert got.choices[0].finish_reason in ("stop", "length")
    assert got.usage.completion_tokens <= 12
    assert got.usage.total_tokens == got.usage.prompt_tokens + got.usage.completion_tokens


def test_lora_model_is_its_adapter_on_the_shared_base_and_equals_merged(api, lora):
    got = chat(api, lora.model).choices[0].message.content
    base_dir = api.settings.models_dir / "tiny-llama"
    assert got == greedy(base_dir, ASK, 12, adapter=lora.export / "adapter")
    assert got == greedy(lora.export, ASK, 12)  # the merged export answers the same
    assert got != chat(api, "tiny-llama").choices[0].message.content  # the adapter acts
    # one Generator (the base's) served both: the adapter did not load a second model
    backend = api.models
    assert set(backend.gens) == {base_dir}
    assert lora.export / "adapter" not in backend.gens


def test_checkpoint_model_serves_that_checkpoints_adapter(api, lora):
    got = chat(api, lora.checkpoint).choices[0].message.content
    ck_adapter = api.settings.data_dir / "runs" / lora.job_id / "checkpoint_000000" / "adapter"
    want = greedy(api.settings.models_dir / "tiny-llama", ASK, 12, adapter=ck_adapter)
    assert got == want
    assert got != chat(api, lora.model).choices[0].message.content


def test_full_fine_tune_serves_its_own_directory(api, full):
    assert chat(api, full.model).choices[0].message.content == greedy(full.export, ASK, 12)


def test_mixed_batch_of_adapters_and_base_answers_each_as_alone(api, lora):
    """Requests to the base, the adapter and the checkpoint at once share decode steps."""
    import concurrent.futures as cf

    models = ["tiny-llama", lora.model, lora.checkpoint, lora.model]  # 4: the tenant limit
    alone = {m: chat(api, m, max_tokens=16).choices[0].message.content for m in set(models)}
    with cf.ThreadPoolExecutor(len(models)) as pool:
        together = list(pool.map(lambda m: chat(api, m, max_tokens=16), models))
    for m, r in zip(models, together, strict=True):
        assert r.choices[0].message.content == alone[m]


def test_stream_chunks_add_up_to_the_whole_answer(api):
    whole = chat(api, "tiny-llama", max_tokens=20)
    chunks = list(
        chat(api, "tiny-llama", max_tokens=20, stream=True, stream_options={"include_usage": True})
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_stream_ends_with_done_over_plain_http(api):
    with httpx.stream(
        "POST",
        f"{api.base}/chat/completions",
        headers=api.headers(),
        json={"model": "tiny-llama", "messages": ASK, "max_tokens": 4, "stream": True},
        timeout=60,
    ) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [x for x in r.iter_lines() if x]
    assert lines[-1] == "data: [DONE]"
    assert all(x.startswith("data: ") for x in lines)


def test_sampling_with_a_seed_repeats_and_n_gives_n_choices(api):
    kw = {"max_tokens": 16, "temperature": 1.0, "n": 3}
    a = chat(api, "tiny-llama", seed=7, **kw)
    b = chat(api, "tiny-llama", seed=7, **kw)
    c = chat(api, "tiny-llama", seed=8, **kw)
    texts = [ch.message.content for ch in a.choices]
    assert [ch.index for ch in a.choices] == [0, 1, 2]
    assert texts == [ch.message.content for ch in b.choices]
    assert texts != [ch.message.content for ch in c.choices]
    assert len(set(texts)) > 1  # the choices are drawn apart, not copied


def test_stop_string_cuts_the_answer_before_it(api):
    whole = chat(api, "tiny-llama", max_tokens=30).choices[0].message.content
    assert len(whole) > 6
    stop = whole[3:6]
    got = chat(api, "tiny-llama", max_tokens=30, stop=[stop]).choices[0]
    assert got.message.content == whole[: whole.index(stop)]
    assert got.finish_reason == "stop"


def test_text_completion_of_a_prompt_and_of_token_ids(api):
    from transformers import AutoTokenizer

    c = api.client()
    a = c.completions.create(model="tiny-llama", prompt="apple is", max_tokens=8, temperature=0)
    assert a.object == "text_completion"
    assert a.choices[0].finish_reason in ("stop", "length")
    ids = AutoTokenizer.from_pretrained(api.settings.models_dir / "tiny-llama")("apple is")[
        "input_ids"
    ]
    b = c.completions.create(model="tiny-llama", prompt=ids, max_tokens=8, temperature=0)
    assert b.choices[0].text == a.choices[0].text
    streamed = c.completions.create(
        model="tiny-llama", prompt="apple is", max_tokens=8, temperature=0, stream=True
    )
    assert "".join(x.choices[0].text for x in streamed) == a.choices[0].text


def test_another_tenants_model_and_unknown_models_are_not_found(api, lora):
    with pytest.raises(openai.NotFoundError) as e:
        chat(api, lora.model, tenant="rival")
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        chat(api, lora.checkpoint, tenant="rival")
    with pytest.raises(openai.NotFoundError):
        chat(api, "no-such-model")


F = {"type": "function", "function": {"name": "f"}}  # a tool that takes anything


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"temperature": 3}, "temperature"),
        ({"n": 50}, "n"),
        ({"max_tokens": 100_000}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"n": 8, "max_tokens": 600}, "max_tokens"),  # 4,800 tokens in all, past the limit
        ({"seed": 2**70}, "seed"),
        ({"seed": -(2**64)}, "seed"),
        ({"tools": [{"type": "function", "function": {"name": "no spaces"}}]}, "tools"),
        ({"tools": [{**F, "function": {"name": "f", "parameters": {"type": 5}}}]}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),  # and no tools
        (
            {"tools": [F], "tool_choice": {"type": "function", "function": {"name": "g"}}},
            "tool_choice",
        ),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"messages": [{"role": "tool", "content": "42"}]}, "messages"),  # answers no call
        ({"messages": [{"role": "user", "content": "hi", "tool_calls": []}]}, "messages"),
        ({"top_logprobs": 3}, "top_logprobs"),  # needs logprobs
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "messages"),
    ],
)
def test_bad_parameters_are_400_naming_the_field(api, extra, param):
    body = {"model": "tiny-llama", "messages": ASK, "max_tokens": 4, **extra}
    r = httpx.post(f"{api.base}/chat/completions", headers=api.headers(), json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"].startswith(param), err
    assert err["type"] == "invalid_request_error"


def test_prompt_past_the_context_is_context_length_exceeded(api):
    long = [{"role": "user", "content": "apple " * 400}]  # the tiny Llama's context is 256
    with pytest.raises(openai.BadRequestError) as e:
        api.client().chat.completions.create(model="tiny-llama", messages=long, max_tokens=4)
    assert e.value.body["code"] == "context_length_exceeded"
    assert e.value.body["param"] == "messages"
    assert "maximum context length is" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:  # streaming: a 400 too, not a broken stream
        api.client().chat.completions.create(
            model="tiny-llama", messages=long, max_tokens=4, stream=True
        )
    assert e.value.body["code"] == "context_length_exceeded"


def test_zoo_model_has_no_weights_to_serve(api):
    with pytest.raises(openai.BadRequestError) as e:
        chat(api, "gpt-1b")
    assert e.value.body["code"] == "model_not_servable"


def test_generations_in_flight_per_tenant_are_limited(api):
    """Past max_concurrent_generations_per_tenant (4), a 429 naming the setting; the
    other tenant is not affected, and a slot comes back when a stream closes."""
    c = api.client()
    opened = [
        c.chat.completions.create(
            model="tiny-llama", messages=ASK, max_tokens=200, stream=True, temperature=0
        )
        for _ in range(4)
    ]
    try:
        with pytest.raises(openai.RateLimitError) as e:
            chat(api, "tiny-llama")
        assert "PSTAR_MAX_CONCURRENT_GENERATIONS_PER_TENANT" in e.value.body["message"]
        assert chat(api, "tiny-llama", tenant="rival").choices
    finally:
        for s in opened:
            s.close()
    import time

    deadline = time.time() + 30
    while True:  # the slots come back as the server notices the closed streams
        try:
            assert chat(api, "tiny-llama").choices
            break
        except openai.RateLimitError:
            assert time.time() < deadline
            time.sleep(0.2)


def test_delete_model_as_openai(api):
    made = lora_model(api.store, api.settings.data_dir)
    c = api.client()
    assert chat(api, made.model).choices
    with pytest.raises(openai.NotFoundError):
        api.client("rival").models.delete(made.model)
    with pytest.raises(openai.PermissionDeniedError):
        c.models.delete("tiny-llama")
    gone = c.models.delete(made.model)
    assert (gone.id, gone.object, gone.deleted) == (made.model, "model", True)
    assert made.model not in [m.id for m in c.models.list()]
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve(made.model)
    with pytest.raises(openai.NotFoundError):
        chat(api, made.model)
    with pytest.raises(openai.NotFoundError):
        c.models.delete(made.model)
    assert not made.export.exists()
    job = c.fine_tuning.jobs.retrieve(made.job_id)  # the job keeps its record
    assert job.fine_tuned_model == made.model
    assert (api.settings.models_dir / "tiny-llama" / "config.json").is_file()


def test_deleted_model_keeps_its_files_while_a_job_fine_tunes_from_it(api, full):
    from service.serving.deployments import delete_model_files
    from tests.service.test_store import add_job

    body = {"model": full.model, "training_file": "file-1"}
    job = add_job(api.store, body=body, status="paused")
    api.client().models.delete(full.model)
    assert full.export.is_dir()  # the running job may still read it (a retry, a resume)
    api.store.jobs.update(job.id, status="cancelled")  # it ends (a paused job cannot succeed)
    assert delete_model_files(api.settings, api.store) == [full.job_id]
    assert not full.export.exists()


def test_a_repeated_system_prompt_is_reported_as_cached_tokens(api):
    """The second chat sharing a long system prompt reuses its keys and values (a replica's
    prefix cache): `usage.prompt_tokens_details.cached_tokens`, as OpenAI reports it,
    whole and streamed, and on text completions; the answer is still `generate`'s."""
    system = {"role": "system", "content": "You answer in one word only. " * 3}
    first = [system, {"role": "user", "content": "What does river mean?"}]
    second = [system, {"role": "user", "content": "What does stone mean?"}]
    c = api.client()
    a = c.chat.completions.create(model="tiny-llama", messages=first, max_tokens=6, temperature=0)
    assert a.usage.prompt_tokens_details.cached_tokens == 0
    b = c.chat.completions.create(model="tiny-llama", messages=second, max_tokens=6, temperature=0)
    assert 16 <= b.usage.prompt_tokens_details.cached_tokens < b.usage.prompt_tokens
    assert b.choices[0].message.content == greedy(api.settings.models_dir / "tiny-llama", second, 6)
    chunks = list(
        c.chat.completions.create(
            model="tiny-llama",
            messages=second,
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == b.usage.prompt_tokens - 1
    text = "You answer in one word only. " * 3
    c.completions.create(model="tiny-llama", prompt=text + "river", max_tokens=2)
    t = c.completions.create(
        model="tiny-llama", prompt=[text + "stone", text + "cloud"], max_tokens=2
    )
    assert t.usage.prompt_tokens_details.cached_tokens >= 2 * 16
