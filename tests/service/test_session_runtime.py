"""service/sessions/runtime: a model's requests run in the order of their seq_id whatever
order they arrive in, one at a time; a request sent again gets the first one's future."""

from __future__ import annotations

import threading

import pytest

from service.errors import Gone, InvalidRequest, NotFound
from service.sessions.model import Ordered


def test_requests_run_in_seq_order_whatever_order_they_arrive_in():
    runner = Ordered("t", first=1)
    ran: list[int] = []
    gate = threading.Event()

    def job(n):
        def fn():
            gate.wait(5)
            ran.append(n)
            return n * 10

        return fn

    futures = {n: runner.submit(n, job(n)) for n in (3, 1, 4, 2)}
    again = runner.submit(3, job(99))  # a retry of seq 3: the same future, not a new run
    assert again is futures[3]
    gate.set()
    assert [futures[n].result(timeout=5) for n in (1, 2, 3, 4)] == [10, 20, 30, 40]
    assert ran == [1, 2, 3, 4]
    with pytest.raises(InvalidRequest, match="comes before this model's next"):
        runner.submit(0, job(0))
    runner.close()


def test_a_failing_request_fails_its_future_and_the_next_still_runs():
    runner = Ordered("t", first=0)

    def boom():
        raise ValueError("bad")

    first, second = runner.submit(0, boom), runner.submit(1, lambda: "ok")
    with pytest.raises(ValueError, match="bad"):
        first.result(timeout=5)
    assert second.result(timeout=5) == "ok"
    runner.close()


def test_a_tenant_holds_at_most_its_models_and_an_idle_session_frees_them(tmp_path):
    import time

    from service.errors import QuotaExceeded
    from service.sessions.runtime import Sessions
    from service.settings import Limits, Settings
    from tests.tiny import make_tiny_llama

    limits = Limits(max_session_models_per_tenant=1, session_idle_s=60)
    settings = Settings(data_dir=tmp_path, db_url="sqlite://", tokens={}, limits=limits)
    settings.ensure_dirs()
    make_tiny_llama(settings.models_dir / "tiny-llama")
    s = Sessions(settings, engine={"dtype": "fp32"})
    first = s.create_session("acme")
    rid = s.create_model("acme", first, 0, "tiny-llama", {"rank": 2})
    assert s.future("acme", rid).future.result(timeout=60) == {
        "model_id": f"{first}:train:0",
        "type": "create_model",
    }
    with pytest.raises(QuotaExceeded, match=r"holds 1 training models.*=1"):
        s.create_model("acme", first, 1, "tiny-llama", {"rank": 2})
    other = s.create_session("rival")  # another tenant has its own count
    s.create_model("rival", other, 0, "tiny-llama", {"rank": 2})
    # an hour without a heartbeat: the idle sessions end and their models are freed
    assert sorted(s.end_idle(now=time.time() + 3600)) == sorted([first, other])
    assert s.models == {}
    again = s.create_session("acme")
    s.create_model("acme", again, 0, "tiny-llama", {"rank": 2})
    # an ended session's heartbeat is a 410 (the SDK stops its loop on it), naming how it
    # ended; finishing it again changes nothing; to another tenant it was never there
    with pytest.raises(Gone, match=r"has ended after 60 s without a heartbeat or request") as e:
        s.session("acme", first)
    assert e.value.code == "session_ended"
    s.finish("acme", first)
    with pytest.raises(Gone, match="without a heartbeat or request"):
        s.session("acme", first)
    with pytest.raises(NotFound):
        s.session("rival", first)
    with pytest.raises(NotFound):
        s.finish("rival", first)
    with pytest.raises(NotFound):  # and another tenant's live session is not found either
        s.session("rival", again)
    s.finish("acme", again)
    with pytest.raises(Gone, match="has been finished by its client"):
        s.session("acme", again)


