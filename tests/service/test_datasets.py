"""service/data/datasets: per-line validation, and loss masks checked against hand-written rows.

Most tests use a word-level tokenizer (one token per space-separated word, so every id is
known in advance) with a small explicit chat template; the last ones run the real Hugging
Face pathway (`tests/tiny.make_tiny_llama` + `AutoTokenizer` + the model's own loss).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pstar_core.hf import load_causal_lm
from service.data.datasets import (
    IGNORE,
    MAX_LINE_BYTES,
    MAX_REPORTED_ERRORS,
    DataError,
    FileCheck,
    LineValidator,
    check_file,
    read_examples,
)
from service.data.prepare import encode

X = IGNORE
VOCAB = [
    "<pad>",
    "<eos>",
    "<s>",
    "</s>",
    "system",
    "user",
    "assistant",
    ":",
    "be",
    "brief",
    "hi",
    "hello",
    "again",
    "bye",
    "ok",
    "yes",
    "think",
    "<unk>",
]
V = {w: i for i, w in enumerate(VOCAB)}
# `<s> role : content </s>` per message; the generation prompt is `<s> assistant :`
TEMPLATE = (
    "{% for m in messages %}<s> {{ m['role'] }} : {{ m['content'] }} </s> {% endfor %}"
    "{% if add_generation_prompt %}<s> assistant : {% endif %}"
)
# like Phi-3: EOS closes a whole conversation, not each message
EOS_AT_END_TEMPLATE = TEMPLATE[: -len("{% endif %}")] + "{% else %}<eos>{% endif %}"
# like reasoning templates: the last assistant turn is rendered with an extra block
LAST_TURN_DIFFERS_TEMPLATE = (
    "{% for m in messages %}<s> {{ m['role'] }} : "
    "{% if loop.last and m['role'] == 'assistant' %}think {% endif %}"
    "{{ m['content'] }} </s> {% endfor %}"
    "{% if add_generation_prompt %}<s> assistant : {% endif %}"
)


def ids(words: str) -> list[int]:
    return [V[w] for w in words.split()]


def word_tokenizer(template: str = TEMPLATE, pad: bool = True):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(V, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>" if pad else None
    )
    fast.chat_template = template
    return fast


def chat(*turns: tuple[str, str] | tuple[str, str, int]) -> dict:
    msgs = []
    for role, content, *weight in turns:
        msgs.append({"role": role, "content": content})
        if weight:
            msgs[-1]["weight"] = weight[0]
    return {"messages": msgs}


TWO_TURNS = chat(
    ("system", "be brief"),
    ("user", "hi"),
    ("assistant", "hello", 0),
    ("user", "hi again"),
    ("assistant", "bye ok"),
)


# -- chat masks -----------------------------------------------------------------------------


def test_chat_labels_cover_only_the_weighted_assistant_content_and_end_of_turn():
    enc = encode(word_tokenizer(), "chat", [TWO_TURNS], seq_len=32)
    # fmt: off
    expected_ids = ids(
        "<s> system : be brief </s> "
        "<s> user : hi </s> "
        "<s> assistant : hello </s> "
        "<s> user : hi again </s> "
        "<s> assistant : bye ok </s>"
    ) + [V["<pad>"]] * 4
    expected_labels = [
        X, X, X, X, X, X,                          # <s> system : be brief </s>
        X, X, X, X, X,                             # <s> user : hi </s>
        X, X, X, X, X,                             # <s> assistant : hello </s>  (weight 0)
        X, X, X, X, X, X,                          # <s> user : hi again </s>
        X, X, X, V["bye"], V["ok"], V["</s>"],     # <s> assistant : bye ok </s>
        X, X, X, X,                                # padding
    ]
    # fmt: on
    assert enc.input_ids.tolist() == [expected_ids]
    assert enc.labels.tolist() == [expected_labels]


def test_chat_labels_cover_every_assistant_message_without_a_weight():
    ex = chat(("user", "hi"), ("assistant", "hello"), ("user", "again"), ("assistant", "bye"))
    enc = encode(word_tokenizer(), "chat", [ex], seq_len=20)
    # fmt: off
    expected_labels = [
        X, X, X, X, X,                             # <s> user : hi </s>
        X, X, X, V["hello"], V["</s>"],            # <s> assistant : hello </s>
        X, X, X, X, X,                             # <s> user : again </s>
        X, X, X, V["bye"], V["</s>"],              # <s> assistant : bye </s>
    ]
    # fmt: on
    assert enc.labels.tolist() == [expected_labels]
    assert enc.loss_tokens == 4


def test_chat_mask_stops_where_an_eos_at_conversation_end_template_departs():
    ex = chat(("user", "hi"), ("assistant", "hello"), ("user", "again"), ("assistant", "bye"))
    enc = encode(word_tokenizer(EOS_AT_END_TEMPLATE), "chat", [ex], seq_len=21)
    # fmt: off
    expected_labels = [
        X, X, X, X, X,                             # <s> user : hi </s>
        X, X, X, V["hello"], V["</s>"],            # <s> assistant : hello </s>
        X, X, X, X, X,                             # <s> user : again </s>  (no leak into <s>)
        X, X, X, V["bye"], V["</s>"], V["<eos>"],  # <s> assistant : bye </s> <eos>
    ]
    # fmt: on
    assert enc.labels.tolist() == [expected_labels]


def test_chat_template_that_renders_the_last_turn_differently_is_refused_for_earlier_turns():
    ex = chat(("user", "hi"), ("assistant", "hello"), ("user", "again"), ("assistant", "bye"))
    with pytest.raises(DataError, match=r"messages\[1\]"):
        encode(word_tokenizer(LAST_TURN_DIFFERS_TEMPLATE), "chat", [ex], seq_len=32)


def test_chat_template_that_renders_the_last_turn_differently_trains_the_last_turn():
    ex = chat(("user", "hi"), ("assistant", "hello", 0), ("user", "again"), ("assistant", "bye"))
    enc = encode(word_tokenizer(LAST_TURN_DIFFERS_TEMPLATE), "chat", [ex], seq_len=21)
    # fmt: off
    expected_labels = [
        X, X, X, X, X,                                       # <s> user : hi </s>
        X, X, X, X, X,                                       # <s> assistant : hello </s>
        X, X, X, X, X,                                       # <s> user : again </s>
        X, X, X, V["think"], V["bye"], V["</s>"],            # <s> assistant : think bye </s>
    ]
    # fmt: on
    assert enc.labels.tolist() == [expected_labels]


# -- completion and text --------------------------------------------------------------------


def test_completion_labels_cover_the_completion_and_eos_only():
    enc = encode(
        word_tokenizer(), "completion", [{"prompt": "hi again", "completion": "bye ok"}], 8
    )
    assert enc.input_ids.tolist() == [ids("hi again bye ok <eos> <pad> <pad> <pad>")]
    assert enc.labels.tolist() == [[X, X, V["bye"], V["ok"], V["<eos>"], X, X, X]]
    assert enc.loss_tokens == 3


def test_text_is_concatenated_with_eos_and_cut_into_full_rows_trained_everywhere():
    docs = [{"text": "hi again"}, {"text": "bye"}, {"text": "hello hi ok"}]
    enc = encode(word_tokenizer(), "text", docs, seq_len=4)
    # the stream is `hi again <eos> bye <eos> hello hi ok <eos>`; the last token is left over
    rows = [ids("hi again <eos> bye"), ids("<eos> hello hi ok")]
    assert enc.input_ids.tolist() == rows
    assert enc.labels.tolist() == rows
    assert (enc.tokens, enc.loss_tokens) == (8, 6)


def test_text_longest_example_is_counted_in_tokens():
    docs = [{"text": "hello hello"}, {"text": "hi again ok yes"}]
    enc = encode(word_tokenizer(), "text", docs, seq_len=2)
    assert enc.report()["longest_example_tokens"] == 5  # four words and the EOS


# -- rows: truncation, dropping, padding ----------------------------------------------------


def test_long_example_is_truncated_and_counted():
    enc = encode(word_tokenizer(), "completion", [{"prompt": "hi", "completion": "bye ok yes"}], 3)
    assert enc.input_ids.tolist() == [ids("hi bye ok")]
    assert enc.labels.tolist() == [[X, V["bye"], V["ok"]]]
    assert (enc.truncated, enc.longest, enc.dropped) == (1, 5, 0)


def test_example_with_nothing_left_to_train_on_after_the_cut_is_dropped():
    examples = [
        {"prompt": "be brief hi again", "completion": "bye"},  # the cut leaves only prompt
        {"prompt": "hi", "completion": "ok"},
    ]
    enc = encode(word_tokenizer(), "completion", examples, seq_len=3)
    assert enc.input_ids.tolist() == [ids("hi ok <eos>")]
    assert enc.report()["rows"] == 1
    assert (enc.examples, enc.truncated, enc.dropped) == (2, 1, 1)


def test_example_trained_only_on_its_first_position_is_dropped():
    # labels shift inside the model: the first position of a row predicts nothing
    enc = encode(word_tokenizer(), "completion", [{"prompt": "", "completion": "bye ok"}], 1)
    assert enc.input_ids.shape == (0, 1)
    assert enc.dropped == 1


def test_padding_uses_the_pad_id_and_ignored_labels():
    enc = encode(word_tokenizer(), "completion", [{"prompt": "hi", "completion": "ok"}], 6)
    assert enc.input_ids[0, 3:].tolist() == [V["<pad>"]] * 3
    assert enc.labels[0, 3:].tolist() == [X] * 3
    assert enc.lengths.tolist() == [3]


def test_padding_falls_back_to_eos_without_a_pad_token():
    tok = word_tokenizer(pad=False)
    enc = encode(tok, "completion", [{"prompt": "hi", "completion": "ok"}], 5)
    assert enc.input_ids.tolist() == [ids("hi ok <eos> <eos> <eos>")]
    assert enc.labels.tolist() == [[X, V["ok"], V["<eos>"], X, X]]


# -- line validation ------------------------------------------------------------------------

GOOD_CHAT = json.dumps({"messages": [{"role": "user", "content": "hi"}, TWO_TURNS["messages"][4]]})


def validate(*lines: str | bytes) -> FileCheck:
    v = LineValidator()
    for line in lines:
        v.feed(line.encode() if isinstance(line, str) else line)
    return v.check


def reasons(check: FileCheck) -> list[tuple[int, str]]:
    return [(e.line, e.reason) for e in check.errors]


def only_error(*lines: str | bytes) -> tuple[int, str]:
    check = validate(*lines)
    assert check.error_count == 1, reasons(check)
    assert not check.ok
    return check.errors[0].line, check.errors[0].reason


def msg_line(*messages: dict, **extra) -> str:
    return json.dumps({"messages": list(messages), **extra})


USER = {"role": "user", "content": "hi"}
ASSISTANT = {"role": "assistant", "content": "bye"}


def test_valid_chat_file_is_ok_with_its_format_and_counts():
    check = validate(GOOD_CHAT, GOOD_CHAT)
    assert (check.ok, check.format, check.lines, check.examples) == (True, "chat", 2, 2)


def test_invalid_json_is_reported_with_its_line():
    line, reason = only_error(GOOD_CHAT, '{"messages": [')
    assert line == 2
    assert reason.startswith("not valid JSON")


def test_json_that_is_not_an_object_is_reported():
    assert only_error(GOOD_CHAT, "[1, 2]") == (2, "expected a JSON object, got list")


def test_object_of_no_known_format_is_reported():
    line, reason = only_error(json.dumps({"input": "hi"}))
    assert line == 1
    assert reason.startswith("expected 'messages' (chat)")


def test_messages_that_are_not_a_list_are_reported():
    assert only_error(json.dumps({"messages": "hi"})) == (1, "'messages' must be a non-empty list")


def test_message_with_an_unknown_role_is_reported():
    _, reason = only_error(msg_line({"role": "robot", "content": "x"}, ASSISTANT))
    assert reason.startswith("messages[0].role must be one of")


def test_message_content_that_is_neither_a_string_nor_text_parts_is_reported():
    bad = {"role": "user", "content": 7}
    assert only_error(msg_line(bad, ASSISTANT)) == (
        1,
        "messages[0].content must be a string or a list of text parts",
    )
    odd = {"role": "user", "content": [{"type": "text", "value": "hi"}]}
    assert only_error(msg_line(odd, ASSISTANT)) == (
        1,
        'messages[0].content[0] must be a text part: {"type": "text", "text": "..."}',
    )


def test_an_image_part_is_reported_as_not_trained_here():
    image = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}
    bad = {"role": "user", "content": [{"type": "text", "text": "what is it?"}, image]}
    _, reason = only_error(msg_line(bad, ASSISTANT))
    assert reason.startswith("messages[0].content[1] is an 'image_url' part: vision and audio")


def test_text_parts_train_exactly_as_the_same_text_given_as_a_string(tmp_path: Path):
    """OpenAI's chat format allows content as a list of text parts; they are joined."""
    parts = [
        {"role": "system", "content": [{"type": "text", "text": "be brief"}]},
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "bye "},
                                          {"type": "text", "text": "ok"}]},
    ]  # fmt: skip
    pref = {
        "input": {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]},
        "preferred_output": [{"role": "assistant", "content": [{"type": "text", "text": "a"}]}],
        "non_preferred_output": [{"role": "assistant", "content": "b"}],
    }
    for line, fmt in ((msg_line(*parts), "chat"), (json.dumps(pref), "preference")):
        f = tmp_path / f"{fmt}.jsonl"
        f.write_text(line + "\n")
        assert validate(line).ok
        got_fmt, (ex,) = read_examples(f)
        assert got_fmt == fmt
        if fmt == "chat":
            assert ex == chat(("system", "be brief"), ("user", "hi"), ("assistant", "bye ok"))
        else:
            assert ex["input"]["messages"][0]["content"] == "hi"
            assert ex["preferred_output"][0]["content"] == "a"


