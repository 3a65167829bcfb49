"""Tools in chat completions, as OpenAI's SDK sends them: a tiny model that learned one
function call (its prompt rendered as serving renders it: the Hermes fallback, since its
ChatML template knows no tools) answers with that call in `message.tool_calls`, streamed
as OpenAI streams calls; `tool_choice` forces a call or hides the tools; a call's answer
goes back as a tool message; and what the model writes that is not a valid call is never
passed on as one (`service.data.tools.CallReader`, checked here without a model)."""

from __future__ import annotations

import json

import pytest
import torch

from service.data.tools import CallReader, read_answer, template_messages
from tests.api.conftest import api_in_process
from tests.tiny import make_tiny_llama

MODEL = "tool-llama"
UNTRAINED = "tool-llama-untrained"  # the same tiny model before learning the call
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city now",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
CALL = {"name": "get_weather", "arguments": {"city": "Paris"}}
ANSWER = f"<tool_call>\n{json.dumps(CALL)}\n</tool_call>"


def learn_the_call(model_dir, steps: int = 400) -> None:
    """Train the tiny model until its greedy answer to ASK with WEATHER is ANSWER."""
    from transformers import AutoTokenizer

    from pstar_core.hf import load_causal_lm

    tok = AutoTokenizer.from_pretrained(model_dir)
    turns, _ = template_messages(tok, ASK, [WEATHER], lambda c: c)
    prompt = tok.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    p = tok(prompt, add_special_tokens=False)["input_ids"]
    a = tok(ANSWER + tok.eos_token, add_special_tokens=False)["input_ids"]
    ids = torch.tensor([p + a])
    labels = torch.tensor([[-100] * len(p) + a])
    torch.manual_seed(0)
    model = load_causal_lm(model_dir, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)  # the loss is under 1e-3 in ~180 steps
    for _ in range(steps):
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if loss.item() < 1e-3:
            break
    model.save_pretrained(model_dir)


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    with api_in_process(tmp_path_factory, "tools") as server:
        model_dir = make_tiny_llama(server.settings.models_dir / MODEL, context=1024)
        learn_the_call(model_dir)
        make_tiny_llama(server.settings.models_dir / UNTRAINED, context=1024)
        yield server


def ask(api, **kw):
    kw.setdefault("max_tokens", 100)  # the call is 73 of its tokens
    kw.setdefault("temperature", 0)
    kw.setdefault("messages", ASK)
    kw.setdefault("model", MODEL)
    return api.client().chat.completions.create(**kw)


def test_a_model_that_learned_a_call_answers_it_as_openais_tool_calls(api):
    got = ask(api, tools=[WEATHER])
    choice = got.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function"
    assert call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert choice.model_extra.get("tool_call_problems") is None


def test_logprobs_list_the_answers_tokens_and_not_the_end_of_turn_that_closed_it(api):
    from transformers import AutoTokenizer

    choice = ask(api, tools=[WEATHER], logprobs=True).choices[0]
    tokens = [t.token for t in choice.logprobs.content]
    assert "".join(tokens) == ANSWER  # the answer the model learned, its last token ended it
    tok = AutoTokenizer.from_pretrained(api.settings.models_dir / MODEL)
    assert tok.eos_token not in tokens
    assert choice.finish_reason == "tool_calls"
    cut = ask(api, tools=[WEATHER], logprobs=True, max_tokens=5).choices[0]
    assert len(cut.logprobs.content) == 5  # ended by its length: every token it sampled


