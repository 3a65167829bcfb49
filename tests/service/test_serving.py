"""Which deployment answers a model (`target_of`), what `Serving` asks Ray Serve for (a
fake dashboard records the REST calls), training's priority over a new replica, the 503s
that say why, the text a stream releases (stop strings held back until they cannot
match), and deleted models' files kept while a job reads them."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from benchmarks.models_made import full_model, lora_model
from service.errors import Forbidden, InvalidRequest, NotFound, Unavailable
from service.serving.deployments import (
    APP_PREFIX,
    BUILDER,
    Serving,
    base_app,
    delete_model,
    delete_model_files,
    target_of,
)
from service.serving.text import TextStream
from service.settings import ServeSettings
from tests.service.test_store import add_job


class FakeDashboard:
    """Serve's REST API as the dashboard answers it: PUT replaces every application."""

    def __init__(self, status: str = "RUNNING", message: str = "", gpus: int = 0) -> None:
        self.apps: dict[str, dict] = {}
        self.puts: list[dict] = []
        self.status, self.message, self.gpus = status, message, gpus

    def __call__(self, method: str, path: str, body=None, timeout: float = 30):
        if path == "/api/cluster_status":
            usage = {"CPU": [2.0, 2.0], "memory": [0, 1]}
            if self.gpus:
                usage["GPU"] = [0.0, float(self.gpus)]
            return {"data": {"clusterStatus": {"loadMetricsReport": {"usage": usage}}}}
        if method == "GET":
            return {"applications": self.apps}
        self.puts.append(body)
        self.apps = {
            a["name"]: {"status": self.status, "message": self.message, "deployed_app_config": a}
            for a in body["applications"]
        }
        return None


def serving(settings, dash: FakeDashboard, waiting: int = 0, **cfg) -> Serving:
    from dataclasses import replace

    s = Serving(
        replace(settings, serve=ServeSettings(**cfg)), lambda: "http://dash", lambda: waiting
    )
    s._http = dash  # type: ignore[method-assign]
    return s


def test_a_lora_model_and_its_checkpoint_are_adapters_on_their_bases_deployment(env):
    settings, store = env
    made = lora_model(store, settings.data_dir)
    base = target_of(settings, store, "acme", "tiny-llama")
    ft = target_of(settings, store, "acme", made.model)
    ck = target_of(settings, store, "acme", made.checkpoint)
    assert (
        ft.app == ck.app == base.app == base_app(settings.models_dir / "tiny-llama", "tiny-llama")
    )
    assert base.adapter is None
    assert ft.adapter == f"models/.ft/{made.job_id}/adapter"
    assert ck.adapter == f"runs/{made.job_id}/checkpoint_000000/adapter"
    with pytest.raises(NotFound):
        target_of(settings, store, "rival", made.model)
    with pytest.raises(NotFound):
        target_of(settings, store, "acme", made.model.replace("ckpt", "x") + ":ckpt-step-99")


def test_a_full_fine_tune_has_its_own_deployment_and_a_zoo_model_none(env):
    settings, store = env
    made = full_model(store, settings.data_dir)
    t = target_of(settings, store, "acme", made.model)
    assert t.app == f"{APP_PREFIX}ft-{made.job_id.lower()}"
    assert t.model_dir == made.export
    assert t.adapter is None
    with pytest.raises(InvalidRequest, match="without weights"):
        target_of(settings, store, "acme", "gpt-1b")


def test_an_adapter_whose_base_was_deleted_serves_its_merged_export_alone(env):
    settings, store = env
    full = full_model(store, settings.data_dir)
    on_full = lora_model(store, settings.data_dir)
    with store.db.write() as s:  # its job fine-tuned the full fine-tune, not the base
        from sqlalchemy import update

        from service.store import Job

        s.execute(update(Job).where(Job.id == on_full.job_id).values(model=full.model))
    before = target_of(settings, store, "acme", on_full.model)
    assert before.model_dir == full.export  # an adapter on the full fine-tune's deployment
    assert before.adapter is not None
    delete_model(settings, store, None, "acme", full.model)
    t = target_of(settings, store, "acme", on_full.model)
    assert t.adapter is None
    assert t.model_dir == on_full.export