def test_messages_that_end_before_the_answer_are_a_reinforcement_prompt(tmp_path):
    # a prompt for reinforcement fine-tuning, not a chat example missing its answer: a
    # supervised job is refused on such a file at creation, naming the format
    f = tmp_path / "p.jsonl"
    f.write_text(msg_line(USER, reference="apple") + "\n" + msg_line(USER) + "\n")
    fmt, (ex, plain) = read_examples(f)
    assert fmt == "prompts"
    assert ex["reference"] == "apple"
    assert "reference" not in plain
    # an item beside a conversation that has its answer already is neither
    _, reason = only_error(msg_line(USER, ASSISTANT, reference="apple"))
    assert "a reinforcement prompt's item has keys of its own" in reason


def test_chat_whose_assistant_messages_all_have_weight_0_is_reported():
    _, reason = only_error(msg_line(USER, {**ASSISTANT, "weight": 0}))
    assert reason.startswith("no assistant message to train on")


def test_unknown_key_beside_messages_is_reported():
    _, reason = only_error(msg_line(USER, ASSISTANT, temperature=0.2))
    assert reason.startswith("unknown key(s) ['temperature'] beside 'messages'")


def test_unknown_key_in_a_message_is_reported():
    bad = {**USER, "tool_calls": []}
    assert only_error(msg_line(bad, ASSISTANT)) == (
        1,
        "messages[0] has unknown key(s) ['tool_calls']",
    )