def test_streamed_calls_arrive_as_openai_streams_them(api):
    whole = ask(api, tools=[WEATHER]).choices[0].message.tool_calls[0]
    chunks = list(ask(api, tools=[WEATHER], stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    calls = [d.tool_calls for d in deltas if d.tool_calls]
    assert len(calls) == 1  # the whole call in one delta once its block ended
    (call,) = calls[0]
    assert call.index == 0
    assert call.id.startswith("call_")
    assert call.function.name == whole.function.name
    assert json.loads(call.function.arguments) == json.loads(whole.function.arguments)
    assert "".join(d.content or "" for d in deltas).strip() == ""  # no text around it
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_tool_choice_forces_a_call_or_hides_the_tools(api):
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        got = ask(api, tools=[WEATHER], tool_choice=choice).choices[0]
        assert got.finish_reason == "tool_calls", choice
        assert json.loads(got.message.tool_calls[0].function.arguments) == {"city": "Paris"}
    hidden = ask(api, tools=[WEATHER], tool_choice="none").choices[0]
    assert hidden.message.tool_calls is None
    assert hidden.finish_reason in ("stop", "length")
    # "none" renders the prompt without the tools: the same answer as asking without them
    assert hidden.message.content == ask(api).choices[0].message.content


def test_a_forced_call_is_decoded_to_its_tools_schema_even_from_an_untrained_model(api):
    """ "required" and a named choice decode the answer to one call block of the tools'
    schemas (llguidance), so the call is valid whatever the model would have written.
    (Parameters of bounded length: an untrained model's free strings run to max_tokens.)"""
    from jsonschema import validate

    def tool(name: str, key: str, values: list[str]) -> dict:
        params = {"type": "object", "properties": {key: {"enum": values}},
                  "required": [key], "additionalProperties": False}  # fmt: skip
        return {"type": "function", "function": {"name": name, "parameters": params}}

    tools = [tool("units", "unit", ["c", "f"]), tool("city", "name", ["Paris", "Rome"])]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    named = {"type": "function", "function": {"name": "city"}}
    for choice in ("required", named):
        got = ask(api, model=UNTRAINED, tools=tools, tool_choice=choice, max_tokens=80)
        c = got.choices[0]
        assert c.finish_reason == "tool_calls", (choice, c)
        (call,) = c.message.tool_calls
        validate(json.loads(call.function.arguments), schemas[call.function.name])
        if choice is named:
            assert call.function.name == "city"
    free = ask(api, model=UNTRAINED, tools=tools, max_tokens=80).choices[0]
    assert free.message.tool_calls is None  # left to itself, it calls nothing


@pytest.mark.parametrize(
    ("answer", "parallel", "taken"),
    [
        ("It is sunny, I think.", True, True),  # text: the model is free to answer so
        ("a < b, and <tool is not a tag", True, True),
        (ANSWER, True, True),
        ("Let me look.\n" + ANSWER, True, True),  # text, then the call
        (ANSWER + "\n" + ANSWER, True, True),
        (ANSWER + "\n" + ANSWER, False, False),  # parallel_tool_calls false: one call
        (ANSWER + " Done.", True, False),  # nothing after the calls
        ('<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>', True, False),
        (f"Sure {ANSWER.replace('city', 'town')}", True, False),  # no required city
    ],
    ids=["text", "a-lone-angle", "call", "text-then-call", "two-calls", "two-not-parallel",
         "text-after", "unknown-tool", "bad-arguments"],
)  # fmt: skip
def test_with_tool_choice_auto_the_model_is_free_but_any_call_it_opens_is_a_valid_one(
    api, answer, parallel, taken
):
    """`auto` decodes to llguidance's grammar of text or calls (service.data.tools.
    call_grammar): a `<tool_call>` the model opens can only be a call of a declared tool
    with its arguments' schema, so an answer's calls validate without being forced."""
    import llguidance.hf
    from llguidance import LLMatcher
    from transformers import AutoTokenizer

    from service.data.tools import call_grammar

    tok = AutoTokenizer.from_pretrained(api.settings.models_dir / MODEL)
    grammar = LLMatcher.grammar_from_lark(call_grammar([WEATHER], "auto", parallel))
    matcher = LLMatcher(llguidance.hf.from_tokenizer(tok), grammar, log_level=0)
    ids = tok(answer, add_special_tokens=False)["input_ids"]
    consumed = all(matcher.consume_token(t) for t in ids)
    assert (consumed and matcher.is_accepting()) == taken, matcher.get_error()


def test_a_calls_result_goes_back_as_a_tool_message(api):
    call = ask(api, tools=[WEATHER]).choices[0].message.tool_calls[0]
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"celsius": 21}'},
    ]
    got = ask(api, tools=[WEATHER], messages=history, max_tokens=8)
    assert got.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert got.usage.prompt_tokens > ask(api, tools=[WEATHER]).usage.prompt_tokens


# -- reading calls back, without a model ----------------------------------------------------


def test_only_valid_calls_of_declared_tools_are_returned_and_the_rest_is_named():
    good = ANSWER
    not_json = "<tool_call>\n{name: get_weather}\n</tool_call>"
    unknown = '<tool_call>\n{"name": "send_mail", "arguments": {}}\n</tool_call>'
    off_schema = '<tool_call>\n{"name": "get_weather", "arguments": {"town": 3}}\n</tool_call>'
    text, calls, problems = read_answer(
        f"Let me look.\n{good}\n{not_json}\n{unknown}\n{off_schema}", [WEATHER]
    )
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "Paris"}]
    assert len(problems) == 3
    assert "call 2: not valid JSON" in problems[0]
    assert "call 2: 'send_mail' is not one of the tools" in problems[1]
    assert "'city' is a required property" in problems[2]
    # what was not a call stays in the text, so nothing the model wrote is lost
    assert text.startswith("Let me look.")
    for block in (not_json, unknown, off_schema):
        assert block in text
    # arguments given as a string holding JSON are read too; a block left open at the end
    # of the answer (stopped at its end token) is read as if closed
    as_string = {"name": "get_weather", "arguments": json.dumps({"city": "Rome"})}
    _, calls, _ = read_answer(f"<tool_call>{json.dumps(as_string)}", [WEATHER])
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Rome"}


def test_with_parallel_calls_off_only_the_first_is_returned():
    two = f"{ANSWER}\n{ANSWER.replace('Paris', 'Rome')}"
    _, calls, problems = read_answer(two, [WEATHER], parallel=False)
    assert len(calls) == 1
    assert problems == ["call 2: parallel_tool_calls is false, so only the first call is returned"]
    assert len(read_answer(two, [WEATHER])[1]) == 2


