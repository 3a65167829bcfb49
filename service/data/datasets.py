"""Training data of a fine-tuning job: per-line validation, tokenization, loss masks.

Four formats, decided by the first line of a file (every other line must match it):

- `chat`: `{"messages": [{"role": "user", "content": ...}, {"role": "assistant", ...}]}`;
  the loss is on assistant messages (their content and end-of-turn token);
- `completion`: `{"prompt": ..., "completion": ...}`; the loss is on the completion and EOS;
- `text`: `{"text": ...}` lines, or a plain UTF-8 text file (one document per line); the
  loss is on every token;
- `preference`: `{"input": {"messages": [...]}, "preferred_output": [assistant message],
  "non_preferred_output": [assistant message]}`, pairs for DPO (`service.data.preference`);
- `prompts`: `{"messages": [... ending in a user or developer message], <any other keys>}`,
  the prompts of reinforcement fine-tuning (OpenAI's format): the model answers each, and
  the line's other keys are the item its grader sees (`{{item.<key>}}`). No loss mask: the
  answers are the model's own (`service.methods.reinforcement`).

Chat examples are rendered with the base model's own chat template (a ChatML template
when the tokenizer has none); an assistant message with `"weight": 0` is shown to the
model but not trained on, as in OpenAI's format. Which tokens count is decided on
characters: each assistant message spans from the end of the prompt that asks for it
(`add_generation_prompt=True`) to the end of the conversation rendered through it, and a
token is trained on when its first character lies in such a span. (Where that rendering
departs from the whole conversation's, as when a template puts EOS only at the very end,
the span ends there and a token must lie wholly inside it.)

Batches: one example per row, right-padded to `seq_len` (longer examples are truncated
and counted); padded and untrained positions get label -100, which the loss ignores. With
right padding and causal attention, real tokens never attend to pads, so no attention mask
is needed and every batch has the same shape (the warm-up trace stays valid). Packed
rows (`service.data.packing`) hold several examples each, with positions that restart at every
example. Text data is instead concatenated (EOS between documents) and cut into full
`seq_len` rows.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from service.data.tools import (
    LegacyFunctionsError,
    from_legacy_functions,
    template_messages,
    tool_calls_problem,
    tools_problem,
)

IGNORE = -100
FORMATS = ("chat", "completion", "text", "preference", "prompts")
# a preference pair (DPO), OpenAI's format: the prompt and two answers, the first preferred
PREFERRED, NON_PREFERRED = "preferred_output", "non_preferred_output"
PREFERENCE_KEYS = ("input", PREFERRED, NON_PREFERRED)
ROLES = ("system", "developer", "user", "assistant")
CHAT_ROLES = (*ROLES, "tool")  # a tool's result, answering an assistant's call
MAX_LINE_BYTES = 16 << 20
MAX_REPORTED_ERRORS = 20
CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class DataError(ValueError):
    """A training or validation file cannot be used; the message says which line and why."""


@dataclass
class LineError:
    line: int
    reason: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.reason}"


@dataclass
class FileCheck:
    """What validating a file found: its format, counts and the bad lines."""

    format: str | None = None
    lines: int = 0
    examples: int = 0
    errors: list[LineError] = field(default_factory=list)
    error_count: int = 0

    @property
    def ok(self) -> bool:
        return self.error_count == 0 and self.examples > 0

    def summary(self) -> str:
        if self.examples == 0 and self.error_count == 0:
            return "the file holds no examples"
        shown = "; ".join(str(e) for e in self.errors)
        more = self.error_count - len(self.errors)
        return f"{self.error_count} bad line(s): {shown}" + (f"; and {more} more" if more else "")


class LineValidator:
    """Checks a JSONL (or plain text) file line by line as it streams in."""

    def __init__(self) -> None:
        self.check = FileCheck()
        self._plain: bool | None = None  # decided by the first non-empty line, once

    def feed(self, raw: bytes) -> None:
        c = self.check
        c.lines += 1
        n = c.lines
        if len(raw) > MAX_LINE_BYTES:
            self._error(n, f"longer than {MAX_LINE_BYTES >> 20} MiB")
            return
        try:
            line = decode_line(raw, first=n == 1)
        except UnicodeDecodeError as e:
            self._error(n, f"not UTF-8 (byte {e.start})")
            return
        if not line.strip():
            return
        if self._plain is None:
            # a plain text file (every non-empty line a document) unless it opens with a
            # JSON object; later lines never switch a JSONL file to plain text
            self._plain = not line.lstrip().startswith("{")
            if self._plain:
                c.format = "text"
        if self._plain:
            c.examples += 1
            return
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            self._error(n, f"not valid JSON ({e.msg} at column {e.colno})")
            return
        except RecursionError:  # Python's parser recurses once per level of nesting
            self._error(n, "nested too deeply (no training example is more than a few levels)")
            return
        fmt, reason = classify(obj)
        if reason:
            self._error(n, reason)
            return
        if c.format is None:
            c.format = fmt
        elif fmt != c.format:
            self._error(
                n, f"a {fmt} example in a file of {c.format} examples (from the first line)"
            )
            return
        c.examples += 1

    def _error(self, line: int, reason: str) -> None:
        self.check.error_count += 1
        if len(self.check.errors) < MAX_REPORTED_ERRORS:
            self.check.errors.append(LineError(line, reason))


def classify(obj: Any) -> tuple[str | None, str | None]:
    """(format, None) for a valid example, (None, reason) otherwise."""
    if not isinstance(obj, dict):
        return None, f"expected a JSON object, got {type(obj).__name__}"
    try:
        obj = from_legacy_functions(obj)
    except LegacyFunctionsError as e:
        return None, str(e)
    if "messages" in obj:
        if _is_prompt(obj):
            return "prompts", _check_prompt(obj)
        return "chat", _check_chat(obj)
    if PREFERRED in obj or NON_PREFERRED in obj:
        return "preference", _check_preference(obj)
    if "prompt" in obj or "completion" in obj:
        return "completion", _check_completion(obj)
    if "text" in obj:
        extra = set(obj) - {"text"}
        if extra:
            return None, f"unknown key(s) {sorted(extra)} beside 'text'"
        if not isinstance(obj["text"], str) or not obj["text"].strip():
            return None, "'text' must be a non-empty string"
        return "text", None
    return None, (
        "expected 'messages' (chat), 'prompt' and 'completion', 'text', or 'input' with "
        "'preferred_output' and 'non_preferred_output' (preference pairs for DPO)"
    )


def _check_chat(obj: dict[str, Any]) -> str | None:
    extra = set(obj) - {"messages", "tools", "parallel_tool_calls"}
    if extra:
        return (
            f"unknown key(s) {sorted(extra)} beside 'messages', 'tools', 'parallel_tool_calls' "
            "(a reinforcement prompt's item has keys of its own, and its messages end before "
            "the answer)"
        )
    problem, declared = _check_tools(obj, "")
    if problem:
        return problem
    msgs = obj["messages"]
    if not isinstance(msgs, list) or not msgs:
        return "'messages' must be a non-empty list"
    problem, trained = _check_messages(msgs, "messages", declared, weights=True)
    if problem:
        return problem
    if trained == 0:
        return "no assistant message to train on (need one with weight 1)"
    return None


def _is_prompt(obj: dict[str, Any]) -> bool:
    """A reinforcement prompt: messages that end before the answer (the last one is a
    user's, developer's or system's); its other keys are the grader's item."""
    msgs = obj["messages"]
    last = msgs[-1] if isinstance(msgs, list) and msgs else None
    return isinstance(last, dict) and last.get("role") in ("user", "developer", "system")


def _check_prompt(obj: dict[str, Any]) -> str | None:
    # `_is_prompt` saw a non-empty list of messages, the last an object
    problem, declared = _check_tools(obj, "")
    if problem:
        return problem
    problem, _ = _check_messages(obj["messages"], "messages", declared, weights=False)
    return problem


def prompt_item(ex: dict[str, Any]) -> dict[str, Any]:
    """What a reinforcement prompt's grader sees as `item`: the line's keys beside the
    messages (OpenAI's `{{item.*}}`)."""
    return {k: v for k, v in ex.items() if k not in ("messages", "tools", "parallel_tool_calls")}


def _check_tools(obj: dict[str, Any], at: str) -> tuple[str | None, set[str] | None]:
    """(why the `tools` and `parallel_tool_calls` beside messages are wrong, or None; the
    declared tool names, or None when there are no tools)."""
    if "parallel_tool_calls" in obj and not isinstance(obj["parallel_tool_calls"], bool):
        return f"{at}parallel_tool_calls must be true or false", None
    if "tools" not in obj:
        return None, None
    if problem := tools_problem(obj["tools"], f"{at}tools"):
        return problem, None
    return None, {t["function"]["name"] for t in obj["tools"]}


def _check_messages(
    msgs: list, where: str, declared: set[str] | None, weights: bool
) -> tuple[str | None, int]:
    """(why the messages are wrong or None, how many assistant messages train): roles,
    content, assistant `tool_calls` and the `tool` messages that answer them by id."""
    trained = 0
    called: set[str] = set()
    for i, m in enumerate(msgs):
        at = f"{where}[{i}]"
        if not isinstance(m, dict):
            return f"{at} must be an object", 0
        role = m.get("role")
        if role not in CHAT_ROLES:
            return f"{at}.role must be one of {', '.join(CHAT_ROLES)}, got {role!r}", 0
        calls = m.get("tool_calls") if role == "assistant" else None
        if calls is not None:
            if problem := tool_calls_problem(calls, f"{at}.tool_calls", declared):
                return problem, 0
            called |= {c["id"] for c in calls}
        no_text = calls is not None and m.get("content") is None  # calls only: allowed
        if not no_text and (problem := content_problem(m.get("content"), f"{at}.content")):
            return problem, 0
        allowed = {"role", "content", "name"} | ({"weight"} if weights else set())
        allowed |= {"tool_calls"} if role == "assistant" else set()
        allowed |= {"tool_call_id"} if role == "tool" else set()
        if extra := set(m) - allowed:
            return f"{at} has unknown key(s) {sorted(extra)}", 0
        if role == "tool" and m.get("tool_call_id") not in called:
            return (
                f"{at}.tool_call_id must be the id of a call an earlier assistant message "
                "made (its tool_calls[].id)"
            ), 0
        if "weight" in m and (
            role != "assistant" or m["weight"] not in (0, 1) or isinstance(m["weight"], bool)
        ):
            return f"{at}.weight must be 0 or 1, on assistant messages only", 0
        if role == "assistant" and m.get("weight", 1) == 1:
            if not calls and not content_text(m["content"]):
                return f"{at}: an assistant message to train on needs content or tool_calls", 0
            trained += 1
    return None, trained


# a content part OpenAI's chat format allows that no model here reads
MEDIA_PARTS = ("image_url", "input_image", "image", "input_audio", "file")


def content_problem(content: Any, where: str) -> str | None:
    """Why `content` is not a message's content: OpenAI's chat format takes a string or a
    list of text parts ({"type": "text", "text": ...}); images and audio are refused."""
    if isinstance(content, str):
        return None
    if not isinstance(content, list):
        return f"{where} must be a string or a list of text parts"
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in MEDIA_PARTS:
            return (
                f"{where}[{j}] is an {kind!r} part: vision and audio models are not trained or "
                "served here; keep the text parts only"
            )
        if kind != "text" or not isinstance(part.get("text"), str) or set(part) - {"type", "text"}:
            return f'{where}[{j}] must be a text part: {{"type": "text", "text": "..."}}'
    return None


def content_text(content: str | list[dict[str, str]]) -> str:
    """A message's content as one string: its text parts joined (content_problem passed)."""
    return content if isinstance(content, str) else "".join(p["text"] for p in content)


def plain_content(ex: dict[str, Any]) -> dict[str, Any]:
    """An example whose messages' content is a string wherever the file gave text parts,
    so that tokenization sees one form."""
    for msgs in (ex.get("messages"), (ex.get("input") or {}).get("messages"),
                 ex.get(PREFERRED), ex.get(NON_PREFERRED)):  # fmt: skip
        for m in msgs if isinstance(msgs, list) else ():
            if isinstance(m, dict) and isinstance(m.get("content"), list):
                m["content"] = content_text(m["content"])
    return ex


def _check_completion(obj: dict[str, Any]) -> str | None:
    extra = set(obj) - {"prompt", "completion"}
    if extra:
        return f"unknown key(s) {sorted(extra)} beside 'prompt' and 'completion'"
    if not isinstance(obj.get("prompt"), str):
        return "'prompt' must be a string"
    if not isinstance(obj.get("completion"), str) or not obj["completion"]:
        return "'completion' must be a non-empty string"
    return None


def _check_preference(obj: dict[str, Any]) -> str | None:
    extra = set(obj) - set(PREFERENCE_KEYS)
    if extra:
        keys = ", ".join(repr(k) for k in PREFERENCE_KEYS)
        return f"unknown key(s) {sorted(extra)} beside {keys}"
    inp = obj.get("input")
    if not isinstance(inp, dict):
        return "'input' must be an object with 'messages'"
    extra = set(inp) - {"messages", "tools", "parallel_tool_calls"}
    if extra:
        return f"input has unknown key(s) {sorted(extra)}"
    problem, declared = _check_tools(inp, "input.")
    if problem:
        return problem
    msgs = inp.get("messages")
    if not isinstance(msgs, list) or not msgs:
        return "input.messages must be a non-empty list"
    problem, _ = _check_messages(msgs, "input.messages", declared, weights=False)
    if problem:
        return problem
    if msgs[-1]["role"] == "assistant":
        return (
            "input.messages ends with an assistant message; the answers go in "
            "preferred_output and non_preferred_output"
        )
    answers = []
    for key in (PREFERRED, NON_PREFERRED):
        out = obj.get(key)
        if not isinstance(out, list) or len(out) != 1 or not isinstance(out[0], dict):
            return f"'{key}' must be a list of one assistant message"
        m = out[0]
        if m.get("role") != "assistant":
            return f"{key}[0].role must be 'assistant', got {m.get('role')!r}"
        calls = m.get("tool_calls")
        # an answer may call the input's tools
        if calls is not None and (
            problem := tool_calls_problem(calls, f"{key}[0].tool_calls", declared)
        ):
            return problem
        if not (calls is not None and m.get("content") is None):
            if problem := content_problem(m.get("content"), f"{key}[0].content"):
                return problem
            if not calls and not content_text(m["content"]):
                return f"{key}[0].content must not be empty"
        extra = set(m) - {"role", "content", "name", "tool_calls"}
        if extra:
            return f"{key}[0] has unknown key(s) {sorted(extra)}"
        text = content_text(m["content"]) if m.get("content") is not None else ""
        answers.append(json.dumps([text, [c["function"] for c in calls or ()]], sort_keys=True))
    if answers[0] == answers[1]:
        return "preferred_output and non_preferred_output are the same answer"
    return None


def check_file(path: Path) -> FileCheck:
    v = LineValidator()
    for raw in iter_lines(path):
        v.feed(raw)
    return v.check


def iter_lines(path: Path) -> Iterator[bytes]:
    """Lines without their newline; a line longer than the limit is cut, not kept whole."""
    with path.open("rb") as f:
        while True:
            raw = f.readline(MAX_LINE_BYTES + 1)
            if not raw:
                return
            if len(raw) > MAX_LINE_BYTES and not raw.endswith(b"\n"):
                while (rest := f.readline(MAX_LINE_BYTES)) and not rest.endswith(b"\n"):
                    pass
            yield raw.rstrip(b"\r\n")


def decode_line(raw: bytes, first: bool) -> str:
    """A line as text; the first loses a UTF-8 byte-order mark (editors on Windows write
    one), which would otherwise hide the `{` that tells JSONL from plain text."""
    line = raw.decode("utf-8")
    return line.removeprefix("\ufeff") if first else line


def check_examples(path: Path, limit: int | None = None) -> str:
    """The format of a valid file; raises `DataError` on its bad lines. With `limit`, only
    the first `limit` examples are checked (a bounded sample: the dry run's), and the rest
    of the file is never read. Reads line by line: nothing of the file is kept."""
    if limit is None:
        check = check_file(path)
    else:
        v = LineValidator()
        for raw in itertools.islice(_nonblank(iter_lines(path)), limit):
            v.feed(raw)
        check = v.check
    if not check.ok:
        raise DataError(f"{path.name}: {check.summary()}")
    return check.format or "text"


def iter_examples(path: Path, limit: int | None = None) -> Iterator[dict[str, Any]]:
    """The examples of a file `check_examples` passed, parsed one line at a time as they
    are read (a plain text line is `{"text": line}`); with `limit`, the first `limit`."""
    plain = None
    left = limit
    for i, raw in enumerate(iter_lines(path)):
        line = decode_line(raw, first=i == 0)
        if not line.strip():
            continue
        if left is not None:
            if left == 0:
                return
            left -= 1
        if plain is None:
            plain = not line.lstrip().startswith("{")
        yield {"text": line} if plain else plain_content(from_legacy_functions(json.loads(line)))


def read_examples(path: Path, limit: int | None = None) -> tuple[str, list[Any]]:
    """(format, examples) of a valid file, all in memory (small files: tests, benchmarks);
    data preparation streams them instead (`iter_examples`)."""
    fmt = check_examples(path, limit)
    return fmt, list(iter_examples(path, limit))


def _nonblank(lines: Iterator[bytes]) -> Iterator[bytes]:
    """Lines with something on them (a line of spaces is blank: it holds no example)."""
    return (raw for raw in lines if raw.strip())


# -- tokenization --------------------------------------------------------------------------


@dataclass
class Encoded:
    """Rows ready for the model, and what encoding them found."""

    input_ids: torch.Tensor  # (N, seq_len) long
    labels: torch.Tensor  # (N, seq_len) long, IGNORE where no loss
    lengths: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.long))
    # packed rows (`service.data.packing`): each example's positions restart at 0, which is
    # also what keeps attention inside it; None when every row holds one example
    position_ids: torch.Tensor | None = None
    examples: int = 0  # examples read
    tokens: int = 0  # real tokens in the rows (not padding)
    loss_tokens: int = 0  # tokens the loss is taken on
    truncated: int = 0  # examples cut at seq_len
    dropped: int = 0  # examples with nothing left to train on after the cut
    longest: int = 0  # tokens of the longest example before the cut

    @property
    def packed(self) -> bool:
        return self.position_ids is not None

    def report(self) -> dict[str, Any]:
        # (rows, seq_len), or (pairs, 2, seq_len) for preference pairs
        rows = int(self.input_ids.shape[0])
        seq_len = int(self.input_ids.shape[-1]) if self.input_ids.dim() >= 2 else 0
        slots = self.input_ids.numel() if seq_len else 0
        kept = self.examples - self.dropped
        return {
            "examples": self.examples,
            "rows": rows,
            "seq_len": seq_len,
            "tokens": self.tokens,
            "loss_tokens": self.loss_tokens,
            "truncated_examples": self.truncated,
            "dropped_examples": self.dropped,
            "longest_example_tokens": self.longest,
            "packed": self.packed,
            # the share of the row slots that hold a real token (the rest is padding)
            "fill_ratio": self.tokens / slots if slots else 0.0,
            "examples_per_row": kept / rows if rows else 0.0,
        }


