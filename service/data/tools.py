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
import secrets
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
        except (ValueError, RecursionError):  # nested past the parser's depth
            return f"{at}.function.arguments is not valid JSON"
        if not isinstance(args, dict):
            return f"{at}.function.arguments must hold a JSON object"
    return None


class LegacyFunctionsError(ValueError):
    """A line in OpenAI's legacy function-calling form that cannot be read as tools."""


def from_legacy_functions(obj: dict[str, Any]) -> dict[str, Any]:
    """A chat line in OpenAI's legacy function-calling form (before `tools`: `functions`
    beside the messages, an assistant's `function_call`, `function` messages with the
    result) as the same line with tools: each function a tool, each call a tool call
    (`call_<n>`, in the order made), each result a `tool` message answering the latest
    call of its name. A line without those keys is returned as it is. Raises
    LegacyFunctionsError for a line mixing both forms, or a result no call asked for."""
    inp = obj.get("input")
    if isinstance(inp, dict) and "messages" in inp:  # a preference pair's prompt
        converted = from_legacy_functions(inp)
        obj = obj if converted is inp else {**obj, "input": converted}
    msgs = obj.get("messages")
    legacy_msgs = isinstance(msgs, list) and any(
        isinstance(m, dict) and ("function_call" in m or m.get("role") == "function") for m in msgs
    )
    if "functions" not in obj and not legacy_msgs:
        return obj
    if "tools" in obj:
        raise LegacyFunctionsError(
            "give 'tools' or the legacy 'functions', not both (functions are read as tools)"
        )
    out = {k: v for k, v in obj.items() if k != "functions"}
    if "functions" in obj:
        funcs = obj["functions"]
        if not isinstance(funcs, list) or not all(isinstance(f, dict) for f in funcs):
            raise LegacyFunctionsError("'functions' must be a list of function definitions")
        out["tools"] = [{"type": "function", "function": f} for f in funcs]
    if not legacy_msgs or not isinstance(msgs, list):
        return out
    made: dict[str, str] = {}  # a function's name -> the id of its latest call
    new: list[Any] = []
    calls = 0
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            new.append(m)
            continue
        m = dict(m)
        call = m.pop("function_call", None) if "function_call" in m else None
        if call is not None:
            if m.get("role") != "assistant" or "tool_calls" in m:
                raise LegacyFunctionsError(
                    f"messages[{i}].function_call: only an assistant message without "
                    "tool_calls makes a legacy function call"
                )
            if not (
                isinstance(call, dict)
                and isinstance(call.get("name"), str)
                and isinstance(call.get("arguments"), str)
            ):
                raise LegacyFunctionsError(
                    f"messages[{i}].function_call must be an object with the function's "
                    "'name' and its 'arguments' as a JSON string"
                )
            name = call["name"]
            calls += 1
            ident = f"call_{calls}"
            m["tool_calls"] = [{"id": ident, "type": "function", "function": call}]
            made[name] = ident
            if m.get("content") == "":
                m["content"] = None
        elif m.get("role") == "function":
            name = m.get("name")
            if not isinstance(name, str) or name not in made:
                raise LegacyFunctionsError(
                    f"messages[{i}]: a 'function' message answers a call an earlier "
                    f"assistant message made (its function_call.name); none called {name!r}"
                    if isinstance(name, str)
                    else f"messages[{i}].name must be the name of the function that answered"
                )
            m["role"], m["tool_call_id"] = "tool", made[name]
        new.append(m)
    out["messages"] = new
    return out


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


# ---------------------------------------------------------------------------------------
# Serving: tool_choice, and the calls read back from what the model wrote
# ---------------------------------------------------------------------------------------

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"


class ToolFormatError(ValueError):
    """A model whose chat template renders tools in a format serving does not read."""


def reads_calls(tokenizer: Any) -> bool:
    """Whether serving can read this model's calls back: the fallback format (no tool
    support in its template) or a native template that writes Hermes blocks (Qwen2.5's)."""
    template = getattr(tokenizer, "chat_template", None) or ""
    return not knows_tools(tokenizer) or CALL_OPEN in template