@pytest.mark.parametrize(
    "messages",
    [
        (USER, {**ASSISTANT, "weight": 2}),
        (USER, {**ASSISTANT, "weight": True}),
        ({**USER, "weight": 1}, ASSISTANT),
    ],
    ids=["weight-2", "weight-true", "weight-on-user"],
)
def test_bad_weight_is_reported(messages):
    _, reason = only_error(msg_line(*messages))
    assert "weight must be 0 or 1, on assistant messages only" in reason


def test_completion_with_an_unknown_key_is_reported():
    _, reason = only_error(json.dumps({"prompt": "a", "completion": "b", "label": 1}))
    assert reason.startswith("unknown key(s) ['label']")


def test_completion_without_completion_text_is_reported():
    bad = json.dumps({"prompt": "a", "completion": ""})
    assert only_error(bad) == (1, "'completion' must be a non-empty string")


def test_empty_text_example_is_reported():
    assert only_error(json.dumps({"text": " "})) == (1, "'text' must be a non-empty string")


def test_example_of_another_format_than_the_first_line_is_reported():
    completion = json.dumps({"prompt": "a", "completion": "b"})
    line, reason = only_error(GOOD_CHAT, completion)
    assert line == 2
    assert reason == "a completion example in a file of chat examples (from the first line)"


