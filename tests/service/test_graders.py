"""OpenAI's graders (service/methods/graders.py): each metric against values worked out here
by hand or by a few lines of independent code, multi's formulas, templates, and the 400s
for what OpenAI or this service refuses."""

from __future__ import annotations

import json
import math

import pytest

from service.errors import InvalidRequest
from service.methods.graders import Runners, grade, parse_grader


def check(op: str, reference: str = "{{item.answer}}") -> dict:
    return {
        "type": "string_check", "name": "exact", "operation": op,
        "input": "{{sample.output_text}}", "reference": reference,
    }  # fmt: skip


def similar(metric: str) -> dict:
    return {
        "type": "text_similarity", "name": metric, "evaluation_metric": metric,
        "input": "{{sample.output_text}}", "reference": "{{item.reference}}",
    }  # fmt: skip


def score(raw: dict, sample: str, item: dict) -> float:
    return grade(parse_grader(raw), sample, item).reward


@pytest.mark.parametrize(
    ("op", "sample", "answer", "expected"),
    [
        ("eq", "Paris", "Paris", 1.0),
        ("eq", "Paris ", "Paris", 0.0),
        ("ne", "Lyon", "Paris", 1.0),
        ("ne", "Paris", "Paris", 0.0),
        ("like", "It is Paris.", "Paris", 1.0),
        ("like", "It is paris.", "Paris", 0.0),
        ("ilike", "It is PARIS.", "paris", 1.0),
        ("ilike", "It is Lyon.", "paris", 0.0),
    ],
)
def test_string_check_operations(op, sample, answer, expected):
    assert score(check(op), sample, {"answer": answer}) == expected


def _lcs(a: str, b: str) -> int:
    row = [0] * (len(b) + 1)
    for x in a:
        prev = 0
        for j, y in enumerate(b, 1):
            prev, row[j] = row[j], prev + 1 if x == y else max(row[j], row[j - 1])
    return row[-1]


@pytest.mark.parametrize(("a", "b"), [("hello world", "hello word"), ("kitten", "sitting")])
def test_fuzzy_match_is_the_normalized_indel_similarity(a, b):
    # Indel distance = len(a) + len(b) - 2 LCS, normalized by len(a) + len(b)
    expected = 2 * _lcs(a, b) / (len(a) + len(b))
    assert score(similar("fuzzy_match"), a, {"reference": b}) == pytest.approx(expected)


HYP, REF = "the cat sat on the mat", "the cat sat on a mat"


def test_bleu_is_the_geometric_mean_of_the_four_ngram_precisions():
    # 1- to 4-gram matches of HYP in REF: 5/6, 3/5, 2/4, 1/3; equal lengths, no brevity penalty
    expected = math.prod([5 / 6, 3 / 5, 2 / 4, 1 / 3]) ** 0.25
    assert score(similar("bleu"), HYP, {"reference": REF}) == pytest.approx(expected)
    assert score(similar("bleu"), REF, {"reference": REF}) == pytest.approx(1.0)


def test_gleu_is_the_smaller_of_ngram_precision_and_recall():
    # all 1- to 4-grams: 11 of HYP's 18 are in REF (which has 18 too)
    assert score(similar("gleu"), HYP, {"reference": REF}) == pytest.approx(11 / 18)


@pytest.mark.parametrize(
    ("metric", "expected"),
    [
        ("rouge_1", 2 / 3),  # {the, cat} of 3 words each side
        ("rouge_2", 1 / 2),  # {the cat} of 2 bigrams each side
        ("rouge_3", 0.0),
        ("rouge_l", 2 / 3),  # longest common subsequence "the cat"
    ],
)
def test_rouge_is_the_f_measure_of_ngram_overlap(metric, expected):
    assert score(similar(metric), "The cat sat", {"reference": "the cat ran"}) == pytest.approx(
        expected
    )


def test_meteor_of_an_exact_answer_is_one_less_its_fragmentation_penalty_and_synonyms_count():
    # 6 matched unigrams in one chunk: F-mean 1, penalty 0.5 * (1/6)^3
    same = score(similar("meteor"), REF, {"reference": REF})
    assert same == pytest.approx(1 - 0.5 * (1 / 6) ** 3)
    ref = {"reference": "the car stopped"}
    synonym = score(similar("meteor"), "the auto stopped", ref)
    unrelated = score(similar("meteor"), "the table stopped", ref)
    # WordNet's car.n.01: car, auto, automobile, machine, motorcar. (NLTK looks synonyms up
    # by the Porter stem of the answer's word, so "automobile", stemmed "automobil", misses)
    assert synonym == pytest.approx(1 - 0.5 * (1 / 3) ** 3)
    assert unrelated == pytest.approx((1 - 0.5) * 2 / 3)  # 2 of 3 words, in 2 chunks