def choice_problem(tool_choice: Any, tools: list[dict] | None) -> str | None:
    """Why `tool_choice` is not one OpenAI takes for these `tools`, or None."""
    if tool_choice is None or tool_choice in ("none", "auto"):
        return None
    names = {t["function"]["name"] for t in tools or ()}
    if tool_choice == "required":
        return None if names else "tool_choice 'required' needs tools"
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    if (
        isinstance(fn, dict)
        and tool_choice == {"type": "function", "function": fn}
        and set(fn) == {"name"}
        and isinstance(fn["name"], str)
    ):
        name = fn["name"]
        return None if name in names else f"tool_choice names {name!r}, not one of the tools"
    return (
        'tool_choice must be "none", "auto", "required" or '
        '{"type": "function", "function": {"name": ...}}'
    )


# answers to a schema in one layout (OpenAI's spacing: ", " and ": "), not any whitespace
# the schema allows: a model is not free to spend its tokens on spaces
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def call_grammar(tools: list[dict], tool_choice: Any, parallel: bool = True) -> str | None:
    """The grammar (llguidance's Lark) an answer with tools is decoded to.

    - `tool_choice` "required" or a named function: one `<tool_call>` block whose JSON
      names one of the tools (or the named one), with arguments of that tool's parameters.
    - `auto` (or none given): the model is free to answer in text, but a `<tool_call>` it
      opens is decoded as a call of one of the tools, as the forced one is: either text
      that holds no `<tool_call>`, or text (maybe none) then call blocks, one per line
      (one only when `parallel` is false), and nothing after them. The text before the
      first block is a lazy rule ended by the tag (llguidance's `suffix`): a greedy
      lexeme would read the tag's first bytes as more text.
    - "none": None (the tools are not shown)."""
    if tool_choice == "required" or isinstance(tool_choice, dict):
        chosen = tools
        if isinstance(tool_choice, dict):
            name = tool_choice["function"]["name"]
            chosen = [t for t in tools if t["function"]["name"] == name]
        body = f'"{CALL_OPEN}\\n" call "\\n{CALL_CLOSE}"'
        return f"start: {body}\ncall: %json {json.dumps(_calls_schema(chosen))}"
    if tool_choice not in (None, "auto"):
        return None
    more = f' ("\\n{CALL_OPEN}\\n" call "\\n{CALL_CLOSE}")*' if parallel else ""
    not_a_call = f"/(.|\\n)*/ & ~/(.|\\n)*{CALL_OPEN}(.|\\n)*/"
    return "\n".join(
        [
            "start: TEXT | before calls",
            f"TEXT: {not_a_call}",
            f'before[suffix="{CALL_OPEN}", lazy]: /(.|\\n)*/',
            f'calls: "\\n" call "\\n{CALL_CLOSE}"{more}',
            f"call: %json {json.dumps(_calls_schema(tools))}",
        ]
    )


def _calls_schema(chosen: list[dict]) -> dict[str, Any]:
    """The JSON of one call of one of `chosen` (name and arguments), in one layout."""
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"const": t["function"]["name"]},
                "arguments": t["function"].get("parameters") or {"type": "object"},
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in chosen
    ]
    return {"x-guidance": JSON_LAYOUT, "anyOf": calls}


def json_schema_problem(schema: Any) -> str | None:
    """Why `schema` is not a JSON schema (Draft 2020-12 unless it says which), or None."""
    from jsonschema import SchemaError, validators

    if not isinstance(schema, dict):
        return "it must be a JSON object"
    try:
        validators.validator_for(schema).check_schema(schema)
    except SchemaError as e:
        return e.message
    except RecursionError:
        return "it is nested too deep"
    return None


def schema_problem(tools: list[dict]) -> str | None:
    """Why a tool's `parameters` is not a JSON schema, or None."""
    for k, tool in enumerate(tools):
        schema = tool["function"].get("parameters")
        if schema is not None and (why := json_schema_problem(schema)):
            return f"tools[{k}].function.parameters is not a JSON schema: {why}"
    return None