def test_non_utf8_line_is_reported():
    assert only_error(GOOD_CHAT, b'{"text": "caf\xe9"}') == (2, "not UTF-8 (byte 13)")


def test_overlong_line_is_reported():
    line, reason = only_error(GOOD_CHAT, b"x" * (MAX_LINE_BYTES + 1))
    assert (line, reason) == (2, "longer than 16 MiB")


def test_blank_lines_are_skipped_but_counted_for_line_numbers():
    check = validate("", GOOD_CHAT, "   ", "{")
    assert check.examples == 1
    assert reasons(check)[0][0] == 4


def test_plain_text_file_is_detected_and_every_line_is_a_document():
    check = validate("the first document", "", '{"not": "json here"}', "a third")
    assert (check.ok, check.format, check.examples) == (True, "text", 3)


def test_reported_errors_are_capped_but_all_are_counted():
    check = validate(GOOD_CHAT, *(["[]"] * (MAX_REPORTED_ERRORS + 5)))
    assert len(check.errors) == MAX_REPORTED_ERRORS
    assert check.error_count == MAX_REPORTED_ERRORS + 5
    assert check.summary().endswith("; and 5 more")


def test_file_without_examples_is_not_ok():
    check = validate("", "  ")
    assert not check.ok
    assert check.summary() == "the file holds no examples"