def test_multi_computes_its_formula_over_the_named_graders_scores():
    raw = {
        "type": "multi",
        "name": "both",
        "graders": {
            "exact": check("eq"),
            "close": {**similar("rouge_1"), "reference": "{{item.answer}}"},
        },
        "calculate_output": "0.25 * exact + 0.75 * close ^ 2 + min(exact, 1) - abs(-0)",
    }
    got = grade(parse_grader(raw), "Paris France", {"answer": "Paris"})
    assert got.sub_rewards == {"exact": 0.0, "close": pytest.approx(2 / 3)}
    assert got.reward == pytest.approx(0.75 * (2 / 3) ** 2)
    again = grade(parse_grader(raw), "Paris France", {"answer": "Paris"})
    assert again.reward == got.reward  # deterministic


def test_a_multi_grader_given_as_the_sdk_types_it_is_named_by_its_name():
    raw = {"type": "multi", "name": "m", "graders": check("eq"), "calculate_output": "exact"}
    assert score(raw, "x", {"answer": "x"}) == 1.0


def test_templates_reach_nested_item_keys_and_the_samples_json():
    raw = check("eq", "{{item.meta.city}}") | {"input": "{{sample.output_json.city}}"}
    assert score(raw, '{"city": "Oslo"}', {"meta": {"city": "Oslo"}}) == 1.0
    not_json = grade(parse_grader(raw), "Oslo", {"meta": {"city": "Oslo"}})
    assert (not_json.reward, not_json.sample_parse_error) == (0.0, True)


@pytest.mark.parametrize(
    ("raw", "param", "says"),
    [
        ({"type": "python", "name": "p", "source": "def grade(s, i): return 1"},
         "grader.type", "off on this server"),
        ({"type": "label_model", "name": "s", "model": "m", "input": [{"role": "user",
          "content": "x"}], "labels": ["a", "b"], "passing_labels": ["c"]},
         "grader.passing_labels", "not among labels"),
        ({"type": "label_model", "name": "s", "model": "m", "input": [{"role": "user",
          "content": "x"}], "labels": ["a", "a"], "passing_labels": ["a"]},
         "grader.labels", "must differ"),
        ({"type": "label_model", "name": "s", "model": "m", "input": [{"role": "user",
          "content": [{"type": "input_audio", "input_audio": {}}]}], "labels": ["a"],
          "passing_labels": ["a"]}, "grader.input.0.content.0.type", "text only"),
        ({"type": "score_model", "name": "s", "model": "m", "range": [1, 0],
          "input": [{"role": "user", "content": "x"}]}, "grader.range", "low < high"),
        ({"type": "score_model", "name": "s", "model": "m", "input": [{"role": "user",
          "content": [{"type": "input_image", "image_url": "http://x"}]}]},
         "grader.input.0.content.0.type", "text only"),
        ({"type": "score_model", "name": "s", "model": "m",
          "input": [{"role": "user", "content": "{{sample.text}}"}]},
         "grader.input.0", "{{item.<key>}}"),
        ({"type": "nope", "name": "x"}, "grader", "string_check"),
        (similar("cosine"), "grader.evaluation_metric", "embedding model"),
        (similar("wer"), "grader.evaluation_metric", "fuzzy_match"),
        (check("regex"), "grader.operation", "'eq'"),
        (check("eq") | {"extra": 1}, "grader.extra", "unknown field"),
        (check("eq", "{{answer}}"), "grader.reference", "{{item.<key>}}"),
        ({"type": "multi", "name": "m", "graders": {"a": check("eq")},
          "calculate_output": "a + b"}, "grader.calculate_output", "'b' is neither"),
        ({"type": "multi", "name": "m", "graders": {"a": check("eq")},
          "calculate_output": "__import__('os')"}, "grader.calculate_output", "can be called"),
        ({"type": "multi", "name": "m", "graders": {"a": check("eq")},
          "calculate_output": "a.real"}, "grader.calculate_output", "not allowed"),
        ({"type": "multi", "name": "m", "graders": {"a": check("eq")},
          "calculate_output": "a +"}, "grader.calculate_output", "not a formula"),
        ({"type": "multi", "name": "m", "calculate_output": "a",
          "graders": {"a": {"type": "python", "name": "p", "source": "x"}}},
         "grader.graders.a.type", "off on this server"),
    ],
)  # fmt: skip
def test_what_is_refused_is_a_400_naming_the_field(raw, param, says):
    with pytest.raises(InvalidRequest) as e:
        parse_grader(raw)
    assert e.value.param == param
    assert says in str(e.value)