class CallReader:
    """Reads a model's answer as it arrives: its text, and each `<tool_call>` block,
    checked, as a call (`(kind, value)` events: ("text", str), ("call", {"id", "type",
    "function": {"name", "arguments"}}) or ("problem", str)). A block that is not JSON,
    names no declared tool, or whose arguments do not match the tool's parameters is a
    problem, and its text stays in the answer's text: never passed on as a call. With
    `parallel` false a call after the first is a problem too. Whitespace waits until
    text follows it, so the space around calls is not text. Fed the whole answer at once
    or in pieces, it gives the same events' text, calls and problems."""

    def __init__(self, tools: list[dict], parallel: bool = True) -> None:
        self.tools = {t["function"]["name"]: t["function"] for t in tools}
        self.parallel = parallel
        self.calls = 0
        self._buf = ""
        self._inside = False
        self._space = ""  # whitespace held until text follows it

    def feed(self, text: str) -> list[tuple[str, Any]]:
        self._buf += text
        out: list[tuple[str, Any]] = []
        while True:
            if self._inside:
                end = self._buf.find(CALL_CLOSE)
                if end < 0:
                    return out
                block, self._buf = self._buf[:end], self._buf[end + len(CALL_CLOSE) :]
                self._inside = False
                out += self._block(block, closed=True)
                continue
            start = self._buf.find(CALL_OPEN)
            if start >= 0:
                out += self._text(self._buf[:start])
                self._buf = self._buf[start + len(CALL_OPEN) :]
                self._inside = True
                continue
            keep = _partial_open(self._buf)  # may be the start of a call's tag
            out += self._text(self._buf[: len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep :]
            return out

    def finish(self) -> list[tuple[str, Any]]:
        """The end of the answer: a block left open is read as if closed."""
        out = self._block(self._buf, closed=False) if self._inside else self._text(self._buf)
        self._buf, self._inside = "", False
        if not self.calls and self._space:
            out.append(("text", self._space))
        self._space = ""
        return out

    def _text(self, text: str) -> list[tuple[str, Any]]:
        said = text.rstrip()
        if not said:
            self._space += text
            return []
        held, self._space = self._space, text[len(said) :]  # trailing space waits too
        return [("text", held + said)]

    def _block(self, block: str, closed: bool) -> list[tuple[str, Any]]:
        raw = f"{CALL_OPEN}{block}{CALL_CLOSE if closed else ''}"
        n = self.calls + 1
        why = self._problem(block)
        if why is None and not self.parallel and self.calls:
            why = f"call {n}: parallel_tool_calls is false, so only the first call is returned"
            return [("problem", why)]
        if why is not None:
            return [("problem", f"call {n}: {why}"), *self._text(raw)]
        body = json.loads(block)
        args = body["arguments"]
        if isinstance(args, str):
            args = json.loads(args)
        self.calls += 1
        self._space = ""
        call = {
            "id": f"call_{secrets.token_hex(12)}",
            "type": "function",
            "function": {"name": body["name"], "arguments": json.dumps(args, ensure_ascii=False)},
        }
        return [("call", call)]

    def _problem(self, block: str) -> str | None:
        try:
            body = json.loads(block)
        except RecursionError:
            return "not valid JSON (nested too deep)"
        except ValueError as e:
            return f"not valid JSON ({e})"
        if not isinstance(body, dict) or not isinstance(body.get("name"), str):
            return 'not a JSON object with a "name" and "arguments"'
        fn = self.tools.get(body["name"])
        if fn is None:
            return f"{body['name']!r} is not one of the tools"
        args = body.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except (ValueError, RecursionError):
                return "arguments are not valid JSON"
        if not isinstance(args, dict):
            return "arguments are not a JSON object"
        schema = fn.get("parameters")
        if schema:
            from jsonschema import validators

            errors = sorted(validators.validator_for(schema)(schema).iter_errors(args), key=str)
            if errors:
                where = "/".join(str(p) for p in errors[0].absolute_path) or "arguments"
                return f"arguments do not match {body['name']}'s parameters: {where}: " + (
                    errors[0].message
                )
        return None


def _partial_open(text: str) -> int:
    """How many of `text`'s last characters could begin `<tool_call>`."""
    for k in range(min(len(CALL_OPEN) - 1, len(text)), 0, -1):
        if CALL_OPEN.startswith(text[-k:]):
            return k
    return 0


def read_answer(text: str, tools: list[dict], parallel: bool = True) -> tuple[str, list, list]:
    """(text, calls, problems) of a whole answer, as `CallReader` reads it."""
    reader = CallReader(tools, parallel)
    events = reader.feed(text) + reader.finish()
    said = "".join(v for k, v in events if k == "text")
    return (
        said.strip() if reader.calls else said,
        [v for k, v in events if k == "call"],
        [v for k, v in events if k == "problem"],
    )