def test_check_file_reports_line_numbers_of_a_crlf_file(tmp_path: Path):
    path = tmp_path / "train.jsonl"
    path.write_bytes(f"{GOOD_CHAT}\r\n{GOOD_CHAT}\r\n[]\r\n".encode())
    check = check_file(path)
    assert (check.format, check.examples) == ("chat", 2)
    assert reasons(check) == [(3, "expected a JSON object, got list")]


def test_read_examples_of_a_bad_file_raises_with_the_line(tmp_path: Path):
    path = tmp_path / "train.jsonl"
    path.write_text(f"{GOOD_CHAT}\n[]\n")
    with pytest.raises(DataError, match="line 2: expected a JSON object"):
        read_examples(path)


def test_jsonl_with_a_byte_order_mark_is_read_as_jsonl(tmp_path: Path):
    path = tmp_path / "train.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + f"{GOOD_CHAT}\n{GOOD_CHAT}\n".encode())
    fmt, examples = read_examples(path)
    assert fmt == "chat"
    assert examples == [json.loads(GOOD_CHAT)] * 2


def test_read_examples_of_a_plain_text_file_gives_text_examples(tmp_path: Path):
    path = tmp_path / "corpus.txt"
    path.write_text("first line\n\nsecond line\n")
    assert read_examples(path) == ("text", [{"text": "first line"}, {"text": "second line"}])


def test_read_examples_with_a_limit_reads_and_checks_only_that_many(tmp_path):
    path = tmp_path / "t.jsonl"
    good = json.dumps({"prompt": "p", "completion": "c"})
    path.write_text("\n".join([good, "", good, good, "{not json"]) + "\n")
    assert read_examples(path, limit=3) == ("completion", [json.loads(good)] * 3)
    with pytest.raises(DataError, match="line 5"):
        read_examples(path)
    with pytest.raises(DataError):
        read_examples(path, limit=4)


# -- the real Hugging Face pathway ----------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from transformers import AutoTokenizer

    from tests.tiny import make_tiny_llama

    path = make_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama")
    model = load_causal_lm(str(path), dtype=torch.float32).eval()
    return AutoTokenizer.from_pretrained(str(path)), model


# The two conversations as the ChatML template renders them, in pieces, each trained on or
# not: the hand-written answer the encoded labels must match.
HF_CHATS = [
    (
        chat(
            ("user", "What does apple mean?"),
            ("assistant", "apple is a word about apple things.", 0),
            ("user", "What does river mean?"),
            ("assistant", "river is a word about river things."),
        ),
        [
            ("<|im_start|>user\nWhat does apple mean?<|im_end|>\n<|im_start|>assistant\n", False),
            ("apple is a word about apple things.<|im_end|>\n", False),
            ("<|im_start|>user\nWhat does river mean?<|im_end|>\n<|im_start|>assistant\n", False),
            ("river is a word about river things.<|im_end|>\n", True),
        ],
    ),
    (
        chat(("user", "What does stone mean?"), ("assistant", "stone is a word.")),
        [
            ("<|im_start|>user\nWhat does stone mean?<|im_end|>\n<|im_start|>assistant\n", False),
            ("stone is a word.<|im_end|>\n", True),
        ],
    ),
]
HF_SEQ_LEN = 64


