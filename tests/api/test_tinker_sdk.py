"""Training sessions through the unmodified `tinker` SDK (0.38.0) at our base_url: the
server's capabilities, a LoRA training client on the tiny Llama (its step-0 logprobs
against transformers'), forward_backward and optim_step in the SDK's order; tenants
apart; what is refused. (The losses and AdamW against plain PyTorch:
tests/service/test_session_losses.py and tests/core/test_engine.py.)"""

from __future__ import annotations

import itertools

import pytest
import tinker
import torch

from pstar_core.hf import load_causal_lm
from tests.api.conftest import TINKER_TOKENS, start_api


@pytest.fixture(scope="module")
def server(tmp_path_factory, monkeypatch_module):
    data_dir = tmp_path_factory.mktemp("tinker")
    from service.settings import Limits

    # the tests here hold a few models at once (the limit itself: test_session_runtime)
    limits = Limits(max_session_models_per_tenant=32)
    api, stop = start_api(data_dir, f"sqlite:///{data_dir / 'store.db'}", "sqlite", limits=limits)
    api.ctx.sessions.engine_defaults["dtype"] = "fp32"  # compared with transformers in fp32
    yield api
    sessions = api.ctx.sessions
    sessions.create_session("acme")  # one the SDK has not finished
    stop()
    assert sessions.sessions == {}  # the app's shutdown ended it
    assert sessions.models == {}


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    mp.setenv("TINKER_TELEMETRY", "0")
    yield mp
    mp.undo()


def client(server, tenant: str = "acme"):
    return server.tinker(tenant)


def base_model(server):

    return load_causal_lm(server.settings.models_dir / "tiny-llama", dtype=torch.float32).eval()


def datum(seq: list[int], weights: list[float] | None = None):
    weights = weights if weights is not None else [1.0] * (len(seq) - 1)
    return tinker.types.Datum(
        model_input=tinker.types.ModelInput.from_ints(seq[:-1]),
        loss_fn_inputs={"target_tokens": seq[1:], "weights": weights},
    )


def logprobs_of(model, seq: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([seq[:-1]])).logits[0].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(seq[1:])[:, None])[:, 0]


SEQS = [[3, 17, 29, 41, 8, 12, 5], [9, 22, 14, 30, 2]]


def test_the_sdk_lists_our_base_models(server):
    caps = client(server).create_rest_client().get_server_capabilities().result()
    names = [m.model_name for m in caps.supported_models]
    assert "tiny-llama" in names


def test_a_lora_client_starts_at_the_base_and_its_nll_falls_step_by_step(server):
    sc = client(server)
    tc = sc.create_lora_training_client(
        base_model="tiny-llama", rank=4, train_unembed=False
    ).result()
    assert tc.get_info().model_data.model_name == "tiny-llama"
    data = [datum(s) for s in SEQS]
    base = base_model(server)
    # step 0: the adapters start at zero, so the log-probabilities are the base's
    out = tc.forward(data, "cross_entropy").result()
    for got, seq in zip(out.loss_fn_outputs, SEQS, strict=True):
        torch.testing.assert_close(
            torch.tensor(got["logprobs"].tolist()), logprobs_of(base, seq), rtol=1e-5, atol=1e-5
        )
    want0 = -sum(float(logprobs_of(base, s).sum()) for s in SEQS)
    assert out.metrics["loss:sum"] == pytest.approx(want0, rel=1e-5)
    adam = tinker.types.AdamParams(learning_rate=2e-3)
    losses = []
    for _ in range(5):
        fb = tc.forward_backward(data, "cross_entropy")
        step = tc.optim_step(adam)  # submitted before the first result is read
        losses.append(fb.result().metrics["loss:sum"])
        step.result()
    assert losses[0] == pytest.approx(want0, rel=1e-5)
    assert all(b < a for a, b in itertools.pairwise(losses)), losses  # NLL falls


def test_the_seed_fixes_the_adapters_start(server):
    """create_lora_training_client(seed=...): two clients with one seed train alike (the
    same losses after a step), another seed differently; the seed was taken and ignored."""
    adam = tinker.types.AdamParams(learning_rate=1e-2)
    data = [datum(s) for s in SEQS]

    def losses(seed: int) -> list[float]:
        tc = (
            client(server)
            .create_lora_training_client(
                base_model="tiny-llama", rank=4, seed=seed, train_unembed=False
            )
            .result()
        )
        out = []
        for _ in range(2):
            fb = tc.forward_backward(data, "cross_entropy")
            tc.optim_step(adam).result()
            out.append(fb.result().metrics["loss:sum"])
        return out

    a, b, c = losses(7), losses(7), losses(8)
    assert a == b
    assert a[1] != c[1]  # the step moved B from zero along a different A