def ensure_chat_template(tokenizer: Any) -> None:
    """Give a tokenizer without a chat template the ChatML one (documented above)."""
    if not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = CHATML_TEMPLATE


def example_tokens(tokenizer: Any, fmt: str, ex: dict[str, Any]) -> tuple[list[int], list[int]]:
    """(token ids, loss mask 0/1) of one chat or completion example, uncut; of a
    reinforcement prompt, the prompt that asks for the answer, with no loss."""
    if fmt == "prompts":
        msgs, tools = template_messages(tokenizer, ex["messages"], ex.get("tools"), content_text)
        text = tokenizer.apply_chat_template(
            msgs, tools=tools, tokenize=False, add_generation_prompt=True
        )
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        return list(ids), [0] * len(ids)
    if fmt == "completion":
        p = tokenizer(ex["prompt"], add_special_tokens=False)["input_ids"]
        c = tokenizer(ex["completion"], add_special_tokens=False)["input_ids"]
        eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        return p + c + eos, [0] * len(p) + [1] * (len(c) + len(eos))
    # tools and tool calls as the template renders them, or in the fallback format
    # (service/data/tools.py), which may put a system message first: `lead`
    msgs, tools = template_messages(tokenizer, ex["messages"], ex.get("tools"), content_text)
    lead = len(msgs) - len(ex["messages"])
    text = tokenizer.apply_chat_template(msgs, tools=tools, tokenize=False)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    offsets = enc["offset_mapping"]
    mask = [0] * len(offsets)
    for i, m in enumerate(ex["messages"]):
        if m["role"] != "assistant" or m.get("weight", 1) == 0:
            continue
        prompt = tokenizer.apply_chat_template(
            msgs[: lead + i], tools=tools, tokenize=False, add_generation_prompt=True
        )
        through = tokenizer.apply_chat_template(msgs[: lead + i + 1], tools=tools, tokenize=False)
        # Spans are placed by length, so they hold only where the renderings agree with
        # `text`. Some templates close a whole conversation with EOS (Phi-3): the message
        # then ends where `through` departs from `text`, and a token that crosses that
        # point belongs to the next turn. Others render the last turn differently
        # (reasoning templates add an empty think block): no token of the message agrees.
        start, end = len(prompt), _agreeing_chars(text, through)
        departs = end < len(through)
        inside = [
            k for k, (a, b) in enumerate(offsets) if start <= a < end and (b <= end or not departs)
        ]
        if not text.startswith(prompt) or not inside:
            raise DataError(
                f"the chat template renders messages[{i}] differently once later turns "
                "follow it, so its loss mask cannot be placed; train on the last assistant "
                'message only ("weight": 0 on the earlier ones)'
            )
        for k in inside:
            mask[k] = 1
    return list(enc["input_ids"]), mask