def hand_rows(tok) -> tuple[list[list[int]], list[list[int]]]:
    """Token ids and labels of `HF_CHATS`, piece by piece, padded to `HF_SEQ_LEN`."""
    all_ids, all_labels = [], []
    for _ex, pieces in HF_CHATS:
        row, labels = [], []
        for text, trained in pieces:
            piece = tok(text, add_special_tokens=False)["input_ids"]
            row += piece
            labels += piece if trained else [X] * len(piece)
        n_pad = HF_SEQ_LEN - len(row)
        all_ids.append(row + [tok.pad_token_id] * n_pad)
        all_labels.append(labels + [X] * n_pad)
    return all_ids, all_labels


def test_hf_chat_labels_match_the_hand_rendered_conversation(tiny_llama):
    tok, _model = tiny_llama
    enc = encode(tok, "chat", [ex for ex, _ in HF_CHATS], HF_SEQ_LEN)
    want_ids, want_labels = hand_rows(tok)
    assert enc.input_ids.tolist() == want_ids
    assert enc.labels.tolist() == want_labels


def test_hf_model_loss_is_the_cross_entropy_of_the_unmasked_positions_only(tiny_llama):
    tok, model = tiny_llama
    enc = encode(tok, "chat", [ex for ex, _ in HF_CHATS], HF_SEQ_LEN)
    ids, labels = enc.input_ids.long(), enc.labels.long()  # rows are stored int32
    with torch.no_grad():
        out = model(input_ids=ids, labels=labels)
    logits = out.logits.float()

    # position p is predicted by the logits at p - 1
    _, want_labels = hand_rows(tok)
    trained = [(b, p) for b, row in enumerate(want_labels) for p, t in enumerate(row) if t != X]
    by_hand = torch.stack(
        [torch.nn.functional.cross_entropy(logits[b, p - 1], ids[b, p]) for b, p in trained]
    ).mean()
    assert torch.allclose(out.loss, by_hand, rtol=1e-5, atol=1e-6)

    # the masked tokens really would change the loss: this test notices if they leak in
    every_real = [(b, p) for b, n in enumerate(enc.lengths.tolist()) for p in range(1, n)]
    leaked = torch.stack(
        [torch.nn.functional.cross_entropy(logits[b, p - 1], ids[b, p]) for b, p in every_real]
    ).mean()
    assert abs(leaked.item() - out.loss.item()) > 1e-2
    assert enc.loss_tokens == len(trained)


# -- function calling -------------------------------------------------------------------------

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
}
TOOL_CHAT = {
    "tools": [WEATHER],
    "parallel_tool_calls": False,
    "messages": [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "rain, 7 C"},
        {"role": "assistant", "content": "It rains in Oslo."},
    ],
}


def test_a_function_calling_line_as_openai_documents_it_is_valid():
    assert validate(json.dumps(TOOL_CHAT)).ok


@pytest.mark.parametrize(
    ("change", "says"),
    [
        (lambda ex: ex["messages"][2].update(tool_call_id="call_9"),
         "messages[2].tool_call_id must be the id of a call an earlier assistant message made"),
        (lambda ex: ex["messages"][1]["tool_calls"][0]["function"].update(name="get_time"),
         "messages[1].tool_calls[0].function.name 'get_time' is not one of the line's tools"),
        (lambda ex: ex["messages"][1]["tool_calls"][0]["function"].update(arguments="{city"),
         "messages[1].tool_calls[0].function.arguments is not valid JSON"),
        (lambda ex: ex["messages"][1]["tool_calls"][0]["function"].update(arguments={"a": 1}),
         "messages[1].tool_calls[0].function.arguments must be a string holding a JSON object"),
        (lambda ex: ex["tools"][0]["function"].update(name="get weather"),
         "tools[0].function.name must be 1 to 64 letters, digits, '_' or '-'"),
        (lambda ex: ex.update(tools=[WEATHER, WEATHER]),
         "tools[1].function.name 'get_weather' is declared twice"),
        (lambda ex: ex.update(parallel_tool_calls="no"),
         "parallel_tool_calls must be true or false"),
    ],
)  # fmt: skip
def test_a_wrong_tool_call_or_tool_is_reported_naming_it(change, says):
    ex = json.loads(json.dumps(TOOL_CHAT))
    change(ex)
    _, reason = only_error(json.dumps(ex))
    assert reason.startswith(says), reason