@pytest.mark.parametrize("size", [1, 2, 3, 5, 11])
def test_an_answer_fed_in_pieces_reads_as_the_whole_does(size):
    text = f"Sure.\n{ANSWER}\n<tool_call>\nnot json\n</tool_call>\nDone <tool"
    reader = CallReader([WEATHER])
    events = []
    for k in range(0, len(text), size):
        events += reader.feed(text[k : k + size])
    events += reader.finish()
    said = "".join(v for kind, v in events if kind == "text")
    whole, calls, problems = read_answer(text, [WEATHER])
    assert said.strip() == whole
    assert [v["function"] for kind, v in events if kind == "call"] == [c["function"] for c in calls]
    assert [v for kind, v in events if kind == "problem"] == problems


def test_json_nested_past_the_parsers_depth_is_a_problem_not_an_error():
    deep = "[" * 100_000
    text, calls, problems = read_answer(f"<tool_call>{deep}</tool_call>", [WEATHER])
    assert calls == []
    assert problems[0].startswith("call 1: not valid JSON")
    assert deep in text


def test_only_templates_that_write_hermes_blocks_have_their_calls_read():
    from types import SimpleNamespace

    from service.data.tools import reads_calls

    assert reads_calls(SimpleNamespace(chat_template="{{ messages }}"))  # the fallback
    qwen = "{% if tools %}<tools>{% endif %}{{ m.tool_calls }}<tool_call>"
    assert reads_calls(SimpleNamespace(chat_template=qwen))
    llama = "{% if tools %}{{ tools }}{% endif %}{{ m.tool_calls | tojson }}"
    assert not reads_calls(SimpleNamespace(chat_template=llama))


# -- response_format: answers decoded to a JSON schema ---------------------------------------

FRUIT = {
    "type": "object",
    "properties": {
        "fruit": {"type": "string", "enum": ["apple", "pear", "plum"]},
        "ripe": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["red", "green"]}, "maxItems": 2},
    },
    "required": ["fruit", "ripe"],
    "additionalProperties": False,
}


def test_even_an_untrained_model_answers_json_of_the_schema_asked_for(api):
    """The tiny base model writes noise unconstrained; with a schema every answer, greedy,
    sampled or streamed, is JSON that validates against it."""
    from jsonschema import ValidationError, validate

    fmt = {"type": "json_schema", "json_schema": {"name": "fruit", "schema": FRUIT}}
    kw = {"model": "tiny-llama", "messages": ASK, "max_tokens": 60, "response_format": fmt}
    client = api.client()
    answers = [client.chat.completions.create(**kw, temperature=0)]
    answers.append(client.chat.completions.create(**kw, temperature=1, seed=3, n=3))
    texts = [c.message.content for a in answers for c in a.choices]
    streamed = client.chat.completions.create(**kw, temperature=0, stream=True)
    texts.append("".join(c.choices[0].delta.content or "" for c in streamed if c.choices))
    assert texts[-1] == texts[0]
    for text in texts:
        validate(json.loads(text), FRUIT)
    assert all(c.finish_reason == "stop" for a in answers for c in a.choices)
    # unconstrained, the same model does not write that JSON
    free = client.chat.completions.create(model="tiny-llama", messages=ASK, max_tokens=60)
    with pytest.raises((json.JSONDecodeError, ValidationError)):
        validate(json.loads(free.choices[0].message.content), FRUIT)


def test_json_object_answers_an_object_when_it_ends(api):
    got = api.client().chat.completions.create(
        model="tiny-llama", messages=ASK, max_tokens=120, temperature=0,
        response_format={"type": "json_object"},
    )  # fmt: skip
    choice = got.choices[0]
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.message.content), dict)
    else:  # cut at max_tokens: still the start of an object
        assert choice.message.content.startswith("{")


@pytest.mark.parametrize(
    "fmt",
    [
        {"type": "xml"},
        {"type": "json_schema", "json_schema": {"schema": FRUIT}},  # no name
        {"type": "json_schema", "json_schema": {"name": "f", "schema": {"type": 5}}},
        {"type": "json_schema", "json_schema": {"name": "f", "schema": FRUIT}, "extra": 1},
    ],
)
def test_a_response_format_that_is_not_openais_is_a_400_naming_it(api, fmt):
    import httpx

    body = {"model": "tiny-llama", "messages": ASK, "max_tokens": 4, "response_format": fmt}
    r = httpx.post(f"{api.base}/chat/completions", headers=api.headers(), json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "response_format"


def test_response_format_with_tools_is_refused_and_without_them_the_tools_are_hidden(api):
    import openai

    fmt = {"type": "json_schema", "json_schema": {"name": "fruit", "schema": FRUIT}}
    with pytest.raises(openai.BadRequestError) as e:
        ask(api, tools=[WEATHER], response_format=fmt)
    assert e.value.body["param"] == "response_format"
    got = ask(api, tools=[WEATHER], tool_choice="none", response_format=fmt, max_tokens=60)
    assert json.loads(got.choices[0].message.content)["fruit"] in ("apple", "pear", "plum")