def _agreeing_chars(a: str, b: str) -> int:
    """Length of the longest common prefix of `a` and `b`."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    return next(i for i in range(n) if a[i] != b[i])


def _answer(m: dict[str, Any]) -> dict[str, Any]:
    """A preference pair's answer as the assistant message that trains: its text, its
    calls of the input's tools, or both."""
    out: dict[str, Any] = {"role": "assistant", "content": m.get("content")}
    if m.get("tool_calls") is not None:
        out["tool_calls"] = m["tool_calls"]
    return out


def pair_tokens(tokenizer: Any, ex: dict[str, Any]) -> list[tuple[list[int], list[int]]]:
    """A preference pair's two answers, each after the prompt as a chat example that trains
    on the answer only (earlier assistant turns of the prompt are context): the preferred
    answer's (ids, loss mask), then the other's."""
    prompt = [
        {**m, **({"weight": 0} if m["role"] == "assistant" else {})}
        for m in ex["input"]["messages"]
    ]
    tools = {"tools": ex["input"]["tools"]} if ex["input"].get("tools") else {}
    return [
        example_tokens(
            tokenizer,
            "chat",
            {
                "messages": [*prompt, _answer(ex[k][0])],
                **tools,
            },
        )
        for k in (PREFERRED, NON_PREFERRED)
    ]