def test_the_first_request_deploys_one_application_and_keeps_the_others(env):
    settings, store = env
    dash = FakeDashboard()
    dash.apps = {"someone-else": {"status": "RUNNING", "deployed_app_config": {"name": "x"}}}
    sv = serving(settings, dash, max_adapters=5, replica_gpus=0.5, idle_s=60)
    t = target_of(settings, store, "acme", "tiny-llama")
    assert sv.endpoint(t) == f"http://127.0.0.1:8001/{t.app}"
    [put] = dash.puts
    assert [a["name"] for a in put["applications"]] == ["x", t.app]  # the other one kept
    app = put["applications"][1]
    assert app["import_path"] == BUILDER
    assert app["args"]["model_dir"] == str(t.model_dir)
    assert app["args"]["max_adapters"] == 5
    [dep] = app["deployments"]
    assert dep["autoscaling_config"]["min_replicas"] == 0  # scales to zero when idle
    assert dep["autoscaling_config"]["downscale_delay_s"] == 60
    assert dep["ray_actor_options"] == {"num_cpus": 0.0, "num_gpus": 0.5}
    sv.endpoint(t)
    assert len(dash.puts) == 1  # running: not deployed again


def test_a_replica_takes_a_gpu_when_the_cluster_has_one_unless_set(env):
    settings, store = env
    t = target_of(settings, store, "acme", "tiny-llama")
    for gpus, setting, want in [(8, None, 1.0), (0, None, 0.0), (8, 0.25, 0.25)]:
        dash = FakeDashboard(gpus=gpus)
        serving(settings, dash, replica_gpus=setting).endpoint(t)
        [dep] = dash.puts[-1]["applications"][-1]["deployments"]
        assert dep["ray_actor_options"]["num_gpus"] == want


def test_training_waiting_for_resources_has_priority_over_a_new_replica(env):
    settings, store = env
    t = target_of(settings, store, "acme", "tiny-llama")
    with pytest.raises(Unavailable, match="training has priority"):
        serving(settings, FakeDashboard(), waiting=2, replica_gpus=1).endpoint(t)
    # a replica that reserves nothing takes nothing training waits for
    assert serving(settings, FakeDashboard(), waiting=2).endpoint(t)


def test_a_deployment_that_fails_or_cannot_be_placed_is_a_503_saying_why(env):
    settings, store = env
    t = target_of(settings, store, "acme", "tiny-llama")
    failed = FakeDashboard("DEPLOY_FAILED", "ImportError: no module named x")
    with pytest.raises(Unavailable, match="no module named x"):
        serving(settings, failed).endpoint(t)
    stuck = FakeDashboard("DEPLOYING")
    with pytest.raises(Unavailable) as e:
        serving(settings, stuck, start_timeout_s=0.1, replica_cpus=4).endpoint(t)
    assert "a replica asks for 4 CPU, 0 GPU; the cluster has CPU 2 of 2 in use" in str(e.value)


def test_remove_takes_the_application_off_and_keeps_the_rest(env):
    settings, _ = env
    dash = FakeDashboard()
    dash.apps = {n: {"deployed_app_config": {"name": n}} for n in ("a", "b")}
    sv = serving(settings, dash)
    assert sv.remove("a")
    assert [x["name"] for x in dash.puts[-1]["applications"]] == ["b"]
    assert not sv.remove("zzz")


