"""`POST /v1/embeddings` through the unmodified OpenAI SDK (which asks for base64 unless
told otherwise), and the `cosine` grader of `/graders/run` on the same embeddings."""

from __future__ import annotations

import math

import httpx
import openai
import pytest

from tests.api.conftest import api_in_process
from tests.service.test_embeddings import COSINE, by_hand
from tests.tiny import make_tiny_embedder

MODEL = "tiny-embedder"


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    embedder = make_tiny_embedder(tmp_path_factory.mktemp("emb") / MODEL)
    with api_in_process(tmp_path_factory, "embeddings", embedding_model=embedder) as server:
        yield server


def test_the_sdk_gets_each_texts_embedding_in_order_as_floats_or_base64(api):
    c = api.client()
    texts = ["apple bread", "a river of silver thunder", "meadow"]
    packed = c.embeddings.create(model=MODEL, input=texts)  # base64 on the wire
    plain = c.embeddings.create(model=MODEL, input=texts, encoding_format="float")
    want = by_hand(api.ctx.embedder, texts)
    assert packed.model == plain.model == MODEL
    assert [d.index for d in packed.data] == [0, 1, 2]
    for a, b, w in zip(packed.data, plain.data, want, strict=True):
        assert a.embedding == pytest.approx(b.embedding, abs=1e-7)  # float32 on the wire
        assert b.embedding == pytest.approx(w.tolist(), abs=1e-5)
    # usage: the texts' tokens, [CLS] and [SEP] each
    assert packed.usage.prompt_tokens == packed.usage.total_tokens == 4 + 7 + 3
    one = c.embeddings.create(model=MODEL, input="meadow", encoding_format="float")
    assert one.data[0].embedding == pytest.approx(plain.data[2].embedding, abs=1e-6)


def test_dimensions_keep_the_first_values_made_unit_length(api):
    c = api.client()
    full = c.embeddings.create(model=MODEL, input="apple", encoding_format="float")
    short = c.embeddings.create(model=MODEL, input="apple", dimensions=8, encoding_format="float")
    head = full.data[0].embedding[:8]
    norm = math.sqrt(sum(x * x for x in head))
    assert short.data[0].embedding == pytest.approx([x / norm for x in head], abs=1e-6)
    with pytest.raises(openai.BadRequestError, match=r"dimensions: 64 is more than .* 32") as e:
        c.embeddings.create(model=MODEL, input="apple", dimensions=64)
    assert e.value.body["param"] == "dimensions"


@pytest.mark.parametrize(
    ("call", "status", "says", "param"),
    [
        (dict(model="nope", input="a"), 404, "embedding model here is 'tiny-embedder'", "model"),
        (dict(model=MODEL, input=[1, 2, 3]), 400, "token ids are not taken", "input"),
        (dict(model=MODEL, input=["a", ""]), 400, r"input\[1\] is empty", "input"),
        (dict(model=MODEL, input="apple " * 40), 400, "42 tokens, over .* window of 24", "input"),
        (dict(model=MODEL, input=[]), 400, "at least one text", "input"),
    ],
)
def test_refusals_name_the_field_and_say_what_to_do(api, call, status, says, param):
    with pytest.raises(openai.APIStatusError, match=says) as e:
        api.client().embeddings.create(**call)
    assert e.value.status_code == status
    assert e.value.body["param"] == param


def test_truncate_embeds_a_long_texts_first_window_of_tokens(api):
    long = "apple " * 40
    got = api.client().embeddings.create(
        model=MODEL, input=long, encoding_format="float", extra_body={"truncate": True}
    )
    assert got.usage.total_tokens == 24
    want = by_hand(api.ctx.embedder, [long], window=24)[0]
    assert got.data[0].embedding == pytest.approx(want.tolist(), abs=1e-5)


def test_a_cosine_grader_scores_the_cosine_of_the_served_embeddings(api):
    c = api.client()
    got = c.fine_tuning.alpha.graders.run(
        grader=COSINE, model_sample="apple bread", item={"answer": "silver thunder"}
    )
    a, b = c.embeddings.create(
        model=MODEL, input=["apple bread", "silver thunder"], encoding_format="float"
    ).data
    want = sum(x * y for x, y in zip(a.embedding, b.embedding, strict=True))  # unit length
    assert got.reward == pytest.approx(want, abs=1e-5)
    assert got.metadata.scores == {"near": pytest.approx(want, abs=1e-5)}
    assert c.fine_tuning.alpha.graders.validate(grader=COSINE).grader.evaluation_metric == "cosine"


def test_another_tenants_key_embeds_and_no_key_does_not(api):
    ok = httpx.post(
        f"{api.base}/embeddings", headers=api.headers("rival"), json={"model": MODEL, "input": "a"}
    )
    assert ok.status_code == 200
    none = httpx.post(f"{api.base}/embeddings", json={"model": MODEL, "input": "a"})
    assert none.status_code == 401