def _tokenizer(tmp_path: Path, template: str | None = None):
    from transformers import AutoTokenizer

    from tests.tiny import make_tiny_llama

    tok = AutoTokenizer.from_pretrained(make_tiny_llama(tmp_path / "m"))
    if template is not None:
        tok.chat_template = template
    return tok


def _trained_text(tok, ids: list[int], mask: list[int]) -> str:
    return tok.decode([t for t, m in zip(ids, mask, strict=True) if m])


def test_a_template_without_tools_gets_the_fallback_format_and_the_calls_are_trained(
    tmp_path: Path,
):
    from service.data.datasets import example_tokens
    from service.data.tools import TOOLS_HEADER

    tok = _tokenizer(tmp_path)  # ChatML: no tools of its own
    ids, mask = example_tokens(tok, "chat", json.loads(json.dumps(TOOL_CHAT)))
    text = tok.decode(ids)
    assert text.startswith(f"<|im_start|>system\n{TOOLS_HEADER}\n{json.dumps(WEATHER)}\n</tools>")
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    assert f"<|im_start|>assistant\n{call}<|im_end|>" in text
    assert "<|im_start|>user\n<tool_response>\nrain, 7 C\n</tool_response><|im_end|>" in text
    trained = _trained_text(tok, ids, mask)
    assert (call in trained, "It rains in Oslo." in trained) == (True, True)
    assert ("rain, 7 C" in trained, "Weather in Oslo?" in trained) == (False, False)


def test_a_template_with_tools_renders_them_itself(tmp_path: Path):
    from service.data.datasets import example_tokens

    template = (
        "{% if tools %}TOOLS {{ tools | map(attribute='function.name') | join(',') }}\n{% endif %}"
        "{% for m in messages %}{{ m.role }}: {{ m.content }}"
        "{% for c in m.tool_calls or [] %}CALL {{ c.function.name }} "
        "{{ c.function.arguments.city }} [{{ c.id }}]{% endfor %}"
        "{% if m.role == 'tool' %} (for {{ m.tool_call_id }}){% endif %}{{ '\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    tok = _tokenizer(tmp_path, template)
    ids, mask = example_tokens(tok, "chat", json.loads(json.dumps(TOOL_CHAT)))
    assert tok.decode(ids) == (
        "TOOLS get_weather\nuser: Weather in Oslo?\nassistant: CALL get_weather Oslo [call_1]\n"
        "tool: rain, 7 C (for call_1)\nassistant: It rains in Oslo.\n"
    )
    trained = _trained_text(tok, ids, mask)
    assert ("CALL get_weather Oslo [call_1]" in trained, "It rains in Oslo." in trained) == (
        True,
        True,
    )
    assert "rain, 7 C" not in trained


def test_a_preference_pair_with_tools_renders_them_in_its_prompt(tmp_path: Path):
    from service.data.datasets import pair_tokens

    pair = {
        "input": {"messages": TOOL_CHAT["messages"][:3], "tools": [WEATHER]},
        "preferred_output": [{"role": "assistant", "content": "It rains."}],
        "non_preferred_output": [{"role": "assistant", "content": "Sunny!"}],
    }
    assert validate(json.dumps(pair)).ok
    tok = _tokenizer(tmp_path)
    (good, good_mask), (bad, _) = pair_tokens(tok, json.loads(json.dumps(pair)))
    assert ("<tools>" in tok.decode(good), "<tool_call>" in tok.decode(bad)) == (True, True)
    assert _trained_text(tok, good, good_mask).startswith("It rains.")
