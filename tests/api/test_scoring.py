"""Scoring a served model through the API, as evaluation harnesses do: `/v1/completions`
with a batch of prompts (strings or token ids), `echo`, `logprobs` and `max_tokens: 0`
answers each prompt token's log-probability exactly as the model computes it in-process;
chat completions' `logprobs` / `top_logprobs`; streamed log-probabilities; and the
combinations that make no sense are 400s naming the field."""

from __future__ import annotations

import math

import httpx
import pytest
import torch

from tests.api.conftest import api_in_process

ASK = [{"role": "user", "content": "What does apple mean?"}]


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    with api_in_process(tmp_path_factory, "scoring") as server:
        yield server


@pytest.fixture(scope="module")
def reference(api):
    """Each position's log-probabilities of the tiny model, computed in this process."""
    from transformers import AutoTokenizer

    from pstar_core.hf import load_causal_lm

    model_dir = api.settings.models_dir / "tiny-llama"
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = load_causal_lm(model_dir, dtype=torch.float32).eval()

    def logprobs(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)

    return tok, logprobs


def post(api, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{api.base}{path}", headers=api.headers(), json=body, timeout=60)


def test_echoed_prompt_logprobs_of_a_batch_equal_the_models_own(api, reference):
    tok, logprobs = reference
    prompts = [tok("apple means a fruit")["input_ids"], tok("a pear")["input_ids"], "plum pie"]
    r = post(
        api,
        "/completions",
        {
            "model": "tiny-llama",
            "prompt": prompts[:2],
            "echo": True,
            "logprobs": 2,
            "max_tokens": 0,
        },
    )
    assert r.status_code == 200, r.text
    out = r.json()
    assert [c["index"] for c in out["choices"]] == [0, 1]
    for ids, choice in zip(prompts[:2], out["choices"], strict=True):
        lp = choice["logprobs"]
        assert choice["text"] == tok.decode(ids)  # echoed, nothing generated
        assert choice["finish_reason"] == "length"
        assert lp["tokens"] == [tok.decode([t]) for t in ids]
        assert lp["token_logprobs"][0] is None
        assert lp["top_logprobs"][0] is None
        want = logprobs(ids)
        for k in range(1, len(ids)):
            assert math.isclose(lp["token_logprobs"][k], want[k - 1, ids[k]], abs_tol=1e-4)
            top = lp["top_logprobs"][k]
            assert len(top) <= 2
            assert math.isclose(max(top.values()), want[k - 1].max(), abs_tol=1e-4)
        assert lp["text_offset"][0] == 0
        assert lp["text_offset"][-1] == len(choice["text"]) - len(lp["tokens"][-1])
    assert out["usage"]["prompt_tokens"] == sum(len(p) for p in prompts[:2])
    assert out["usage"]["completion_tokens"] == 0
    # a string prompt is echoed as given
    r = post(api, "/completions", {"model": "tiny-llama", "prompt": [prompts[2]], "echo": True,
                                   "logprobs": 0, "max_tokens": 0})  # fmt: skip
    assert r.json()["choices"][0]["text"] == "plum pie"


def test_generated_tokens_have_their_logprobs_and_greedy_ones_are_the_likeliest(api):
    body = {"model": "tiny-llama", "prompt": "apple", "max_tokens": 5, "temperature": 0,
            "logprobs": 3, "n": 2}  # fmt: skip
    out = post(api, "/completions", body).json()
    assert len(out["choices"]) == 2
    for choice in out["choices"]:
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"])
        for value, top in zip(lp["token_logprobs"], lp["top_logprobs"], strict=True):
            assert 1 <= len(top) <= 3  # tokens that decode alike share one entry
            assert math.isclose(value, max(top.values()), abs_tol=1e-5)  # greedy


def test_chat_logprobs_with_top_logprobs_through_the_sdk(api):
    got = api.client().chat.completions.create(
        model="tiny-llama", messages=ASK, max_tokens=6, temperature=0, logprobs=True,
        top_logprobs=2,
    )  # fmt: skip
    choice = got.choices[0]
    content = choice.logprobs.content
    assert content
    assert choice.message.content.startswith("".join(t.token for t in content)[:3])
    for t in content:
        assert len(t.top_logprobs) == 2
        assert math.isclose(t.logprob, t.top_logprobs[0].logprob, abs_tol=1e-5)
        assert bytes(t.bytes).decode() == t.token
    without = api.client().chat.completions.create(
        model="tiny-llama", messages=ASK, max_tokens=6, temperature=0
    )
    assert without.choices[0].logprobs is None
    assert without.choices[0].message.content == choice.message.content


def test_a_stream_carries_each_choices_logprobs_on_its_last_chunk(api):
    kw = {"model": "tiny-llama", "messages": ASK, "max_tokens": 6, "temperature": 0}
    whole = api.client().chat.completions.create(**kw, logprobs=True)
    chunks = list(api.client().chat.completions.create(**kw, logprobs=True, stream=True))
    carrying = [c for c in chunks if c.choices and c.choices[0].logprobs is not None]
    assert len(carrying) == 1
    assert carrying[0].choices[0].finish_reason is not None
    streamed = [(t.token, t.logprob) for t in carrying[0].choices[0].logprobs.content]
    assert streamed == [(t.token, t.logprob) for t in whole.choices[0].logprobs.content]


@pytest.mark.parametrize("echo", [False, True])
def test_a_streamed_batch_numbers_its_choices_as_openai_and_says_what_it_says_whole(api, echo):
    """A batch of prompts (strings and token ids) streams, with echo too: prompt p's
    choice j is choice p*n + j, and each choice's streamed text (the prompt first, with
    echo) is the text the same request gives whole; the usage is the prompts' sum."""
    c = api.client()
    for prompt in (["apple", "river stone", "a"], [[5, 6, 7], [8, 9]]):
        kw = {"model": "tiny-llama", "prompt": prompt, "n": 2, "max_tokens": 4,
              "temperature": 0, "echo": echo}  # fmt: skip
        whole = c.completions.create(**kw)
        texts: dict[int, str] = {}
        ended: dict[int, str] = {}
        usage = None
        for ch in c.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
            for choice in ch.choices:
                texts[choice.index] = texts.get(choice.index, "") + choice.text
                if choice.finish_reason:
                    ended[choice.index] = choice.finish_reason
            usage = ch.usage or usage
        want = {x.index: x.text for x in whole.choices}
        assert sorted(texts) == sorted(want) == list(range(2 * len(prompt)))
        assert texts == want
        assert ended == {x.index: x.finish_reason for x in whole.choices}
        assert usage.prompt_tokens == whole.usage.prompt_tokens
        assert usage.completion_tokens == whole.usage.completion_tokens


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"max_tokens": 0}, "max_tokens"),  # generates nothing and echoes nothing
        ({"echo": True, "stream": True, "logprobs": 1}, "logprobs"),
        ({"logprobs": 6}, "logprobs"),
        ({"prompt": ["a"] * 33}, "prompt"),
        ({"prompt": [[1, 2], []]}, "prompt"),
    ],
)
def test_scoring_requests_that_make_no_sense_are_400_naming_the_field(api, extra, param):
    r = post(api, "/completions", {"model": "tiny-llama", "prompt": "apple", **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].startswith(param)


def test_lm_evaluation_harness_scores_a_served_model_as_it_scores_the_weights_in_process(
    api, tmp_path, monkeypatch
):
    """EleutherAI's harness, unmodified, on a multiple-choice task of our own (a local
    file): `local-completions` against the API (token-id prompts in batches, echo,
    logprobs, max_tokens 1) gives every choice the log-likelihood its `hf` model computes
    from the same directory in this process."""
    import json

    lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is a dev dependency")
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("OPENAI_API_KEY", api.headers()["Authorization"].split()[-1])
    docs = [
        {"question": "An apple is a", "choices": [" fruit", " car", " song"], "answer": 0},
        {"question": "A pear is sweet and", "choices": [" green", " loud"], "answer": 0},
        {"question": "What does apple mean?", "choices": [" a fruit", " a stone"], "answer": 1},
    ]
    data = tmp_path / "fruit.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "fruit.yaml").write_text(
        "task: pstar_fruit\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        'doc_to_text: "{{question}}"\n'
        'doc_to_choice: "{{choices}}"\n'
        'doc_to_target: "{{answer}}"\n'
        "metric_list:\n  - metric: acc\n"
    )
    model_dir = api.settings.models_dir / "tiny-llama"

    def scores(model: str, args: str) -> list[list[float]]:
        out = lm_eval.simple_evaluate(
            model=model,
            model_args=args,
            tasks=["pstar_fruit"],
            task_manager=TaskManager(include_path=str(tasks)),
            log_samples=True,
            batch_size=2,
        )
        samples = sorted(out["samples"]["pstar_fruit"], key=lambda s: s["doc_id"])
        return [[r[0] for r in s["filtered_resps"]] for s in samples]

    served = scores(
        "local-completions",
        f"model=tiny-llama,base_url={api.base}/completions,tokenizer_backend=huggingface,"
        f"tokenizer={model_dir},max_length=256,num_concurrent=1",
    )
    local = scores("hf", f"pretrained={model_dir},device=cpu,dtype=float32")
    assert [len(s) for s in served] == [3, 2, 2]
    for got, want in zip(served, local, strict=True):
        for a, b in zip(got, want, strict=True):
            assert math.isclose(float(a), float(b), abs_tol=1e-4), (served, local)