def test_a_tenants_own_models_in_memory_are_bounded_and_a_cold_start_waits_on_the_loop(env):
    import asyncio

    from service.errors import QuotaExceeded

    settings, store = env
    dash = FakeDashboard()
    sv = serving(settings, dash, max_models_per_tenant=2)
    mine = [full_model(store, settings.data_dir) for _ in range(3)]
    theirs = full_model(store, settings.data_dir, tenant="rival")
    lora = lora_model(store, settings.data_dir)
    for made in mine[:2]:  # through the event loop's path, as the API calls it
        t = target_of(settings, store, "acme", made.model)
        assert asyncio.run(sv.endpoint_async(t)) == sv.url(t)
    with pytest.raises(QuotaExceeded, match="tenant acme has 2 of its own") as e:
        sv.endpoint(target_of(settings, store, "acme", mine[2].model))
    assert e.value.code == "too_many_models"
    # another tenant's share is its own; adapters go on their base's shared application
    sv.endpoint(target_of(settings, store, "rival", theirs.model))
    sv.endpoint(target_of(settings, store, "acme", lora.model))
    owners = [a["args"]["owner"] for a in dash.puts[-1]["applications"]]
    assert owners == ["acme", "acme", "rival", None]
    # one of acme's leaves memory (idle): the third loads
    dash.apps.pop(next(iter(dash.apps)))
    sv._running.clear()
    sv.endpoint(target_of(settings, store, "acme", mine[2].model))


def test_deleting_refuses_base_checkpoint_and_other_tenants_models(env):
    settings, store = env
    made = lora_model(store, settings.data_dir)
    with pytest.raises(Forbidden):
        delete_model(settings, store, None, "acme", "tiny-llama")
    with pytest.raises(Forbidden):
        delete_model(settings, store, None, "acme", "gpt-1b")
    with pytest.raises(InvalidRequest, match="checkpoint"):
        delete_model(settings, store, None, "acme", made.checkpoint)
    with pytest.raises(NotFound):
        delete_model(settings, store, None, "rival", made.model)
    assert made.export.is_dir()


def test_deleted_models_files_stay_while_an_unfinished_job_fine_tunes_from_them(env):
    settings, store = env
    made = full_model(store, settings.data_dir)
    job = add_job(store, body={"model": made.model, "training_file": "f"}, status="queued")
    delete_model(settings, store, None, "acme", made.model)
    assert made.export.is_dir()
    assert delete_model_files(settings, store) == []
    store.jobs.update(job.id, status="cancelled")
    assert delete_model_files(settings, store) == [made.job_id]
    assert not made.export.exists()


class Letters:
    """A tokenizer whose token i decodes to WORDS[i]."""

    def __init__(self, words: list[str]) -> None:
        self.words = words

    def decode(self, ids, skip_special_tokens=True) -> str:
        return "".join(self.words[i] for i in ids)


def test_text_is_held_back_while_it_could_still_become_a_stop_string():
    s = TextStream(Letters(["ab", "cE", "N", "D", "x"]), ("END",))
    assert s.add(0) == ("ab", False)
    assert s.add(1) == ("c", False)  # "E" could start "END"
    assert s.add(2) == ("", False)  # "EN" too
    assert s.add(3) == ("", True)  # "END": the text ends before it


def test_held_back_text_is_released_when_it_turns_out_not_to_stop():
    s = TextStream(Letters(["ab", "E", "x", "\ufffd"]), ("END",))
    s.add(0)
    assert s.add(1) == ("", False)
    assert s.add(2) == ("Ex", False)
    assert s.add(3) == ("", False)  # a character still arriving
    assert s.rest() == "\ufffd"


def test_model_server_refuses_an_adapter_path_outside_the_data_dir(tmp_path: Path):
    from service.serving.model_server import confined

    assert confined(tmp_path, "models/a") == (tmp_path / "models" / "a").resolve()
    with pytest.raises(ValueError, match="outside"):
        confined(tmp_path, "../etc")


