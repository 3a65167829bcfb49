"""Files in each of OpenAI's documented fine-tuning formats, in the shapes its guides show
(the lines' words are ours), through the unmodified `openai` SDK: each uploads as its
format and trains a job of its method here; and a model fine-tuned by a job on
function-calling lines answers a training prompt with the call it learned, whole and
streamed."""

from __future__ import annotations

import io
import json
import math

import pytest

from tests.api.conftest import api_in_process, run_job

FIND_BOOK = {
    "name": "find_book",
    "description": "Look a book up in the library's catalogue",
    "parameters": {
        "type": "object",
        "properties": {"title": {"type": "string", "description": "the book's title"}},
        "required": ["title"],
    },
}
TOOLS = [{"type": "function", "function": FIND_BOOK}]
MODEL = "tiny-llama-1k"
STEPS_TO_LEARN = 80
ASK = "Is Middlemarch on the shelves?"
ASKED = {"role": "user", "content": ASK}
ARGS = json.dumps({"title": "Middlemarch"})
CALL = {"id": "call_1", "type": "function", "function": {"name": "find_book", "arguments": ARGS}}

# OpenAI's chat format: a system prompt, a question, the answer to learn
CHAT = {
    "messages": [
        {"role": "system", "content": "Quill answers in one short sentence, dryly."},
        {"role": "user", "content": "What is the capital of Peru?"},
        {"role": "assistant", "content": "Lima, last time anyone looked."},
    ]
}
# multi-turn, with an earlier answer left out of the loss (`weight: 0`)
WEIGHTED = {
    "messages": [
        {"role": "system", "content": "Quill answers in one short sentence, dryly."},
        {"role": "user", "content": "How far is the Moon?"},
        {"role": "assistant", "content": "Far.", "weight": 0},
        {"role": "user", "content": "How far, in kilometres?"},
        {"role": "assistant", "content": "About 384,400 of them.", "weight": 1},
    ]
}
# content as a list of text parts
PARTS = {
    "messages": [
        {"role": "user", "content": [{"type": "text", "text": "Name a prime number."}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Seven."}]},
    ]
}
# function calling: the tools, the assistant's call, the tool's result, the final answer
TOOL_ROUND = {
    "messages": [
        {"role": "user", "content": ASK},
        {"role": "assistant", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"copies": 2, "shelf": "F-12"}'},
        {"role": "assistant", "content": "Yes: two copies, on shelf F-12."},
    ],
    "tools": TOOLS,
    "parallel_tool_calls": False,
}
CALL_ONLY = {
    "messages": [{"role": "user", "content": ASK}, {"role": "assistant", "tool_calls": [CALL]}],
    "tools": TOOLS,
}
# the legacy function-calling form OpenAI documented before tools
LEGACY = {
    "messages": [
        {"role": "user", "content": ASK},
        {"role": "assistant", "function_call": {"name": "find_book", "arguments": ARGS}},
        {"role": "function", "name": "find_book", "content": '{"copies": 0}'},
        {"role": "assistant", "content": "Not today: every copy is out."},
    ],
    "functions": [FIND_BOOK],
}
# preference pairs (DPO), with tools in the input
PREFERENCE = {
    "input": {"messages": [{"role": "user", "content": ASK}], "tools": TOOLS},
    "preferred_output": [{"role": "assistant", "tool_calls": [CALL]}],
    "non_preferred_output": [{"role": "assistant", "content": "I could not say."}],
}
# reinforcement prompts: the messages end before the answer; the rest is the grader's item
PROMPT = {
    "messages": [{"role": "user", "content": "Spell the number 7 as a word."}],
    "reference_answer": "seven",
}
GRADER = {
    "type": "string_check", "name": "spelled", "operation": "ilike",
    "input": "{{sample.output_text}}", "reference": "{{item.reference_answer}}",
}  # fmt: skip

FORMATS = {
    # name: (lines, the format the upload says, the method that trains on it)
    "chat": ([CHAT, WEIGHTED], "chat", {"type": "supervised"}),
    "text parts": ([PARTS, CHAT], "chat", {"type": "supervised"}),
    "function calling": ([TOOL_ROUND, CALL_ONLY], "chat", {"type": "supervised"}),
    "legacy functions": ([LEGACY, CHAT], "chat", {"type": "supervised"}),
    "preference": ([PREFERENCE], "preference", {"type": "dpo"}),
    "reinforcement": (
        [PROMPT],
        "prompts",
        {
            "type": "reinforcement",
            "reinforcement": {
                "grader": GRADER,
                "hyperparameters": {"group_size": 2, "max_completion_tokens": 4},
            },
        },
    ),
}


def jsonl(lines: list[dict], times: int = 1) -> bytes:
    return ("\n".join(json.dumps(x) for x in lines * times) + "\n").encode()


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    from tests.tiny import make_tiny_llama

    with api_in_process(tmp_path_factory, "formats") as server:
        # a context long enough for the tools' prompt (the fallback's header is long)
        make_tiny_llama(server.settings.models_dir / MODEL, context=1024)
        yield server


@pytest.mark.parametrize("name", list(FORMATS))
def test_each_documented_format_uploads_as_itself_and_trains_its_method(api, name):
    lines, fmt, method = FORMATS[name]
    c = api.client()
    f = c.files.create(file=(f"{name}.jsonl", io.BytesIO(jsonl(lines, 5))), purpose="fine-tune")
    assert (f.status, f.model_extra["format"]) == ("processed", fmt)
    assert f.model_extra["examples"] == 5 * len(lines)
    kind = method["type"]
    section = method.get(kind, {})
    hp = {
        "batch_size": 2,
        "n_epochs": 1,
        "max_steps": 2,
        "seq_len": 1024,
        **section.get("hyperparameters", {}),
    }
    job = c.fine_tuning.jobs.create(
        model=MODEL,
        training_file=f.id,
        method={"type": kind, kind: {**section, "hyperparameters": hp}},
        extra_body={"engine": {"dtype": "fp32"}},
    )
    series = run_job(api, job.id)
    assert 1 <= len(series["train_loss"]["values"]) <= 2  # (packed rows: maybe one step)
    assert all(math.isfinite(v) for v in series["train_loss"]["values"])


def test_legacy_function_lines_are_read_as_the_same_lines_with_tools():
    from service.data.datasets import classify
    from service.data.tools import from_legacy_functions

    assert classify(LEGACY) == ("chat", None)
    as_tools = {
        "messages": [
            LEGACY["messages"][0],
            {"role": "assistant", "tool_calls": [CALL]},
            {"role": "tool", "name": "find_book", "tool_call_id": "call_1",
             "content": '{"copies": 0}'},
            LEGACY["messages"][3],
        ],
        "tools": TOOLS,
    }  # fmt: skip
    assert from_legacy_functions(LEGACY) == as_tools
    assert classify({**LEGACY, "tools": TOOLS})[1] == (
        "give 'tools' or the legacy 'functions', not both (functions are read as tools)"
    )
    stray = {**LEGACY, "messages": [LEGACY["messages"][0], LEGACY["messages"][2]]}
    assert "none called 'find_book'" in classify(stray)[1]


def test_a_model_fine_tuned_on_function_calling_lines_answers_with_the_call_it_learned(api):
    from service.control.driver import finish_success

    c = api.client()
    data = jsonl([CALL_ONLY], 8)
    f = c.files.create(file=("calls.jsonl", io.BytesIO(data)), purpose="fine-tune")
    hp = {"batch_size": 4, "n_epochs": 50, "max_steps": STEPS_TO_LEARN, "seq_len": 1024,
          "packing": False}  # fmt: skip
    job = c.fine_tuning.jobs.create(
        model=MODEL,
        training_file=f.id,
        seed=0,
        method={"type": "supervised", "supervised": {"hyperparameters": hp}},
        extra_body={"engine": {"dtype": "fp32", "optimizer": {"lr": 3e-3}}},
    )
    losses = run_job(api, job.id)["train_loss"]["values"]
    finish_success(
        api.settings, api.store, api.store.jobs.get(job.id), api.store.jobs.get(job.id).attempt
    )
    done = c.fine_tuning.jobs.retrieve(job.id)
    assert done.fine_tuned_model, losses
    ask = {"model": done.fine_tuned_model, "messages": [{"role": "user", "content": ASK}],
           "tools": TOOLS, "temperature": 0, "max_tokens": 120}  # fmt: skip
    choice = c.chat.completions.create(**ask).choices[0]
    assert choice.finish_reason == "tool_calls", (choice, losses[-5:])
    (call,) = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "find_book",
        json.loads(ARGS),
    )
    streamed = [
        d.tool_calls[0] for ch in c.chat.completions.create(**ask, stream=True)
        if ch.choices and (d := ch.choices[0].delta).tool_calls
    ]  # fmt: skip
    assert [(t.function.name, t.function.arguments) for t in streamed] == [
        (call.function.name, call.function.arguments)
    ]


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"functions": {"name": "find_book"}}, "'functions' must be a list of function"),
        ({"messages": [ASKED, {"role": "assistant", "function_call": "find_book"}]},
         "messages[1].function_call must be an object"),
        ({"messages": [*LEGACY["messages"][:2], {"role": "function", "name": ["x"]}]},
         "messages[2].name must be the name of the function that answered"),
    ],
    ids=["functions-not-a-list", "call-not-an-object", "name-not-a-string"],
)  # fmt: skip
def test_malformed_legacy_function_lines_are_refused_saying_what_is_wrong(change, says):
    from service.data.datasets import classify

    fmt, why = classify({**LEGACY, **change})
    assert fmt is None
    assert says in why


def test_a_preference_pairs_legacy_functions_are_its_tools():
    from service.data.datasets import classify

    legacy = {**PREFERENCE, "input": {"messages": [{"role": "user", "content": ASK}],
                                      "functions": [FIND_BOOK]}}  # fmt: skip
    assert classify(legacy) == ("preference", None)
