"""The embedding model (service/serving/embeddings.py) and the `cosine` text-similarity
grader it serves: embeddings equal the mean of the encoder's last hidden states computed
with transformers alone, the window refuses or cuts, and cosine scores are the angle's
cosine between those independent embeddings."""

from __future__ import annotations

import httpx
import pytest
import torch

from service.errors import InvalidRequest
from service.methods.graders import Runners, grade, grade_all, parse_grader
from service.serving.embeddings import Embedder, shortened
from tests.tiny import make_tiny_embedder

COSINE = {
    "type": "text_similarity", "name": "near", "evaluation_metric": "cosine",
    "input": "{{sample.output_text}}", "reference": "{{item.answer}}",
}  # fmt: skip


@pytest.fixture(scope="module")
def embedder(tmp_path_factory):
    return Embedder(make_tiny_embedder(tmp_path_factory.mktemp("emb") / "tiny-embedder"))


def by_hand(embedder: Embedder, texts: list[str], window: int | None = None) -> list[torch.Tensor]:
    """Each text's embedding from transformers alone: the BERT's last hidden states over
    the text's tokens (the first `window`), averaged, made unit length."""
    from transformers import AutoTokenizer, BertModel

    raw = embedder.path.with_name(embedder.path.name + "-bert")
    tok, model = AutoTokenizer.from_pretrained(raw), BertModel.from_pretrained(raw).eval()
    out = []
    for text in texts:
        ids = tok(text, truncation=window is not None, max_length=window, return_tensors="pt")
        with torch.no_grad():
            hidden = model(**ids).last_hidden_state[0]
        mean = hidden.mean(0)
        out.append(mean / mean.norm())
    return out


def test_embeddings_are_the_encoders_mean_pooled_states_made_unit_length(embedder):
    texts = ["apple bread", "a river of silver thunder", "meadow"]
    got = embedder.embed(texts)
    want = by_hand(embedder, texts)
    for v, w in zip(got.vectors, want, strict=True):
        assert len(v) == 32
        torch.testing.assert_close(torch.tensor(v), w, atol=1e-5, rtol=1e-5)
    # usage counts each text's tokens with [CLS] and [SEP]
    assert got.tokens == sum(embedder.lengths(texts)) == sum(len(t.split()) + 2 for t in texts)


def test_a_text_over_the_window_is_refused_naming_it_or_cut_to_the_window(embedder):
    long = "apple " * 40  # 42 tokens, the window 24
    with pytest.raises(InvalidRequest, match=r"input\[1\]: 42 tokens, over .* window of 24"):
        embedder.embed(["bread", long])
    got = embedder.embed(["bread", long], truncate=True)
    assert got.tokens == 3 + 24
    torch.testing.assert_close(
        torch.tensor(got.vectors[1]), by_hand(embedder, [long], window=24)[0], atol=1e-5, rtol=1e-5
    )
    with pytest.raises(InvalidRequest, match=r"input\[0\]: the text is empty"):
        embedder.embed(["", "bread"])
    with pytest.raises(InvalidRequest, match="at least one text"):
        embedder.embed([])


def test_shortened_keeps_the_first_values_at_unit_length():
    got = shortened([3.0, 4.0, 12.0], 2)
    assert got == pytest.approx([0.6, 0.8])


def test_cosine_needs_a_configured_embedding_model_and_is_checked_otherwise_alike():
    with pytest.raises(InvalidRequest, match="PSTAR_EMBEDDING_MODEL") as e:
        parse_grader(COSINE)
    assert e.value.param == "grader.evaluation_metric"
    assert parse_grader(COSINE, embeddings=True).evaluation_metric == "cosine"
    with pytest.raises(InvalidRequest, match="is not a variable"):
        parse_grader({**COSINE, "reference": "{{answer}}"}, embeddings=True)


def test_cosine_scores_the_angle_between_independent_embeddings(embedder):
    grader = parse_grader(COSINE, embeddings=True)
    run = Runners(embed=lambda texts: embedder.embed(texts, truncate=True).vectors)
    samples, items = ["apple bread", "thunder", "apple bread"], [{"answer": "apple cloud"}] * 3
    got = grade_all(grader, samples, items, run)
    for s, g in zip(samples, got, strict=True):
        a, b = by_hand(embedder, [s, "apple cloud"])
        assert g.reward == pytest.approx(float(a @ b), abs=1e-5)
    assert got[0].reward == got[2].reward  # deterministic
    assert grade(grader, "apple cloud", items[0], run).reward == pytest.approx(1.0, abs=1e-6)
    # an empty side has nothing to embed: 1 against an empty one, else 0
    assert grade(grader, "", {"answer": ""}, run).reward == 1.0
    assert grade(grader, "  ", {"answer": "apple"}, run).reward == 0.0
    # and within a multi grader's formula
    multi = parse_grader(
        {"type": "multi", "name": "m", "graders": {"near": COSINE},
         "calculate_output": "2 * near"},
        embeddings=True,
    )  # fmt: skip
    assert grade(multi, "thunder", items[0], run).reward == pytest.approx(2 * got[1].reward)


def test_a_jobs_embedder_asks_the_api_with_truncation_and_fails_saying_why():
    from service.methods.api_client import GraderModelError, api_embedder

    seen = []

    def answer(request: httpx.Request) -> httpx.Response:
        import json

        body = json.loads(request.content)
        seen.append((request.url.path, request.headers["authorization"], body))
        if body["input"] == ["bad"]:
            return httpx.Response(400, json={"error": {"message": "input: the text is empty"}})
        data = [{"index": i, "embedding": [float(i), 1.0]} for i in range(len(body["input"]))]
        return httpx.Response(200, json={"data": data[::-1]})  # any order: by index

    embed = api_embedder("http://api.test", "tml-k", "tiny", transport=httpx.MockTransport(answer))
    assert embed(["a", "b"]) == [[0.0, 1.0], [1.0, 1.0]]
    path, auth, body = seen[0]
    assert (path, auth) == ("/v1/embeddings", "Bearer tml-k")
    assert body == {
        "model": "tiny",
        "input": ["a", "b"],
        "encoding_format": "float",
        "truncate": True,
    }
    with pytest.raises(GraderModelError, match=r"embedding model tiny did not answer.*400"):
        embed(["bad"])