def test_a_replica_keeps_its_most_recently_used_adapters_and_never_drops_a_busy_one(tmp_path):
    """max_adapters=2: a third adapter pushes out the least recently used one that no row
    decodes with; the answers stay each adapter's own."""
    from benchmarks.models_made import _adapter
    from service.serving.collect import complete
    from service.serving.generation import Generator, SamplingParams
    from tests.tiny import make_tiny_llama

    base = make_tiny_llama(tmp_path / "base")
    paths = {k: tmp_path / k for k in ("a", "b", "c")}
    for i, p in enumerate(paths.values()):
        _adapter(base, p, seed=i + 1)
    gen = Generator(base, max_adapters=2)
    try:
        ids = gen.render([{"role": "user", "content": "What does apple mean?"}])
        greedy = SamplingParams(max_tokens=6, temperature=0)

        def ask(k):
            return complete(gen, ids, greedy, k, paths[k]).tokens[0]

        first = {k: ask(k) for k in ("a", "b")}
        assert list(gen.adapters) == ["a", "b"]
        ask("a")  # now "b" is the least recently used
        ask("c")
        assert list(gen.adapters) == ["a", "c"]
        assert ask("b") == first["b"]  # loaded again, the same answers
        assert list(gen.adapters) == ["c", "b"]
        assert len(set(first.values()) | {ask("c")}) == 3  # three different adapters
    finally:
        gen.close()


def test_unloading_the_last_adapter_leaves_the_base_answering_as_before(tmp_path):
    """peft keeps a deleted adapter active when it was the only one, and every forward
    then raised a KeyError (each request a 500, once a replica's last adapter was
    deleted): the base answers as it did before, and the adapter loads again."""
    from benchmarks.models_made import _adapter
    from service.serving.collect import complete
    from service.serving.generation import Generator, SamplingParams
    from tests.tiny import make_tiny_llama

    base = make_tiny_llama(tmp_path / "base")
    _adapter(base, tmp_path / "a", seed=1)
    gen = Generator(base, max_adapters=2)
    try:
        ids = gen.render([{"role": "user", "content": "What does apple mean?"}])
        greedy = SamplingParams(max_tokens=6, temperature=0)
        plain = complete(gen, ids, greedy, None, None).tokens[0]
        tuned = complete(gen, ids, greedy, "a", tmp_path / "a").tokens[0]
        gen.unload_adapter("a").result(timeout=30)
        assert list(gen.adapters) == []
        assert complete(gen, ids, greedy, None, None).tokens[0] == plain
        assert complete(gen, ids, greedy, "a", tmp_path / "a").tokens[0] == tuned
    finally:
        gen.close()


def test_a_vanishing_top_p_or_temperature_samples_the_likeliest_token(tmp_path):
    """top_p 5e-324 is 0 in float32, and kept no token at all; a temperature of 1e-300
    overflows the division: each was a 500 (multinomial of no probability). Both sample
    the likeliest token, as greedy decoding does."""
    from service.serving.collect import complete
    from service.serving.generation import Generator, SamplingParams
    from tests.tiny import make_tiny_llama

    gen = Generator(make_tiny_llama(tmp_path / "base"))
    try:
        ids = gen.render([{"role": "user", "content": "What does apple mean?"}])
        greedy = complete(gen, ids, SamplingParams(max_tokens=6, temperature=0), None, None)
        for params in (
            SamplingParams(max_tokens=6, temperature=1.0, top_p=5e-324, seed=3),
            SamplingParams(max_tokens=6, temperature=1e-300, seed=3),
        ):
            got = complete(gen, ids, params, None, None)
            assert got.tokens[0] == greedy.tokens[0], params
    finally:
        gen.close()


