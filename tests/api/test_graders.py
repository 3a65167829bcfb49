"""`/v1/fine_tuning/alpha/graders/run` and `/validate` through the unmodified OpenAI SDK:
the reward and sub-rewards of OpenAI's response shape, and refusals as 400s that name the
field."""

from __future__ import annotations

import openai
import pytest

from tests.api.conftest import start_api

EXACT = {
    "type": "string_check", "name": "exact", "operation": "eq",
    "input": "{{sample.output_text}}", "reference": "{{item.answer}}",
}  # fmt: skip
CLOSE = {
    "type": "text_similarity", "name": "close", "evaluation_metric": "rouge_1",
    "input": "{{sample.output_text}}", "reference": "{{item.answer}}",
}  # fmt: skip


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("graders")
    api, stop = start_api(
        data_dir, f"sqlite:///{data_dir / 'store.db'}", "sqlite", models_in_process=True
    )
    yield api.client()
    stop()


def test_run_scores_a_sample_against_its_item(client):
    got = client.fine_tuning.alpha.graders.run(
        grader=EXACT, model_sample="Paris", item={"answer": "Paris"}
    )
    assert got.reward == 1.0
    assert (got.metadata.name, got.metadata.type) == ("exact", "string_check")
    assert got.metadata.scores == {"exact": 1.0}
    assert not got.metadata.errors.sample_parse_error


def test_run_of_a_multi_grader_gives_each_graders_score_and_the_formulas_reward(client):
    multi = {
        "type": "multi", "name": "both", "graders": {"exact": EXACT, "close": CLOSE},
        "calculate_output": "0.5 * exact + 0.5 * close",
    }  # fmt: skip
    got = client.fine_tuning.alpha.graders.run(
        grader=multi, model_sample="Paris France", item={"answer": "Paris"}
    )
    assert got.sub_rewards == {"exact": 0.0, "close": pytest.approx(2 / 3)}
    assert got.reward == pytest.approx(1 / 3)


def test_an_answer_that_is_not_json_is_a_parse_error_scoring_zero(client):
    grader = {**EXACT, "input": "{{sample.output_json.city}}"}
    got = client.fine_tuning.alpha.graders.run(
        grader=grader, model_sample="Paris", item={"answer": "Paris"}
    )
    assert (got.reward, got.metadata.errors.sample_parse_error) == (0.0, True)


def test_validate_returns_the_grader_as_it_will_run(client):
    got = client.fine_tuning.alpha.graders.validate(grader=CLOSE)
    assert got.grader.evaluation_metric == "rouge_1"
    assert got.grader.name == "close"


@pytest.mark.parametrize(
    ("call", "param"),
    [
        (dict(grader={**CLOSE, "evaluation_metric": "cosine"}), "grader.evaluation_metric"),
        (dict(grader={"type": "python", "name": "p", "source": "x"}), "grader.type"),
        (dict(grader=EXACT, model_sample="x", item={"label": "x"}), "item"),
        (dict(grader={**EXACT, "operation": "regex"}, model_sample="x"), "grader.operation"),
    ],
)
def test_refusals_are_400s_naming_the_field(client, call, param):
    graders = client.fine_tuning.alpha.graders
    with pytest.raises(openai.BadRequestError) as e:
        graders.run(**call) if "model_sample" in call else graders.validate(**call)
    assert e.value.body["param"] == param


def test_without_an_embedding_model_embeddings_are_a_404_that_says_so(client):
    with pytest.raises(openai.NotFoundError, match="PSTAR_EMBEDDING_MODEL") as e:
        client.embeddings.create(model="text-embedding-3-small", input="hello")
    assert e.value.body["param"] == "model"