def test_a_models_engines_count_toward_the_tenants_running_workers_beside_its_jobs(tmp_path):
    """PSTAR_MAX_RUNNING_WORKERS_PER_TENANT covers jobs and session engines together: with
    14 of 16 workers in jobs, one engine fits, a second too, a third is a 429 that names
    both counts; a create sent again still gets its model; another tenant is apart."""
    from service.errors import QuotaExceeded
    from service.sessions.runtime import Sessions
    from service.settings import Limits, Settings
    from tests.tiny import make_tiny_llama

    limits = Limits(max_session_models_per_tenant=8, max_running_workers_per_tenant=16)
    settings = Settings(data_dir=tmp_path, db_url="sqlite://", tokens={}, limits=limits)
    settings.ensure_dirs()
    make_tiny_llama(settings.models_dir / "tiny-llama")
    in_jobs = {"acme": 14}
    s = Sessions(settings, engine={"dtype": "fp32"}, job_workers=lambda t: in_jobs.get(t, 0))
    sid = s.create_session("acme")
    first = s.create_model("acme", sid, 0, "tiny-llama", {"rank": 2})
    s.create_model("acme", sid, 1, "tiny-llama", {"rank": 2})
    assert s.workers_held() == {"acme": 2}
    with pytest.raises(
        QuotaExceeded,
        match=r"runs 16 workers \(14 in fine-tuning jobs, 2 in "
        r"training sessions\).*PSTAR_MAX_RUNNING_WORKERS_PER_TENANT=16",
    ) as e:
        s.create_model("acme", sid, 2, "tiny-llama", {"rank": 2})
    assert e.value.code == "too_many_workers"
    assert s.create_model("acme", sid, 0, "tiny-llama", {"rank": 2}) == first
    other = s.create_session("rival")
    s.create_model("rival", other, 0, "tiny-llama", {"rank": 2})
    in_jobs["acme"] = 13  # a job ended
    s.create_model("acme", sid, 2, "tiny-llama", {"rank": 2})
    assert s.workers_held() == {"acme": 3, "rival": 1}
    s.close()


def test_a_session_whose_heartbeats_stop_ends_sooner_than_one_that_never_sent_any(tmp_path):
    """The SDK beats every 10 s: for a session it made (its create names an
    sdk_version), silence for session_lost_s means its process is gone; any other client
    has session_idle_s between requests or beats. Either keeps a session alive."""
    import time

    from service.sessions.runtime import Sessions
    from service.settings import Limits, Settings

    limits = Limits(session_idle_s=600, session_lost_s=120)
    settings = Settings(data_dir=tmp_path, db_url="sqlite://", tokens={}, limits=limits)
    settings.ensure_dirs()
    s = Sessions(settings)
    sdk, raw = s.create_session("acme", beating=True), s.create_session("acme")
    s.session("acme", raw)  # a client of its own that beats now and then: idle rules
    now = time.time()
    assert s.end_idle(now=now + 100) == []
    assert s.end_idle(now=now + 130) == [sdk]
    with pytest.raises(Gone, match="ended after 120 s without heartbeats"):
        s.session("acme", sdk)
    assert s.end_idle(now=now + 590) == []
    s.session("acme", raw)  # a request: heard from again
    heard = time.time()
    assert s.end_idle(now=heard + 590) == []
    assert s.end_idle(now=heard + 601) == [raw]


def test_a_create_sent_again_gets_the_same_model_even_after_its_result_was_dropped(tmp_path):
    from service.sessions import runtime
    from service.sessions.runtime import Sessions
    from service.settings import Settings
    from tests.tiny import make_tiny_llama

    settings = Settings(data_dir=tmp_path, db_url="sqlite://", tokens={})
    settings.ensure_dirs()
    make_tiny_llama(settings.models_dir / "tiny-llama")
    s = Sessions(settings, engine={"dtype": "fp32"})
    sid = s.create_session("acme")
    rid = s.create_model("acme", sid, 0, "tiny-llama", {"rank": 2})
    assert s.create_model("acme", sid, 0, "tiny-llama", {"rank": 2}) == rid
    s.future("acme", rid).future.result(timeout=60)
    s.retrieved(rid)
    s.pending[rid].retrieved_at -= runtime.KEEP_READ_S + 1
    s._sweep()
    assert rid not in s.pending
    again = s.create_model("acme", sid, 0, "tiny-llama", {"rank": 2})
    assert s.future("acme", again).future.result(timeout=5)["model_id"] == f"{sid}:train:0"
    assert len(s.models) == 1