def test_requests_queued_together_are_prefilled_together_and_answer_as_alone(tmp_path):
    """Three prompts of different lengths waiting at once: one prefill (left-padded), and
    each one's tokens, their log-probabilities and its prompt's are what it gets alone;
    `n` choices copy their prompt's cache row; top_k=1 samples the greedy tokens."""
    import threading
    import time

    from service.serving.collect import complete
    from service.serving.generation import Generator, SamplingParams
    from tests.tiny import make_tiny_llama

    gen = Generator(make_tiny_llama(tmp_path / "base"))
    try:
        prompts = [
            gen.render([{"role": "user", "content": f"What does {w} mean?"}])
            for w in ("apple", "thunder meadow harbor silver", "the ocean")
        ]
        assert len({len(p) for p in prompts}) == 3
        greedy = SamplingParams(
            max_tokens=6, temperature=0, n=2, logprobs=True, prompt_logprobs=True
        )
        alone = [complete(gen, p, greedy) for p in prompts]
        before = gen.prefills
        busy = threading.Event()
        gen.call(lambda: (busy.set(), time.sleep(0.5)))  # busy while all three arrive
        busy.wait(10)
        together: list = [None] * 3

        def ask(i: int) -> None:
            together[i] = complete(gen, prompts[i], greedy)

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert gen.prefills == before + 1
        for a, b in zip(alone, together, strict=True):
            assert b.tokens == a.tokens
            assert b.tokens[0] == b.tokens[1]  # two greedy choices of one prompt
            for i in (0, 1):
                assert b.logprobs[i] == pytest.approx(a.logprobs[i], abs=1e-5)
            assert math.isnan(b.prompt_logprobs[0])
            assert b.prompt_logprobs[1:] == pytest.approx(a.prompt_logprobs[1:], abs=1e-5)
        top1 = SamplingParams(max_tokens=6, temperature=1.0, top_k=1, seed=5)
        assert complete(gen, prompts[0], top1).tokens[0] == alone[0].tokens[0]
    finally:
        gen.close()


def test_a_group_prefilled_together_keeps_every_adapter_it_needs(tmp_path):
    """max_adapters=1 and two requests of two adapters admitted together: loading the
    second must not unload the first's before their one forward (peft then failed the
    whole group); each answers as it does alone."""
    import threading
    import time

    from benchmarks.models_made import _adapter
    from service.serving.collect import complete
    from service.serving.generation import Generator, SamplingParams
    from tests.tiny import make_tiny_llama

    base = make_tiny_llama(tmp_path / "base")
    paths = {k: tmp_path / k for k in ("a", "b")}
    for i, p in enumerate(paths.values()):
        _adapter(base, p, seed=i + 1)
    gen = Generator(base, max_adapters=1)
    try:
        ids = gen.render([{"role": "user", "content": "What does apple mean?"}])
        greedy = SamplingParams(max_tokens=4, temperature=0)
        alone = {k: complete(gen, ids, greedy, k, paths[k]).tokens[0] for k in paths}
        busy = threading.Event()
        gen.call(lambda: (busy.set(), time.sleep(0.5)))
        busy.wait(10)
        got: dict = {}
        threads = [
            threading.Thread(
                target=lambda k=k: got.__setitem__(k, complete(gen, ids, greedy, k, paths[k]))
            )
            for k in paths
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for k in paths:
            assert got[k].error is None, got[k].error
            assert got[k].tokens[0] == alone[k]
    finally:
        gen.close()


def test_models_loaded_by_many_threads_at_once_keep_their_tied_head(tmp_path):
    """transformers' from_pretrained switches weight tying off class-wide while it loads;
    two loads at once used to leave it off in the process for good, and every tied model
    loaded after that had a random head (pstar_core/hf.py, [Note: one transformers load
    at a time])."""
    import threading

    from transformers import AutoConfig, LlamaForCausalLM, PreTrainedModel

    from service.serving.generation import Generator
    from tests.tiny import make_tiny_llama

    tie_weights = PreTrainedModel.tie_weights
    base = make_tiny_llama(tmp_path / "base")
    config = AutoConfig.from_pretrained(base)
    config.tie_word_embeddings = True
    LlamaForCausalLM(config).save_pretrained(base)
    loaded: list[Generator] = []
    errors: list[BaseException] = []

    def load() -> None:
        try:
            for _ in range(4):
                loaded.append(Generator(base))
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=load) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert not errors, errors
        assert PreTrainedModel.tie_weights is tie_weights
        for gen in loaded:
            head, embed = gen.model.lm_head.weight, gen.model.model.embed_tokens.weight
            assert head.data_ptr() == embed.data_ptr()
    finally:
        for gen in loaded:
            gen.close()