def test_a_template_naming_a_key_the_item_lacks_is_a_400():
    with pytest.raises(InvalidRequest, match="item does not have"):
        grade(parse_grader(check("eq")), "x", {"label": "x"})


def test_score_model_asks_the_model_and_reads_the_first_number_within_the_range():
    asked = []

    def ask(model, messages, sampling):
        asked.append((model, messages, sampling))
        return answers.pop(0), 7

    raw = {
        "type": "score_model", "name": "judge", "model": "judge-model", "range": [0, 10],
        "sampling_params": {"max_completions_tokens": 5, "seed": 3, "temperature": 0},
        "input": [
            {"role": "developer", "content": "Score from 0 to 10."},
            {"role": "user", "content": [
                {"type": "input_text", "text": "Q: {{item.q}}"},
                {"type": "input_text", "text": " A: {{sample.output_text}}"},
            ]},
        ],
    }  # fmt: skip
    grader = parse_grader(raw)
    answers = ["I'd say 7.5 of 10", "12", "no idea"]
    runners = Runners(ask=ask)
    got = [grade(grader, "Oslo", {"q": "Capital of Norway?"}, runners) for _ in range(3)]
    assert [g.reward for g in got] == [7.5, 10.0, 0.0]  # 12 is kept within the range
    assert [g.model_parse_error for g in got] == [False, False, True]
    assert got[0].model_tokens == {"judge-model": 7}
    model, messages, sampling = asked[0]
    assert model == "judge-model"
    assert messages == [
        {"role": "system", "content": "Score from 0 to 10."},
        {"role": "user", "content": "Q: Capital of Norway? A: Oslo"},
    ]
    assert sampling == {"max_tokens": 5, "temperature": 0, "top_p": None, "seed": 3}


def test_label_model_asks_for_one_label_by_its_schema_and_passes_the_passing_ones():
    """The judge is asked at temperature 0 with a JSON schema whose only answer is one of
    the labels; a passing label scores 1, another 0, an answer that is no label 0 with the
    parse error (a judge whose answer could not be constrained)."""
    asked = []

    def ask(model, messages, sampling):
        asked.append((model, messages, sampling))
        return answers.pop(0), 5

    raw = {
        "type": "label_model", "name": "tone", "model": "judge-model",
        "labels": ["polite", "neutral", "rude"], "passing_labels": ["polite", "neutral"],
        "input": [{"role": "user", "content": "Label the tone of: {{sample.output_text}}"}],
    }  # fmt: skip
    grader = parse_grader(raw)
    answers = ['{"label": "neutral"}', '{"label": "rude"}', "polite!", '{"label": "angry"}']
    got = [grade(grader, "Thanks.", {}, Runners(ask=ask)) for _ in range(4)]
    assert [g.reward for g in got] == [1.0, 0.0, 0.0, 0.0]
    assert [g.model_parse_error for g in got] == [False, False, True, True]
    model, messages, sampling = asked[0]
    assert (model, messages) == ("judge-model", [
        {"role": "user", "content": "Label the tone of: Thanks."}
    ])  # fmt: skip
    assert sampling["temperature"] == 0
    schema = sampling["response_format"]["json_schema"]["schema"]
    assert schema["properties"]["label"]["enum"] == ["polite", "neutral", "rude"]
    assert schema["required"] == ["label"]
    multi = {"type": "multi", "name": "m", "calculate_output": "tone",
             "graders": raw}  # fmt: skip  # the SDK's single-grader shape
    assert (
        grade(
            parse_grader(multi), "x", {}, Runners(ask=lambda *a: ('{"label": "polite"}', 1))
        ).reward
        == 1.0
    )


def _multi(formula: str) -> dict:
    return {
        "type": "multi",
        "name": "m",
        "graders": {"a": check("eq")},
        "calculate_output": formula,
    }


@pytest.mark.parametrize(
    "formula",
    [
        "a / (a - 1)",  # a division by zero
        "log(a - 1)",  # log(0)
        "(a - 2) ^ 0.5",  # a complex number
        "4000000 ^ 4000000",  # an overflow, at once (floats, not a huge integer)
        "1e308 * 10 - 1e308 * 10",  # not a number
        "floor(4000000) ^ floor(4000000)",  # floor and ceil give floats too
        "floor(1e300) * floor(1e300)",
    ],
)
def test_a_formula_without_a_value_scores_zero_and_says_so(formula):
    got = grade(parse_grader(_multi(formula)), "x", {"answer": "x"})
    assert (got.reward, got.formula_error) == (0.0, True)


