"""Training sessions with their engines in Ray actors (PSTAR_SESSION_ENGINES=ray), through
the unmodified SDK: the same answers as in-process (step-0 logprobs against transformers,
the NLL falls, a saved state and sampler weights written by the actor on the shared
volume), each model in an actor of its own that is not the API's process, a caller's
error raised in the actor coming back as the caller's error, and the actor gone when its
session ends; a model over two engines with chunk ZeRO between them (user_metadata
pstar_workers) trains as one engine does. One local Ray for the module (2 CPUs)."""

from __future__ import annotations

import itertools
import os

import pytest
import tinker
import torch

from pstar_core.hf import load_causal_lm
from tests.api.conftest import TINKER_TOKENS, TOKENS, start_api
from tests.api.test_tinker_sdk import SEQS, datum, logprobs_of

T = tinker.types


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    import ray

    from service.sessions.hosts import RayHosts

    mp = pytest.MonkeyPatch()
    mp.setenv("TINKER_TELEMETRY", "0")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    data_dir = tmp_path_factory.mktemp("tinker-ray")
    from service.settings import Limits

    api, stop = start_api(
        data_dir,
        f"sqlite:///{data_dir / 'store.db'}",
        "sqlite",
        models_in_process=True,
        limits=Limits(max_session_models_per_tenant=8),
    )
    api.ctx.sessions.engine_defaults["dtype"] = "fp32"
    # a quarter of a CPU each: up to 8 engines at once on 2 CPUs
    api.ctx.sessions.hosts = RayHosts(None, {"num_cpus": 0.25})
    yield api
    stop()
    ray.shutdown()
    mp.undo()


def test_a_session_model_trains_samples_and_saves_in_its_own_ray_actor(server):
    import httpx
    import ray

    sc = server.tinker("acme")
    tc = sc.create_lora_training_client(
        base_model="tiny-llama", rank=4, train_unembed=False
    ).result()
    assert tc.get_info().model_data.arch == "llama"  # asked of the actor
    name = f"session-engine {tc.model_id}"
    actor = ray.get_actor(name, namespace="pstar")
    pid = ray.get(actor.__ray_call__.remote(lambda self: os.getpid()))
    assert pid != os.getpid()
    base = load_causal_lm(server.settings.models_dir / "tiny-llama", dtype=torch.float32).eval()
    data = [datum(s) for s in SEQS]
    out = tc.forward(data, "cross_entropy").result()
    for got, seq in zip(out.loss_fn_outputs, SEQS, strict=True):
        torch.testing.assert_close(
            torch.tensor(got["logprobs"].tolist()), logprobs_of(base, seq), rtol=1e-5, atol=1e-5
        )
    losses = []
    for _ in range(3):
        fb = tc.forward_backward(data, "cross_entropy")
        tc.optim_step(T.AdamParams(learning_rate=2e-3)).result()
        losses.append(fb.result().metrics["loss:sum"])
    assert all(b < a for a, b in itertools.pairwise(losses)), losses
    # a caller's mistake raised in the actor comes back as the caller's error
    tc.forward_backward(data, "cross_entropy").result()
    with pytest.raises(tinker.RequestFailedError, match="call optim_step first"):
        tc.save_state("too-early").result()
    tc.optim_step(T.AdamParams(learning_rate=2e-3)).result()
    # what the actor writes lands on the shared volume, where the API and samplers read
    path = tc.save_state("s1").result().path
    assert (
        server.settings.sessions_dir("acme") / tc.model_id / "weights" / "s1" / "engine"
    ).is_dir()
    sampler = tc.save_weights_and_get_sampling_client().result()
    got = sampler.sample(T.ModelInput.from_ints(SEQS[0]), 2, T.SamplingParams(max_tokens=3))
    assert [len(s.tokens) for s in got.result().sequences] == [3, 3]
    resumed = sc.create_training_client_from_state_with_optimizer(path).result()
    assert ray.get_actor(f"session-engine {resumed.model_id}", namespace="pstar") is not None
    # the dashboard says where the engine is
    mine = {"Authorization": f"Bearer {TOKENS['acme']}"}
    listed = httpx.get(f"{server.url}/v1/training_sessions", headers=mine).json()["data"]
    where = {m["id"]: m["where"] for s in listed for m in s["models"]}
    assert where[tc.model_id] == f"Ray actor '{name}'"
    # the session ends: its actors go with it
    sid = tc.model_id.split(":", 1)[0]
    key = {"X-API-Key": TINKER_TOKENS["acme"]}
    assert httpx.post(f"{server.url}/api/v1/sessions/{sid}/finish", headers=key).status_code == 200
    with pytest.raises(ValueError, match="look up actor"):
        ray.get_actor(name, namespace="pstar")