def test_requests_the_engine_cannot_run_fail_with_what_is_missing(server):
    tc = (
        client(server)
        .create_lora_training_client(base_model="tiny-llama", rank=2, train_unembed=False)
        .result()
    )
    with pytest.raises(
        tinker.RequestFailedError, match="loss_fn 'stable_reinforce' is not supported"
    ):
        tc.forward_backward([datum(SEQS[0])], "stable_reinforce").result()
    with pytest.raises(tinker.RequestFailedError, match="dro needs loss_fn_config"):
        tc.forward_backward([datum(SEQS[0])], "dro").result()
    with pytest.raises(tinker.BadRequestError, match="not a base model here"):
        client(server).create_lora_training_client(base_model="no-such-model", rank=2).result()


def test_gspo_through_the_sdk_is_tinkers_formula_over_the_marked_tokens(server):
    """gspo's loss from the SDK: every token's ratio is its sequence's, the mean log-ratio
    over the tokens sequence_ratio_mask marks (here all but the first two)."""
    tc = client(server).create_lora_training_client(base_model="tiny-llama", rank=2).result()
    data, sampled, adv = [], [], []
    for k, seq in enumerate(SEQS):
        n = len(seq) - 1
        q = [-4.0 - 0.1 * i for i in range(n)]
        a = [1.0 if k == 0 else -0.5] * n
        sampled.append(q)
        adv.append(a)
        inputs = {"target_tokens": seq[1:], "logprobs": q, "advantages": a,
                  "sequence_ratio_mask": [0.0, 0.0] + [1.0] * (n - 2)}  # fmt: skip
        data.append(
            tinker.types.Datum(
                model_input=tinker.types.ModelInput.from_ints(seq[:-1]), loss_fn_inputs=inputs
            )
        )
    # thresholds given, and none (as the cookbook's rl_loop sends: the GSPO paper's range)
    for clips, (low, high) in (
        ({"clip_low_threshold": 0.5, "clip_high_threshold": 1.5}, (0.5, 1.5)),
        (None, (1 - 3e-4, 1 + 4e-4)),
    ):
        out = tc.forward(data, "gspo", clips).result()
        want = 0.0
        for o, q, a in zip(out.loss_fn_outputs, sampled, adv, strict=True):
            lp = torch.tensor(o["logprobs"].tolist())
            ratio = torch.exp((lp - torch.tensor(q))[2:].mean())
            clipped = ratio.clamp(low, high)
            want -= float(torch.minimum(ratio * torch.tensor(a), clipped * torch.tensor(a)).sum())
        assert out.metrics["loss:sum"] == pytest.approx(want, rel=1e-5), clips


def test_another_tenant_never_reaches_a_model_or_its_results(server):
    import httpx

    tc = (
        client(server, "acme")
        .create_lora_training_client(base_model="tiny-llama", rank=2, train_unembed=False)
        .result()
    )
    model_id = tc.model_id
    them = {"X-API-Key": TINKER_TOKENS["rival"]}
    r = httpx.post(f"{server.url}/api/v1/get_info", json={"model_id": model_id}, headers=them)
    assert r.status_code == 404
    r = httpx.post(
        f"{server.url}/api/v1/optim_step",
        json={"model_id": model_id, "seq_id": 99, "adam_params": {}},
        headers=them,
    )
    assert r.status_code == 404
    # and without a key, nothing at all
    assert httpx.post(f"{server.url}/api/v1/create_session", json={}).status_code == 401


def test_malformed_bodies_are_400s_that_say_what_was_wrong(server):
    import httpx

    key = {"X-API-Key": TINKER_TOKENS["acme"]}
    sid = httpx.post(f"{server.url}/api/v1/create_session", json={}, headers=key).json()[
        "session_id"
    ]
    bad_rank = {
        "session_id": sid,
        "model_seq_id": 0,
        "base_model": "tiny-llama",
        "lora_config": {"rank": "many"},
    }
    r = httpx.post(f"{server.url}/api/v1/create_model", json=bad_rank, headers=key)
    assert r.status_code == 400
    assert "rank" in r.text
    r = httpx.post(
        f"{server.url}/api/v1/forward_backward",
        content=b"\xff\x00 not protobuf",
        headers={**key, "Content-Type": "application/x-protobuf"},
    )
    assert r.status_code == 400
    assert "not a ForwardBackwardRequest" in r.text
    r = httpx.post(f"{server.url}/api/v1/retrieve_future", json={"request_id": "nope"}, headers=key)
    assert r.status_code == 404


