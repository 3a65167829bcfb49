"""The job dashboard in a real browser (Debian's headless Chromium driven by Selenium),
against `pstar serve` on a real local Ray: one finished job and one running, shared by
the module. The page's charts must hold the job's real points (compared with /metrics and
/memory), a metric arriving over the event stream must extend them, a wrong token must be
told so, and another tenant must never see the jobs. Screenshots of the list and the job
pages go to runs/screenshots (or $PSTAR_SCREENSHOT_DIR).

The event stream itself is also tested at the HTTP level: order, resumption with
Last-Event-ID, the end block, and the same auth as every route.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest

from tests.browser import shot as _shot
from tests.browser import sign_in as _sign_in
from tests.browser import wait_page as _wait
from tests.served import (
    RIVAL_TOKEN,
    TOKEN,
    create_job,
    ended,
    start_serve,
    stop_serve,
    upload_chat_files,
    wait_for,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def serve(tmp_path_factory):
    s = start_serve(tmp_path_factory.mktemp("dash"))
    yield s
    stop_serve(s)


@pytest.fixture(scope="module")
def jobs(serve):
    """(finished job id, running job id)."""
    c = serve.client()
    # 512 rows: 64 steps an epoch, so the running job runs for minutes (it is cancelled)
    files = upload_chat_files(serve, train_rows=512)
    # both created at once: the two Ray jobs start side by side (the head has room for
    # both), instead of the second starting only once the first ended
    done = create_job(serve, files, 12, suffix="dash", engine={})  # dtype auto
    running = create_job(serve, files, 5000, suffix="dash")  # cancelled by a test
    finished = ended(serve, done.id, 600)
    assert finished.status == "succeeded", finished.error
    wait_for(lambda: _metrics(serve, running.id, "train_loss"), 300, "the running job's metrics")
    yield done.id, running.id
    if c.fine_tuning.jobs.retrieve(running.id).status == "running":  # a test stopped early
        c.fine_tuning.jobs.cancel(running.id)


def _auth(token: str = TOKEN) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def _metrics(serve, job_id: str, name: str | None = None) -> dict:
    r = httpx.get(f"{serve.url}/v1/fine_tuning/jobs/{job_id}/metrics", headers=_auth())
    r.raise_for_status()
    series = r.json()["series"]
    return series.get(name) if name else series


# -- the event stream over HTTP ------------------------------------------------------------


def _read_stream(serve, job_id: str, headers: dict, params: dict | None = None) -> list[dict]:
    blocks, cur = [], {}
    url = f"{serve.url}/v1/fine_tuning/jobs/{job_id}/events/stream"
    with httpx.stream("GET", url, headers=headers, params=params, timeout=60) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if not line:
                if cur:
                    blocks.append(cur)
                    if cur.get("event") == "end":
                        return blocks
                cur = {}
            elif not line.startswith(":"):
                field, _, value = line.partition(": ")
                cur[field] = value
    return blocks


def test_event_stream_sends_every_event_in_order_then_the_end(serve, jobs):
    done, _ = jobs
    blocks = _read_stream(serve, done, _auth())
    assert blocks[-1]["event"] == "end"
    assert json.loads(blocks[-1]["data"])["status"] == "succeeded"
    events = blocks[:-1]
    seqs = [int(b["id"].removeprefix("ftevent-")) for b in events]
    assert seqs == sorted(seqs)
    assert len(seqs) == len(set(seqs))
    # the same events /events lists (newest first there)
    listed = httpx.get(
        f"{serve.url}/v1/fine_tuning/jobs/{done}/events", params={"limit": 1000}, headers=_auth()
    ).json()["data"]
    assert [b["id"] for b in events] == [e["id"] for e in reversed(listed)]
    steps = [json.loads(b["data"])["data"]["step"] for b in events if b["event"] == "metrics"]
    every = {step for series in _metrics(serve, done).values() for step in series["steps"]}
    assert steps == sorted(every)  # one metrics event per recorded step (step 0: eval only)
    # resumption: after a given event, exactly the later ones
    middle = events[len(events) // 2]["id"]
    resumed = _read_stream(serve, done, {**_auth(), "Last-Event-ID": middle})
    assert [b["id"] for b in resumed[:-1]] == [b["id"] for b in events[len(events) // 2 + 1 :]]
    by_query = _read_stream(serve, done, _auth(), {"after": middle})
    assert [b.get("id") for b in by_query] == [b.get("id") for b in resumed]


def test_event_stream_has_the_api_auth_and_tenancy(serve, jobs):
    done, _ = jobs
    url = f"{serve.url}/v1/fine_tuning/jobs/{done}/events/stream"
    assert httpx.get(url).status_code == 401
    r = httpx.get(url, headers=_auth(RIVAL_TOKEN))
    assert r.status_code == 404
    assert r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.get(url, headers={**_auth(), "Last-Event-ID": "not-an-event"})
    assert r.status_code == 400


# -- the page ------------------------------------------------------------------------------


def _points(chart: dict, name: str) -> tuple[list[int], list[float]]:
    """A plotted series as (steps, values): the page aligns its series on one step axis,
    a step without a value being a gap."""
    pairs = [
        (s, v) for s, v in zip(chart["steps"], chart["series"][name], strict=True) if v is not None
    ]
    return [s for s, _ in pairs], [v for _, v in pairs]


def _same(chart: dict, name: str, want: dict) -> None:
    steps, values = _points(chart, name)
    assert steps == want["steps"], name
    assert values == pytest.approx(want["values"]), name


def test_a_wrong_token_is_told_so(serve, jobs, browser):
    _sign_in(browser, serve, "tok-wrong-0000")
    text = _wait(browser, "return document.querySelector('#signin-error').textContent", "an error")
    assert "not accepted" in text
    assert browser.execute_script("return sessionStorage.getItem('pstar.token')") is None
    _shot(browser, "signin-wrong-token")


def test_the_list_shows_the_tenants_jobs_live(serve, jobs, browser):
    done, running = jobs
    _sign_in(browser, serve, TOKEN)
    rows = _wait(
        browser,
        "const r = [...document.querySelectorAll('#jobs tbody tr')].map(t => t.dataset.job);"
        "return r.length >= 2 ? r : null",
        "the jobs",
    )
    assert done in rows
    assert running in rows
    text = browser.find_element("css selector", "#jobs").text
    assert "succeeded" in text
    assert "running" in text
    assert "tiny-llama" in text
    assert TOKEN not in browser.current_url  # the token is never in a URL
    # the running job's progress cell moves without a reload
    cell = f"document.querySelector('tr[data-job=\"{running}\"] td:nth-child(4)').textContent"
    first = browser.execute_script(f"return {cell}")
    _wait(browser, f"return {cell} !== {json.dumps(first)}", "the progress to move", 120)
    _shot(browser, "jobs-list")


def test_the_job_page_plots_the_jobs_real_points(serve, jobs, browser):
    done, _ = jobs
    _sign_in(browser, serve, TOKEN)
    browser.get(f"{serve.url}/ui/#/jobs/{done}")
    _wait(browser, "return window.pstar.streamState === 'ended'", "the finished job's stream end")
    plotted = browser.execute_script("return window.pstar.plotted")
    series = _metrics(serve, done)
    _same(plotted["loss"], "train_loss", series["train_loss"])
    _same(plotted["loss"], "valid_loss", series["valid_loss"])
    _same(plotted["lr"], "lr", series["lr"])
    _same(plotted["speed"], "tokens_per_second", series["tokens_per_second"])
    tiers = plotted["tiers"]["series"]
    assert tiers, "no model-data series plotted"
    for name in tiers:
        _same(plotted["tiers"], name, series[name])
    moved = plotted["moved"]["series"]
    assert set(moved) == {n for n in series if n.startswith("bytes_moved_")}
    for name in moved:
        _same(plotted["moved"], name, series[name])
    memory = httpx.get(f"{serve.url}/v1/fine_tuning/jobs/{done}/memory", headers=_auth()).json()
    trace = plotted["trace"]
    assert trace["series"]["non_model_bytes"] == memory["non_model_bytes"]
    assert trace["series"]["chunk_bytes"] == memory["chunk_bytes"]
    assert trace["names"] == memory["names"]
    assert len(trace["moments"]) == memory["moments"] > 0
    page = browser.find_element("css selector", "#main").text
    assert "succeeded" in page
    assert "Checkpoints" in page
    rows = browser.find_elements("css selector", "#checkpoints tbody tr")
    assert len(rows) >= 1
    assert browser.find_elements("css selector", "#events li")  # status changes and so on
    assert not browser.find_element("css selector", "#cancel").is_displayed()
    ray = browser.find_element("css selector", "#ray-link").get_attribute("href")
    job = serve.client().fine_tuning.jobs.retrieve(done)
    assert ray.endswith(f"/#/jobs/{job.ray_submission_id}")
    # the compute dtype 'auto' became on the workers, shown on the page
    runtime = job.model_extra["hyperparameters_resolved"]["runtime"]
    assert runtime["compute_dtype"] in ("fp32", "bf16")
    facts = browser.find_element("css selector", "#job-facts").text
    assert f"dtype {runtime['compute_dtype']} (auto, {runtime['cpu_capability']}" in facts
    assert _charts_per_card(browser) == [1] * 7
    # the capacity planner's plan of the job, written by its driver, on the page
    plan = job.model_extra["memory_plan"]
    assert plan["fits"] is True
    assert plan["per_rank"]["workers"] == 2
    assert "Fits: 2 rank(s)" in browser.find_element("css selector", "#plan-verdict").text
    shown = browser.find_elements("css selector", "#plan-lists tbody tr")
    lists = {k for k, row in plan["per_rank"]["lists_at_start"].items() if sum(row.values())}
    assert {r.get_attribute("data-list") for r in shown} == lists
    iteration = browser.find_element("css selector", "#plan-iteration").text
    assert "an iteration needs at least" in iteration
    _shot(browser, "job-finished")


def _charts_per_card(browser) -> list[int]:
    return browser.execute_script(
        "return [...document.querySelectorAll('[id^=chart-]')]"
        ".map((e) => e.querySelectorAll('.uplot').length)"
    )


def test_two_renders_of_a_job_page_that_overlap_draw_each_chart_once(serve, jobs, browser):
    """A second route() while the first render still awaits the API (a sign-in finishing
    as the address changes did it): every chart was drawn twice into the page."""
    done, _ = jobs
    _sign_in(browser, serve, TOKEN)
    browser.get(f"{serve.url}/ui/#/jobs/{done}")
    _wait(browser, "return window.pstar.streamState === 'ended'", "the finished job's stream end")
    browser.execute_script(
        "window.dispatchEvent(new HashChangeEvent('hashchange'));"
        "window.dispatchEvent(new HashChangeEvent('hashchange'));"
    )
    _wait(browser, "return window.pstar.streamState === 'ended'", "the stream end, again")
    assert _charts_per_card(browser) == [1] * 7


def test_pause_and_resume_buttons_pause_the_running_job_and_resume_it(serve, jobs, browser):
    # before the try-it box's test: the resumed job's new attempt starts while Ray Serve
    # deploys the models there, and trains again by the live-chart test after it
    _, running = jobs
    c = serve.client()
    _sign_in(browser, serve, TOKEN)
    browser.get(f"{serve.url}/ui/#/jobs/{running}")
    _wait(browser, "return window.pstar.streamState === 'live'", "the live stream")
    assert "method supervised" in browser.find_element("css selector", "#job-method").text
    assert not browser.find_element("css selector", "#resume").is_displayed()
    browser.find_element("css selector", "#pause").click()
    _wait(
        browser,
        "return document.querySelector('#job-status').textContent === 'paused'",
        "the paused status",
        120,
    )
    assert c.fine_tuning.jobs.retrieve(running).status == "paused"
    assert not browser.find_element("css selector", "#pause").is_displayed()
    _shot(browser, "job-paused")
    browser.find_element("css selector", "#resume").click()
    _wait(
        browser,
        "return ['queued', 'running'].includes(document.querySelector('#job-status').textContent)",
        "the resumed job queued",
        60,
    )
    assert c.fine_tuning.jobs.retrieve(running).status in ("queued", "running")
    assert browser.find_element("css selector", "#pause").is_displayed()


def test_a_metric_arriving_over_the_stream_extends_the_chart_and_cancel_asks_first(
    serve, jobs, browser
):
    _, running = jobs
    _sign_in(browser, serve, TOKEN)
    browser.get(f"{serve.url}/ui/#/jobs/{running}")
    _wait(browser, "return window.pstar.streamState === 'live'", "the live stream")
    first = browser.execute_script("return window.pstar.plotted.loss.steps.length")
    _wait(
        browser,
        f"return window.pstar.plotted.loss.steps.length > {first}",
        "a new point on the loss chart",
        180,
    )
    steps, values = _points(
        browser.execute_script("return window.pstar.plotted.loss"), "train_loss"
    )
    want = _metrics(serve, running, "train_loss")
    n = len(steps)
    assert n > 0
    assert steps == want["steps"][:n]
    assert values == pytest.approx(want["values"][:n])
    _shot(browser, "job-running")
    # cancel asks first (once): dismissing keeps the job running
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    browser.find_element("css selector", "#cancel").click()
    alert = WebDriverWait(browser, 10).until(ec.alert_is_present())
    assert "Cancel" in alert.text
    alert.dismiss()
    WebDriverWait(browser, 10).until_not(ec.alert_is_present())
    assert serve.client().fine_tuning.jobs.retrieve(running).status == "running"
    browser.find_element("css selector", "#cancel").click()
    WebDriverWait(browser, 10).until(ec.alert_is_present()).accept()
    _wait(
        browser,
        "return document.querySelector('#job-status').textContent === 'cancelled'",
        "the cancelled status",
        120,
    )
    assert serve.client().fine_tuning.jobs.retrieve(running).status == "cancelled"


# after the running job is cancelled (above): serving the fine-tuned model is not slowed
# by training beside it on this machine's cores
def test_try_it_box_asks_the_fine_tuned_model_and_its_base_side_by_side(serve, jobs, browser):
    """The box streams both answers from /v1/chat/completions (Ray Serve deploys the two
    models on this first request); each equals the API's own greedy answer."""
    done, _ = jobs
    job = serve.client().fine_tuning.jobs.retrieve(done)
    _sign_in(browser, serve, TOKEN)
    browser.get(f"{serve.url}/ui/#/jobs/{done}")
    _wait(browser, "return !document.querySelector('#try').hidden", "the try-it box")
    ask = "What does apple mean?"
    browser.find_element("css selector", "#try-prompt").send_keys(ask)
    browser.find_element("css selector", "#try-ask").click()
    _wait(
        browser,
        "return ['#try-ft', '#try-base'].every((s) => document.querySelector(s).dataset.done)",
        "both answers",
        240,
    )
    shown = browser.execute_script(
        "return ['#try-ft', '#try-base'].map((s) => document.querySelector(s).textContent)"
    )
    for model, text in zip((job.fine_tuned_model, job.model), shown, strict=True):
        want = serve.client().chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": ask}],
            max_tokens=128,
            temperature=0,
        )
        assert text == want.choices[0].message.content
    assert not browser.find_elements("css selector", ".answer.error")
    _wait(
        browser,
        "return document.querySelector('#try-where').textContent.startsWith('in memory')",
        "where the model is loaded",
        30,
    )
    _shot(browser, "job-try")
    # the list page says which models are in memory, and where
    browser.get(f"{serve.url}/ui/#/")
    _wait(
        browser,
        "return document.querySelectorAll('#served tbody tr').length >= 2",
        "the models in memory",
        30,
    )
    rows = [r.text for r in browser.find_elements("css selector", "#served tbody tr")]
    assert any(r.startswith(job.fine_tuned_model) for r in rows)
    assert any(r.startswith(f"{job.model} ") for r in rows)
    _shot(browser, "served-models")