def test_a_python_grader_runs_sandboxed_once_the_operator_turns_them_on(tmp_path):
    from tests.service.test_python_grader import pytestmark as needs_landlock

    if needs_landlock.args[0]:
        pytest.skip(needs_landlock.kwargs["reason"])
    api, stop = start_api(tmp_path, f"sqlite:///{tmp_path / 'store.db'}", "sqlite",
                          python_graders=True)  # fmt: skip
    try:
        source = "def grade(sample, item):\n    open('/etc/hostname')\n    return 1.0"
        grader = {"type": "python", "name": "py", "source": source}
        got = api.client().fine_tuning.alpha.graders.run(grader=grader, model_sample="x")
        assert got.reward == 0.0
        assert got.metadata.errors.python_grader_runtime_error
        assert "PermissionError" in got.metadata.errors.python_grader_runtime_error_details
        fine = {**grader, "source": "def grade(sample, item):\n    return 0.5"}
        again = api.client().fine_tuning.alpha.graders.run(grader=fine, model_sample="x")
        assert again.reward == 0.5
    finally:
        stop()


def test_a_score_model_grader_asks_a_served_model_as_chat_completions_would(client):
    """The grader's greedy question, asked again through /v1/chat/completions, gets the
    same answer: the reward is its first number within the range, or the range's low end
    with a parse error when it has none (the tiny random model's usual answer)."""
    import re

    judge = {
        "type": "score_model", "name": "judge", "model": "tiny-llama", "range": [0, 5],
        "sampling_params": {"max_completions_tokens": 6, "temperature": 0},
        "input": [{"role": "user", "content": "Rate {{sample.output_text}} from 0 to 5."}],
    }  # fmt: skip
    got = client.fine_tuning.alpha.graders.run(grader=judge, model_sample="Paris")
    answer = client.chat.completions.create(
        model="tiny-llama",
        messages=[{"role": "user", "content": "Rate Paris from 0 to 5."}],
        max_tokens=6,
        temperature=0,
    )
    text = answer.choices[0].message.content
    number = re.search(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?", text)
    expected = min(5.0, max(0.0, float(number.group()))) if number else 0.0
    assert got.reward == expected
    assert got.metadata.errors.model_grader_parse_error == (number is None)
    assert got.metadata.sampled_model_name == "tiny-llama"
    assert got.metadata.token_usage == answer.usage.total_tokens
    assert got.model_grader_token_usage_per_model == {"tiny-llama": answer.usage.total_tokens}
    with pytest.raises(openai.NotFoundError):
        client.fine_tuning.alpha.graders.run(grader={**judge, "model": "nope"}, model_sample="x")


def test_a_label_model_grader_gets_one_label_from_a_served_model_by_structured_output(client):
    """The tiny random model answers in free text with no label in it; asked by a
    label_model grader its answer is decoded to the labels' schema, so it names one label
    (the same as chat completions with that response_format, greedy) and scores 1 exactly
    when the label passes, with no parse error."""
    import json

    labels = ["yes", "no", "unsure"]
    grader = {
        "type": "label_model", "name": "tone", "model": "tiny-llama", "labels": labels,
        "input": [{"role": "user", "content": "Is {{sample.output_text}} polite?"}],
    }  # fmt: skip
    schema = {
        "type": "object",
        "properties": {"label": {"type": "string", "enum": labels}},
        "required": ["label"],
        "additionalProperties": False,
    }
    answer = client.chat.completions.create(
        model="tiny-llama",
        messages=[{"role": "user", "content": "Is Thanks polite?"}],
        temperature=0,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "label", "strict": True, "schema": schema},
        },
    )
    label = json.loads(answer.choices[0].message.content)["label"]
    assert label in labels
    for passing in (["yes"], ["no"], ["unsure"]):
        got = client.fine_tuning.alpha.graders.run(
            grader={**grader, "passing_labels": passing}, model_sample="Thanks"
        )
        assert got.reward == float(label in passing)
        assert not got.metadata.errors.model_grader_parse_error
        assert got.metadata.type == "label_model"
    with pytest.raises(openai.BadRequestError) as e:
        client.fine_tuning.alpha.graders.validate(grader={**grader, "passing_labels": ["maybe"]})
    assert e.value.body["param"] == "grader.passing_labels"
