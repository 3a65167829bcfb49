"""The store down under a running API: a 503 in OpenAI's envelope that says to retry (never
a 500), and the same requests answered again once the store is back, with nothing lost."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.api.conftest import start_api


@pytest.fixture
def outage_api(tmp_path):
    from service.tools.pg_local import PgServer

    pg = PgServer.start(tmp_path / "pg")
    server, stop = start_api(tmp_path / "data", pg.url, "postgres")
    yield server, pg
    stop()
    pg.stop()


def test_while_the_store_is_down_requests_get_a_503_to_retry_and_after_it_the_same_answers(
    outage_api,
):
    api, pg = outage_api
    c = api.client()
    f = c.files.create(file=("t.jsonl", b'{"text": "hello there"}\n'), purpose="fine-tune")
    job = c.fine_tuning.jobs.create(model="tiny-llama", training_file=f.id)
    pg.halt()
    try:
        for path in ("/v1/fine_tuning/jobs", f"/v1/fine_tuning/jobs/{job.id}", "/v1/files"):
            r = httpx.get(api.url + path, headers=api.headers(), timeout=30)
            assert r.status_code == 503, (path, r.text)
            assert r.headers["Retry-After"] == "5"
            err = r.json()["error"]
            assert (err["type"], err["code"]) == ("service_unavailable", "store_unavailable")
            assert "retry" in err["message"]
        with pytest.raises(openai.InternalServerError) as got:
            c.fine_tuning.jobs.create(model="tiny-llama", training_file=f.id)
        assert got.value.status_code == 503
    finally:
        pg.resume()
    # the pool's dead connections are replaced: the next requests see what was there
    assert [j.id for j in c.fine_tuning.jobs.list()] == [job.id]
    assert c.fine_tuning.jobs.retrieve(job.id).id == job.id