def test_rank_0_trains_every_weight_of_the_model(server):
    tc = client(server).create_lora_training_client(base_model="tiny-llama", rank=0).result()
    info = tc.get_info()
    assert info.is_lora is False
    data = [datum(s) for s in SEQS]
    # with the gradient's norm clipped per step (its match with torch: tests/core)
    adam = tinker.types.AdamParams(learning_rate=2e-3, grad_clip_norm=1.0)
    losses = []
    for _ in range(3):
        fb = tc.forward_backward(data, "cross_entropy")
        tc.optim_step(adam).result()
        losses.append(fb.result().metrics["loss:sum"])
    base = base_model(server)
    assert losses[0] == pytest.approx(
        -sum(float(logprobs_of(base, s).sum()) for s in SEQS), rel=1e-5
    )
    assert all(b < a for a, b in itertools.pairwise(losses)), losses


def test_a_saved_state_resumes_bitwise_in_a_new_training_client(server):
    sc = client(server)
    tc = sc.create_lora_training_client(
        base_model="tiny-llama", rank=4, train_unembed=False
    ).result()
    data = [datum(s) for s in SEQS]
    adam = tinker.types.AdamParams(learning_rate=2e-3)

    def steps(c, n):
        out = []
        for _ in range(n):
            fb = c.forward_backward(data, "cross_entropy")
            c.optim_step(adam).result()
            out.append(fb.result().metrics["loss:sum"])
        return out

    steps(tc, 2)
    path = tc.save_state("mid").result().path
    assert path == f"tinker://{tc.model_id}/weights/mid"
    went_on = steps(tc, 3)
    resumed = sc.create_training_client_from_state_with_optimizer(path).result()
    assert steps(resumed, 3) == went_on  # the same floats: weights, moments and step restored
    # the weights alone: the same loss first, then Adam starts again (another second step)
    weights_only = sc.create_training_client_from_state(path).result()
    fresh = steps(weights_only, 2)
    assert fresh[0] == went_on[0]
    assert fresh[1] != went_on[1]
    # another tenant's client cannot load it: the path names nothing of theirs
    with pytest.raises(tinker.NotFoundError, match="No saved state"):
        client(server, "rival").create_training_client_from_state_with_optimizer(path).result()
    with pytest.raises(tinker.NotFoundError, match="No saved state"):
        sc.create_training_client_from_state_with_optimizer("tinker://../weights/mid").result()