def test_another_tenant_never_sees_the_jobs(serve, jobs, browser):
    done, running = jobs
    _sign_in(browser, serve, RIVAL_TOKEN)
    _wait(browser, "return !!document.querySelector('#jobs')", "the list")
    time.sleep(1)
    text = browser.find_element("css selector", "#main").text
    assert done not in text
    assert running not in text
    browser.get(f"{serve.url}/ui/#/jobs/{done}")
    heading = _wait(
        browser,
        "const h = document.querySelector('#main h1'); "
        "return h && h.textContent !== '' && h.id !== 'job-id' ? h.textContent : null",
        "the job page's answer",
    )
    assert heading == "No such job"
    page = browser.find_element("css selector", "#main").text
    assert "tiny-llama" not in page  # nothing of the job: no model, status or numbers
    assert "succeeded" not in page
    assert browser.execute_script("return Object.keys(window.pstar.charts).length") == 0
    _shot(browser, "rival-job-page")


def test_the_offline_png_draws_what_the_page_plots(serve, jobs, browser, tmp_path):
    from typer.testing import CliRunner

    from pstar.cli import app
    from service.tools.plot_trace import memory_stats

    done, _ = jobs
    _sign_in(browser, serve, TOKEN)
    browser.get(f"{serve.url}/ui/#/jobs/{done}")
    _wait(browser, "return !!(window.pstar.plotted.trace)", "the trace chart")
    page = browser.execute_script("return window.pstar.plotted.trace")
    memory = httpx.get(f"{serve.url}/v1/fine_tuning/jobs/{done}/memory", headers=_auth()).json()
    tracer = memory_stats(memory)["tracer"]
    assert tracer["names"] == page["names"]
    assert tracer["non_model_bytes"] == page["series"]["non_model_bytes"]
    assert tracer["chunk_bytes"] == page["series"]["chunk_bytes"]
    out = tmp_path / "trace.png"
    env = {"PSTAR_API_TOKEN": TOKEN}
    args = ["jobs", "plot-trace", done, "--out", str(out), "--url", serve.url]
    result = CliRunner().invoke(app, args, env=env)
    assert result.exit_code == 0, result.output
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
