"""Function calling in training files, as OpenAI's chat format has it: a line's `tools`
(and `parallel_tool_calls`), assistant messages with `tool_calls`, and `tool` messages
answering them by `tool_call_id`; and how such a conversation becomes text to train on.

Rendering. A chat template that knows tools (one that reads both `tools` and
`tool_calls`, as Qwen's, Llama 3.1's and Mistral's do) gets them as transformers passes
them: `tools=` as the line gives them, each call's `arguments` as an object. A template
that does not (ChatML, SmolLM2's) gets the conversation in this fallback, the Hermes
format Qwen2.5 also uses, with plain system, user and assistant turns:

- the tools go at the end of the system message (one is added first when the line has
  none): `TOOLS_HEADER`, then one JSON object per tool inside <tools></tools>, then how
  to call one;
- an assistant's calls follow its text, one `<tool_call>{"name": ..., "arguments": ...}
  </tool_call>` block each;
- a tool's result is a user turn: `<tool_response>...</tool_response>`.

The loss covers an assistant message's calls as it covers its text. Serving reads calls
back from the same blocks.
"""

from __future__ import annotations

import json
import re
from typing import Any

MAX_TOOLS = 128
FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
TOOLS_HEADER = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_FOOTER = (
    "</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


def tools_problem(tools: Any, where: str = "tools") -> str | None:
    """Why a line's `tools` (at `where`) is not OpenAI's list of function tools, or None."""
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        return f"{where} must be a list of at most {MAX_TOOLS} function tools"
    names = set()
    for k, tool in enumerate(tools):
        at = f"{where}[{k}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            return f'{at} must be {{"type": "function", "function": {{...}}}}'
        if set(tool) - {"type", "function"}:
            return f"{at} has unknown key(s) {sorted(set(tool) - {'type', 'function'})}"
        fn = tool.get("function")
        if not isinstance(fn, dict):
            return f"{at}.function must be an object with a 'name'"
        extra = set(fn) - {"name", "description", "parameters", "strict"}
        if extra:
            return f"{at}.function has unknown key(s) {sorted(extra)}"
        name = fn.get("name")
        if not isinstance(name, str) or not FUNCTION_NAME.match(name):
            return f"{at}.function.name must be 1 to 64 letters, digits, '_' or '-'"
        if name in names:
            return f"{at}.function.name {name!r} is declared twice"
        names.add(name)
        if "description" in fn and not isinstance(fn["description"], str):
            return f"{at}.function.description must be a string"
        if "parameters" in fn and not isinstance(fn["parameters"], dict):
            return f"{at}.function.parameters must be a JSON schema object"
        if "strict" in fn and not isinstance(fn["strict"], bool):
            return f"{at}.function.strict must be true or false"
    return None


def tool_calls_problem(calls: Any, where: str, declared: set[str] | None) -> str | None:
    """Why an assistant message's `tool_calls` is not OpenAI's, or None; `declared`: the
    line's tool names (None: the line declares no tools, so any name goes)."""
    if not isinstance(calls, list) or not calls:
        return f"{where} must be a non-empty list of calls"
    for k, call in enumerate(calls):
        at = f"{where}[{k}]"
        if not isinstance(call, dict) or call.get("type", "function") != "function":
            return f'{at} must be {{"id": ..., "type": "function", "function": {{...}}}}'
        if set(call) - {"id", "type", "function"}:
            return f"{at} has unknown key(s) {sorted(set(call) - {'id', 'type', 'function'})}"
        if not isinstance(call.get("id"), str) or not call["id"]:
            return f"{at}.id must be a non-empty string (tool messages answer it by this id)"
        fn = call.get("function")
        if not isinstance(fn, dict) or set(fn) - {"name", "arguments"}:
            return f"{at}.function must be an object with 'name' and 'arguments' only"
        name = fn.get("name")
        if not isinstance(name, str) or not FUNCTION_NAME.match(name):
            return f"{at}.function.name must be 1 to 64 letters, digits, '_' or '-'"
        if declared is not None and name not in declared:
            return f"{at}.function.name {name!r} is not one of the line's tools"
        if not isinstance(fn.get("arguments"), str):
            return f"{at}.function.arguments must be a string holding a JSON object"
        try:
            args = json.loads(fn["arguments"])
        except ValueError:
            return f"{at}.function.arguments is not valid JSON"
        if not isinstance(args, dict):
            return f"{at}.function.arguments must hold a JSON object"
    return None


def knows_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template renders tools itself."""
    template = getattr(tokenizer, "chat_template", None) or ""
    return isinstance(template, str) and "tools" in template and "tool_calls" in template


def template_messages(
    tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict] | None, text: Any
) -> tuple[list[dict[str, Any]], list[dict] | None]:
    """(messages, tools) to give `apply_chat_template` for a conversation of the line's
    `messages` and `tools`; `text(content)` is a message's content as a string. Only the
    fallback may add a message, and only first (a system message to hold the tools)."""
    native = knows_tools(tokenizer)
    out: list[dict[str, Any]] = []
    for m in messages:
        content = text(m["content"]) if m.get("content") is not None else ""
        calls = m.get("tool_calls")
        if native:
            msg: dict[str, Any] = {"role": m["role"], "content": content}
            if calls:
                msg["tool_calls"] = [_hf_call(c) for c in calls]
            if m["role"] == "tool":
                msg["tool_call_id"] = m["tool_call_id"]
            out.append(msg)
        elif m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"})
        else:
            blocks = [_call_block(c) for c in calls or ()]
            out.append({"role": m["role"], "content": "\n".join([content, *blocks]).strip("\n")})
    if native or not tools:
        return out, (tools or None) if native else None
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    block = f"{TOOLS_HEADER}\n{listed}\n{TOOLS_FOOTER}"
    if out and out[0]["role"] in ("system", "developer"):
        out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{block}".lstrip("\n")}
    else:
        out.insert(0, {"role": "system", "content": block})
    return out, None


def _hf_call(call: dict[str, Any]) -> dict[str, Any]:
    fn = call["function"]
    return {
        "id": call["id"],
        "type": "function",
        "function": {"name": fn["name"], "arguments": json.loads(fn["arguments"])},
    }


def _call_block(call: dict[str, Any]) -> str:
    fn = call["function"]
    body = {"name": fn["name"], "arguments": json.loads(fn["arguments"])}
    return f"<tool_call>\n{json.dumps(body, ensure_ascii=False)}\n</tool_call>"