def test_a_model_over_two_engines_with_chunk_zero_trains_as_one_engine_does(server):
    """Every weight (rank 0) over 2 engines: a batch of 3 is dealt 2 + 1, a batch of 1
    leaves a rank with no datum (it takes part with none); the logprobs, losses and steps
    are one engine's, to float rounding; its state resumes on 2 engines; its sampler
    weights are exported whole."""
    sc = server.tinker("acme")
    one = sc.create_lora_training_client(base_model="tiny-llama", rank=0).result()
    two = sc.create_lora_training_client(
        base_model="tiny-llama", rank=0, user_metadata={"pstar_workers": "2"}
    ).result()
    data = [datum(s) for s in [*SEQS, [5, 9, 13, 2, 40]]]  # three: 2 + 1 over 2 ranks
    adam = T.AdamParams(learning_rate=2e-3)

    def run(tc, batch):
        fb = tc.forward_backward(batch, "cross_entropy")
        tc.optim_step(adam).result()
        out = fb.result()
        return out.metrics["loss:sum"], [o["logprobs"].tolist() for o in out.loss_fn_outputs]

    for batch in (data, data, data[:1], data):
        (l1, lp1), (l2, lp2) = run(one, batch), run(two, batch)
        assert l2 == pytest.approx(l1, rel=1e-5)
        for a, b in zip(lp1, lp2, strict=True):
            assert b == pytest.approx(a, abs=1e-5)
    # a bad datum on rank 1's share is refused before any rank runs (they would wait on
    # each other in the forward's collectives)
    bad = datum([5, 9, 10**6, 2])
    with pytest.raises(tinker.RequestFailedError, match=r"data\[1\]: a token id outside"):
        two.forward_backward([data[0], bad], "cross_entropy").result()
    path = two.save_state("zero").result().path
    went_on = run(two, data)[0]
    resumed = sc.create_training_client_from_state_with_optimizer(path).result()
    assert run(resumed, data)[0] == went_on  # the two ranks' files, loaded by two engines
    sampler = two.save_weights_and_get_sampling_client().result()
    got = sampler.sample(T.ModelInput.from_ints(SEQS[0]), 1, T.SamplingParams(max_tokens=2))
    assert len(got.result().sequences[0].tokens) == 2
    with pytest.raises(tinker.BadRequestError, match="pstar_workers"):
        sc.create_lora_training_client(
            base_model="tiny-llama", rank=0, user_metadata={"pstar_workers": "lots"}
        ).result()


def test_engines_the_cluster_has_no_room_for_fail_the_create_with_what_they_asked(
    server, monkeypatch
):
    import ray

    from service.sessions import hosts

    monkeypatch.setattr(hosts, "START_TIMEOUT_S", 3.0)
    monkeypatch.setattr(server.ctx.sessions, "hosts", hosts.RayHosts(None, {"num_cpus": 1.5}))

    def actors() -> set[str]:
        return {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)}

    before = actors()
    sc = server.tinker("acme")
    with pytest.raises(
        tinker.RequestFailedError, match=r"of 2 engine\(s\) could not start within 3 s"
    ):
        sc.create_lora_training_client(
            base_model="tiny-llama", rank=2, user_metadata={"pstar_workers": "2"}
        ).result()
    assert actors() <= before  # the one that had started was killed with the other
    # and the model that could not start holds no slot of the tenant's
    assert not [m for m in server.ctx.sessions.models.values() if m.workers == 2 and m.rank == 2]
