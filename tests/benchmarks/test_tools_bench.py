"""`pstar bench tools`'s data and scoring, without the job (the benchmark fine-tunes a real
model for minutes; its figures are in docs/serving.md): its lines are OpenAI
function-calling lines the upload takes as chat, and an answer is right only as the one
call with the asked word."""

from __future__ import annotations

import json

from benchmarks.tools import TOOLS, asks, lines, score
from service.data.datasets import classify


def test_the_lines_are_function_calling_chat_examples_with_one_call_each():
    items = asks(["apple", "river", "stone"], seed=0)
    assert {fn for _, _, fn in asks([f"w{i}" for i in range(40)], 0)} == {
        "lookup_definition", "find_synonyms",
    }  # fmt: skip
    for line, (word, ask, fn) in zip(lines(items).decode().splitlines(), items, strict=True):
        obj = json.loads(line)
        assert classify(obj) == ("chat", None)
        assert obj["tools"] == TOOLS
        assert obj["messages"][0]["content"] == ask
        (call,) = obj["messages"][1]["tool_calls"]
        assert call["function"]["name"] == fn
        assert json.loads(call["function"]["arguments"]) == {"word": word}


def call(name: str, arguments: str) -> dict:
    return {"id": "c", "type": "function", "function": {"name": name, "arguments": arguments}}


def test_an_answer_is_right_only_as_the_one_call_with_the_word():
    right = {"tool_calls": [call("find_synonyms", '{"word": "apple"}')]}
    assert score(right, "apple", "find_synonyms") == {"called": True, "named": True, "right": True}
    cases = {
        "text": {"content": "apple means a fruit", "tool_calls": None},
        "wrong function": {"tool_calls": [call("lookup_definition", '{"word": "apple"}')]},
        "wrong word": {"tool_calls": [call("find_synonyms", '{"word": "pear"}')]},
        "extra argument": {"tool_calls": [call("find_synonyms", '{"word": "apple", "n": 2}')]},
        "not JSON": {"tool_calls": [call("find_synonyms", "{word: apple}")]},
        "two calls": {"tool_calls": [call("find_synonyms", '{"word": "apple"}')] * 2},
    }
    got = {k: score(m, "apple", "find_synonyms") for k, m in cases.items()}
    assert not any(g["right"] for g in got.values())
    assert got["text"] == {"called": False, "named": False, "right": False}
    assert got["wrong word"]["named"]
    assert got["not JSON"]["named"]