def test_checkpoints_are_listed_kept_to_their_tenant_deleted_and_expire(server):
    import time

    import httpx

    from service.errors import QuotaExceeded
    from service.sessions.checkpoints import expire

    sc = client(server)
    tc = sc.create_lora_training_client(
        base_model="tiny-llama", rank=2, train_unembed=False
    ).result()
    tc.save_state("a", user_metadata={"note": "first"}).result()
    tc.save_weights_for_sampler("b", ttl_seconds=3600).result()
    rest = sc.create_rest_client()
    listed = rest.list_checkpoints(tc.model_id).result().checkpoints
    assert [c.checkpoint_id for c in listed] == ["sampler_weights/b", "weights/a"]  # newest first
    b, a = listed
    assert (a.checkpoint_type, b.checkpoint_type) == ("training", "sampler")
    assert a.tinker_path == f"tinker://{tc.model_id}/weights/a"
    assert a.user_metadata == {"note": "first"}
    assert a.expires_at is None
    assert b.expires_at is not None
    assert a.size_bytes > b.size_bytes > 0
    run = rest.get_training_run(tc.model_id).result()
    assert (run.base_model, run.is_lora, run.lora_rank) == ("tiny-llama", True, 2)
    assert run.last_checkpoint.checkpoint_id == "weights/a"
    assert run.last_sampler_checkpoint.checkpoint_id == "sampler_weights/b"
    assert tc.model_id in [
        r.training_run_id for r in rest.list_training_runs().result().training_runs
    ]
    mine = {c.tinker_path for c in rest.list_user_checkpoints().result().checkpoints}
    assert {a.tinker_path, b.tinker_path} <= mine
    # a ttl out of range is refused before anything is written, and the client's later
    # requests still run (the refused one's seq_id is taken, not left a gap)
    with pytest.raises(tinker.RequestFailedError, match="ttl_seconds 5"):
        tc.save_state("short", ttl_seconds=5).result()
    assert not (server.settings.sessions_dir("acme") / tc.model_id / "weights" / "short").exists()
    # a name is not written twice unless asked
    with pytest.raises(tinker.RequestFailedError, match="exists"):
        tc.save_state("a").result()
    tc.save_state("a", overwrite=True).result()
    # another tenant sees none of it
    rival = client(server, "rival").create_rest_client()
    with pytest.raises(tinker.NotFoundError):
        rival.list_checkpoints(tc.model_id).result()
    assert a.tinker_path not in {
        c.tinker_path for c in rival.list_user_checkpoints().result().checkpoints
    }
    # deleted: gone from the list and from what loads
    rest.delete_checkpoint(tc.model_id, "weights/a").result()
    assert [c.checkpoint_id for c in rest.list_checkpoints(tc.model_id).result().checkpoints] == [
        "sampler_weights/b"
    ]
    with pytest.raises(tinker.NotFoundError):
        sc.create_training_client_from_state_with_optimizer(a.tinker_path).result()
    # the run outlives its session; its ttl'd checkpoint is removed by the sweep once due
    key = {"X-API-Key": TINKER_TOKENS["acme"]}
    sid = tc.model_id.split(":", 1)[0]
    assert httpx.post(f"{server.url}/api/v1/sessions/{sid}/finish", headers=key).status_code == 200
    # finished: finishing again changes nothing; a heartbeat is a 410, which ends the SDK's
    # heartbeat loop (a 404 would keep it warning every 10 s)
    assert httpx.post(f"{server.url}/api/v1/sessions/{sid}/finish", headers=key).status_code == 200
    beat = httpx.post(
        f"{server.url}/api/v1/session_heartbeat", headers=key, json={"session_id": sid}
    )
    assert beat.status_code == 410, beat.text
    assert beat.json()["error"]["code"] == "session_ended"
    assert rest.get_training_run(tc.model_id).result().training_run_id == tc.model_id
    assert expire(server.settings.data_dir / "sessions", now=time.time() + 60) == []
    assert len(expire(server.settings.data_dir / "sessions", now=time.time() + 3700)) >= 1
    assert rest.list_checkpoints(tc.model_id).result().checkpoints == []
    # a full storage quota: the save fails with the numbers, at once (not retried)
    tc2 = client(server).create_lora_training_client(base_model="tiny-llama", rank=2).result()

    def full(tenant):
        raise QuotaExceeded(f"tenant {tenant} stores 9 bytes and may store 8")

    server.ctx.sessions.check_quota = full
    try:
        with pytest.raises(tinker.RequestFailedError, match="may store 8"):
            tc2.save_state("c").result()
    finally:
        server.ctx.sessions.check_quota = lambda tenant: None


def test_a_model_that_does_not_fit_its_engines_memory_is_refused_with_the_numbers(server):
    """The capacity planner's chunk plan at creation: every weight of the tiny Llama in
    fp32 is at least 16 bytes a parameter (weights, Adam's two moments, in fp32); with
    the engines given 1 GiB, that and the 1 GiB beside it do not fit (a 400 naming the
    numbers and LoRA as the way out), with 2 GiB they do."""
    import re

    from service.sessions import fit

    sc = client(server)
    resources = server.settings.default_resources
    params = sum(p.numel() for p in base_model(server).parameters())
    try:
        resources["memory_per_worker"] = 1 << 30
        with pytest.raises(tinker.BadRequestError, match="model_does_not_fit") as e:
            sc.create_lora_training_client(base_model="tiny-llama", rank=0).result()
        said = re.search(r"needs ([\d.]+) GiB of model data \(([\d,]+) parameters", str(e.value))
        assert said, str(e.value)
        assert int(said[2].replace(",", "")) == params
        assert "train LoRA adapters (rank > 0) instead" in str(e.value)
        planned = fit.plan(server.settings.models_dir / "tiny-llama", 0, (), "fp32")
        assert 16 * params <= planned.chunk_bytes <= 24 * params
        resources["memory_per_worker"] = 2 << 30
        tc = sc.create_lora_training_client(base_model="tiny-llama", rank=0).result()
        assert tc.get_info().is_lora is False
    finally:
        resources.pop("memory_per_worker", None)