def test_models_on_a_dead_head_fail_at_once_and_new_ones_wait_for_the_next_head(
    tmp_path, monkeypatch
):
    """While the embedded head is started again: a lost model's requests fail at once
    saying to start again from a saved state (a local engine is not touched); a new model
    waits for the new head's hosts, and past the wait is refused saying why."""
    from service.errors import Unavailable
    from service.sessions import runtime
    from service.sessions.hosts import Lost, local_hosts
    from service.sessions.runtime import Sessions
    from service.settings import Limits, Settings
    from tests.tiny import make_tiny_llama

    limits = Limits(max_session_models_per_tenant=4)
    settings = Settings(data_dir=tmp_path, db_url="sqlite://", tokens={}, limits=limits)
    settings.ensure_dirs()
    make_tiny_llama(settings.models_dir / "tiny-llama")
    made: list[str] = []

    class Remote(Lost):  # a host on a Ray cluster, as RayHost is
        name = "session-engine x"

        def build(self) -> None:
            self._check()

        def forward_backward(self, *a):
            self._check()

        def close(self) -> None:
            pass

    def hosts(spec):
        made.append(spec.id)
        return (Remote() if len(made) == 1 else local_hosts(spec)[0]), "here"

    s = Sessions(settings, engine={"dtype": "fp32"}, hosts=hosts)
    sid = s.create_session("acme")
    for k in range(2):
        rid = s.create_model("acme", sid, k, "tiny-llama", {"rank": 2})
        s.future("acme", rid).future.result(timeout=60)
    assert s.lose_engines("their Ray head died") == [f"{sid}:train:0"]  # not the local one
    with pytest.raises(Unavailable, match=r"is gone \(their Ray head died\); create the"):
        s.models[f"{sid}:train:0"].host.forward_backward([], "cross_entropy", {}, True)
    s.hosts_moving()
    monkeypatch.setattr(runtime, "HOSTS_WAIT_S", 0.2)
    with pytest.raises(Unavailable, match="still being started again after 0 s"):
        s.create_model("acme", sid, 2, "tiny-llama", {"rank": 2})
    s.hosts_moved(None)
    s.create_model("acme", sid, 2, "tiny-llama", {"rank": 2})
    assert made == [f"{sid}:train:{k}" for k in range(3)]
    s.close()


def test_session_engines_reconnect_when_their_ray_cluster_moved(monkeypatch):
    """A Ray connection made for session engines is kept while the address stays; when the
    hosts are made for another address (the embedded head started again, on new ports)
    the old connection is shut and a new one made there."""
    import ray

    from service.sessions import hosts

    calls: list[tuple[str, ...]] = []
    up = {"now": False}

    def init(address, **_):
        calls.append(("init", address))
        up["now"] = True

    def shutdown():
        calls.append(("shutdown",))
        up["now"] = False

    monkeypatch.setattr(ray, "is_initialized", lambda: up["now"])
    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "shutdown", shutdown)
    monkeypatch.setattr(hosts, "RayHost", lambda spec, options: type("H", (), {"name": "h"})())
    monkeypatch.setitem(hosts._connected, "address", None)
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    spec = hosts.ModelSpec("s:train:0", "tiny", None, 2, ("q_proj",), {})
    first = hosts.RayHosts("ray://127.0.0.1:1111", {})
    first(spec)
    first(spec)
    assert calls == [("init", "ray://127.0.0.1:1111")]
    hosts.RayHosts("ray://127.0.0.1:2222", {})(spec)
    assert calls[1:] == [("shutdown",), ("init", "ray://127.0.0.1:2222")]


def test_the_apps_session_engines_follow_the_embedded_head_to_its_new_ports(tmp_path, monkeypatch):
    """When the reconciler finds the embedded head gone, the supervisor starts another; the
    app then makes session engines' hosts for the new head's client address, and leaves an
    operator's own address alone."""
    from dataclasses import replace

    from fastapi.testclient import TestClient

    from api.app import create_app
    from service.control.launcher import DryLauncher
    from service.sessions import hosts
    from service.settings import Settings
    from service.store import Store

    made: list[str | None] = []
    monkeypatch.setattr(hosts, "RayHosts", lambda address, options: made.append(address))

    class Head:
        def __init__(self) -> None:
            self.info = {"client_address": "ray://127.0.0.1:1111"}

        def running(self) -> bool:
            return False  # it died: the supervisor starts another

    class Supervisor:
        def __init__(self) -> None:
            self.head = Head()

        def __call__(self) -> None:  # the head started again, on other ports
            self.head.info = {"client_address": "ray://127.0.0.1:2222"}

    for given, expected in (
        ("ray://127.0.0.1:1111", ["ray://127.0.0.1:1111", "ray://127.0.0.1:2222"]),
        ("ray://10.0.0.5:10001", ["ray://10.0.0.5:10001"]),  # the operator's: kept
    ):
        made.clear()
        db = tmp_path / f"{len(given)}-{given[-4:]}.db"
        settings = Settings(data_dir=tmp_path, db_url=f"sqlite:///{db}", tokens={"t": "a"})
        settings = replace(settings, session_engines="ray", session_ray_address=given)
        settings.ensure_dirs()
        store = Store(settings.db_url)
        store.migrate()
        app = create_app(
            settings, store, DryLauncher(), reconcile=True, reconcile_interval_s=60,
            ray_supervisor=Supervisor(),
        )  # fmt: skip
        with TestClient(app):
            app.state.ctx.reconciler.on_ray_down()
        store.close()
        assert made == expected