@pytest.mark.parametrize(
    ("formula", "says"),
    [
        ("abs(a, a)", "the other functions one"),
        ("min()", "min and max take one or more values"),
        ("+".join(["a"] * 300), "more than 256 terms"),
    ],
)
def test_a_formula_that_cannot_be_computed_is_a_400(formula, says):
    with pytest.raises(InvalidRequest, match=says):
        parse_grader(_multi(formula))


def test_an_answer_lacking_the_json_a_template_asks_for_scores_zero_not_a_400():
    raw = check("eq", "{{item.answer}}") | {"input": "{{sample.output_json.city}}"}
    grader = parse_grader(raw)
    for sample in ('{"town": "Oslo"}', "42", "[1]", "null", "[" * 100_000):
        got = grade(grader, sample, {"answer": "Oslo"})
        assert (got.reward, got.sample_parse_error) == (0.0, True), sample[:20]
    assert grade(parse_grader(check("eq") | {"input": "{{sample.output_json}}"}), "null",
                 {"answer": "null"}).reward == 1.0  # fmt: skip


def test_long_texts_are_compared_on_their_first_words():
    """ROUGE-L and METEOR cost the product of the two lengths: each side is cut to its
    first MAX_SIMILARITY_WORDS words (fuzzy_match: MAX_FUZZY_CHARS characters)."""
    from service.methods.similarity import MAX_SIMILARITY_WORDS, similarity

    head = " ".join(f"w{i}" for i in range(MAX_SIMILARITY_WORDS))
    long = head + " tail" * 200_000
    assert similarity("rouge_l", long, head) == pytest.approx(1.0)
    assert similarity("bleu", long, head) == pytest.approx(1.0)


def test_score_model_messages_take_plain_strings_in_their_content_list():
    content = ["Rate ", {"type": "input_text", "text": "it"}]
    raw = {"type": "score_model", "name": "s", "model": "m",
           "input": [{"role": "user", "content": content}]}  # fmt: skip
    got = grade(parse_grader(raw), "x", {}, Runners(ask=lambda m, msgs, s: ("1", 1)))
    assert got.reward == 1.0


def test_a_template_that_would_render_a_huge_text_is_a_400():
    raw = check("eq", "{{item.a}}" * 50)
    with pytest.raises(InvalidRequest, match="renders to more than"):
        grade(parse_grader(raw), "x", {"a": "y" * 100_000})


def test_odd_keys_and_deep_answers_are_scored_or_refused_never_crash():
    with pytest.raises(InvalidRequest, match="item does not have"):
        grade(parse_grader(check("eq", "{{item.list.²}}")), "x", {"list": [1, 2, 3]})
    deep = "[" * 990 + "]" * 990  # JSON that parses but cannot be written back
    raw = check("eq", "{{item.answer}}") | {"input": "{{sample.output_json}}"}
    got = grade(parse_grader(raw), deep, {"answer": "x"})
    assert (got.reward, got.sample_parse_error) == (0.0, True)


def test_a_jobs_grader_asks_the_api_again_when_it_is_busy_and_fails_saying_why_otherwise():
    import httpx

    from service.methods.api_client import GraderModelError, api_asker

    seen = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append((request.headers["authorization"], json.loads(request.content)))
        if len(seen) == 1:
            return httpx.Response(429, json={"error": {"message": "busy"}})
        if json.loads(request.content)["model"] == "gone":
            return httpx.Response(404, json={"error": {"message": "No model with id 'gone'."}})
        body = {"choices": [{"message": {"content": "0.5"}}], "usage": {"total_tokens": 7}}
        return httpx.Response(200, json=body)

    ask = api_asker("http://api.test", "tml-k", transport=httpx.MockTransport(answer))
    msgs = [{"role": "user", "content": "score it"}]
    assert ask("judge", msgs, {"max_tokens": 4, "temperature": None}) == ("0.5", 7)
    assert len(seen) == 2  # the 429 was asked again
    assert seen[1] == (
        "Bearer tml-k",
        {"model": "judge", "messages": msgs, "n": 1, "max_tokens": 4},
    )
    with pytest.raises(GraderModelError, match=r"model gone did not answer \(404: No model"):
        ask("gone", msgs, {})
    assert len(seen) == 3  # a 404 is not asked again
