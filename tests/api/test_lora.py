"""LoRA jobs through the API, on SQLite and PostgreSQL: `method: {"type": "lora", "lora":
{...}}` through the unmodified `openai` SDK, its echo in the job object and the engine
section it runs with; every wrong LoRA body refused with a 400 naming the field and
storing nothing; the dry run's LoRA memory plan against full fine-tuning; the model a LoRA
job registers; checkpoint downloads (`.../checkpoints/{id}/content?variant=`) as streamed
tar archives, with their 400/404s and tenancy. (The launcher is dry: the files a finished
job leaves are written here; tests/service/test_service_ray.py runs a LoRA job for real.)
"""

from __future__ import annotations

import io
import json
import os
import tarfile
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.spec.job import spec_of
from tests.api.test_hostile import assert_envelope, post_json, stored_jobs
from tests.service.test_store import driver_attempt
from tests.tiny import chat_lines

JOBS = "/fine_tuning/jobs"
LORA = {"r": 8, "alpha": 16, "dropout": 0.05, "target_modules": ["q_proj", "v_proj"]}


@pytest.fixture(scope="module")
def train_file(api) -> str:
    data = io.BytesIO(("\n".join(chat_lines(16)) + "\n").encode())
    return api.client().files.create(file=("train.jsonl", data), purpose="fine-tune").id


def lora_job(api, train_file: str, **lora: Any):
    return api.client().fine_tuning.jobs.create(
        model="tiny-llama",
        training_file=train_file,
        method={"type": "lora", "lora": {**LORA, **lora}},  # type: ignore[arg-type]
    )


def test_a_lora_job_is_created_with_the_sdk_and_echoes_its_method(api, train_file):
    c = api.client()
    job = c.fine_tuning.jobs.create(
        model="tiny-llama",
        training_file=train_file,
        method={  # type: ignore[arg-type]  (the SDK types OpenAI's methods; it sends any)
            "type": "lora",
            "lora": {**LORA, "hyperparameters": {"n_epochs": 2, "batch_size": 4}},
        },
    )
    assert job.method.type == "lora"
    assert job.method.model_extra["lora"] == {
        **LORA,
        "alpha": 16.0,
        "hyperparameters": {"n_epochs": 2, "batch_size": 4, "learning_rate_multiplier": 1.0},
    }
    assert (job.hyperparameters.n_epochs, job.hyperparameters.batch_size) == (2, 4)
    assert job.model_extra["hyperparameters_resolved"]["lora"] == {**LORA, "alpha": 16.0}
    again = c.fine_tuning.jobs.retrieve(job.id)
    assert again.method.model_extra["lora"] == job.method.model_extra["lora"]
    # the engine config the workers run with carries the adapters, stored once: in the
    # method, not in the client's engine section
    stored = api.store.jobs.get(job.id)
    plan = stored.plan
    assert spec_of(stored).engine_config()["lora"] == {**LORA, "alpha": 16.0}
    assert "lora" not in plan["engine"]
    assert plan["method"] == {"type": "lora", "lora": {**LORA, "alpha": 16.0}}


def test_a_lora_method_without_settings_takes_the_engines_defaults(api, train_file):
    from pstar_core.config import LoraConfig

    job = api.client().fine_tuning.jobs.create(
        model="tiny-llama",
        training_file=train_file,
        method={"type": "lora"},  # type: ignore[arg-type]
        hyperparameters={"n_epochs": 1},
    )
    want = LoraConfig()
    assert job.model_extra["hyperparameters_resolved"]["lora"] == {
        "r": want.r,
        "alpha": want.alpha,
        "dropout": want.dropout,
        "target_modules": want.target_modules,
    }
    assert job.hyperparameters.n_epochs == 1


def test_a_supervised_job_echoes_supervised_and_has_no_lora_settings(api, train_file):
    job = api.client().fine_tuning.jobs.create(model="tiny-llama", training_file=train_file)
    assert job.method.type == "supervised"
    assert "lora" not in job.model_extra["hyperparameters_resolved"]
    assert "lora" not in spec_of(api.store.jobs.get(job.id)).engine_config()


def lora_body(model: str = "tiny-llama", **fields: Any):
    """A LoRA job body on acme's file, `fields` replacing top-level ones; `lora=` replaces
    the method's lora section (None: left out)."""
    section = fields.pop("lora", {})
    method = {"type": "lora"} | ({"lora": section} if section is not None else {})
    return lambda f: {"model": model, "training_file": f, "method": method, **fields}


def lora_with(**section: Any):
    return lora_body(lora=section)


# (case, body, param the error names, code, words the message must hold)
BAD_LORA: list[tuple[str, Any, str, str, str]] = [
    ("r is 0", lora_with(r=0), "method.lora.r", "invalid_value", "greater than or equal to 1"),
    ("r is 4097", lora_with(r=4097), "method.lora.r", "invalid_value", "4096"),
    ("r is 2.5", lora_with(r=2.5), "method.lora.r", "invalid_value", "integer"),
    ("r is a string", lora_with(r="8"), "method.lora.r", "invalid_value", "integer"),
    ("r is true", lora_with(r=True), "method.lora.r", "invalid_value", "integer"),
    ("alpha is 0", lora_with(alpha=0), "method.lora.alpha", "invalid_value", "greater than 0"),
    ("alpha is negative", lora_with(alpha=-4), "method.lora.alpha", "invalid_value", "0"),
    ("alpha is a string", lora_with(alpha="16"), "method.lora.alpha", "invalid_value", "number"),
    ("dropout is 1", lora_with(dropout=1), "method.lora.dropout", "invalid_value", "less than 1"),
    ("dropout < 0", lora_with(dropout=-0.1), "method.lora.dropout", "invalid_value", "0"),
    (
        "target_modules is empty",
        lora_with(target_modules=[]),
        "method.lora.target_modules",
        "invalid_value",
        "at least 1",
    ),
    (
        "target_modules is one name, not a list",
        lora_with(target_modules="q_proj"),
        "method.lora.target_modules",
        "invalid_value",
        "all-linear",
    ),
    (
        "'all-linear' inside a list",
        lora_with(target_modules=["q_proj", "all-linear"]),
        "method.lora.target_modules",
        "invalid_value",
        "whole value",
    ),
    (
        "a target name with a space",
        lora_with(target_modules=["q proj"]),
        "method.lora.target_modules.0",
        "invalid_value",
        "pattern",
    ),
    (
        "a target that is a number",
        lora_with(target_modules=[3]),
        "method.lora.target_modules.0",
        "invalid_value",
        "string",
    ),
    (
        "a target the model does not have",
        lora_with(target_modules=["q_proj", "qkv_proj"]),
        "method.lora.target_modules",
        "invalid_value",
        "['qkv_proj'] match no module of the model",
    ),
    (
        "a target that is an embedding",
        lora_with(target_modules=["embed_tokens"]),
        "method.lora.target_modules",
        "invalid_value",
        "are not linear layers",
    ),
    (
        "a target that is a norm",
        lora_with(target_modules=["input_layernorm"]),
        "method.lora.target_modules",
        "invalid_value",
        "LlamaRMSNorm((64,), eps=1e-06) is not supported",
    ),
    ("an unknown lora field", lora_with(rank=8), "method.lora.rank", "invalid_value", "unknown"),
    (
        "a lora section with type supervised",
        lambda f: {
            "model": "tiny-llama",
            "training_file": f,
            "method": {"type": "supervised", "lora": {"r": 8}},
        },
        "method",
        "invalid_value",
        "method.lora belongs with method.type 'lora'",
    ),
    (
        "a supervised section with type lora",
        lambda f: {
            "model": "tiny-llama",
            "training_file": f,
            "method": {"type": "lora", "supervised": {}},
        },
        "method",
        "invalid_value",
        "method.supervised belongs with method.type 'supervised'",
    ),
    (
        "hyperparameters in method.lora and at the top level",
        lora_body(lora={"hyperparameters": {"n_epochs": 2}}, hyperparameters={"n_epochs": 1}),
        "body",
        "invalid_value",
        "method.lora.hyperparameters or at the top level",
    ),
    (
        "engine.lora with method lora",
        lora_body(engine={"lora": {"r": 8}}),
        "engine.lora",
        "invalid_value",
        "go in method.lora",
    ),
    (
        "engine.lora in a supervised job",
        lambda f: {"model": "tiny-llama", "training_file": f, "engine": {"lora": {"r": 8}}},
        "engine.lora",
        "invalid_value",
        "method.type 'lora'",
    ),
    (
        "lora on a zoo model",
        lora_body(model="gpt-tiny"),
        "model",
        "model_not_available",
        "zoo model",
    ),
]


@pytest.mark.parametrize("path", [JOBS, f"{JOBS}/validate"], ids=["create", "validate"])
@pytest.mark.parametrize(
    ("make", "param", "code", "words"), [c[1:] for c in BAD_LORA], ids=[c[0] for c in BAD_LORA]
)
def test_a_bad_lora_body_is_a_400_naming_the_field_and_stores_nothing(
    api, train_file, path, make, param, code, words
):
    before = stored_jobs(api)
    err = assert_envelope(post_json(api, path, make(train_file)), 400, param=param, code=code)
    assert words in err["message"], err
    assert stored_jobs(api) == before


def validate(api, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(f"{api.base}{JOBS}/validate", headers=api.headers(), json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_validate_plans_the_frozen_base_at_2_bytes_and_only_the_adapters_with_adam(api, train_file):
    from transformers import AutoConfig

    before = stored_jobs(api)
    common = {"model": "tiny-llama", "training_file": train_file, "engine": {"dtype": "bf16"}}
    full = validate(api, common)["estimate"]
    rep = validate(api, {**common, "method": {"type": "lora", "lora": LORA}})
    est = rep["estimate"]
    plan, lora = est["chunk_plan"], est["lora"]
    # adapters: r x (in + out) per adapted layer, counted independently of peft
    cfg = AutoConfig.from_pretrained(api.settings.models_dir / "tiny-llama")
    head = cfg.hidden_size // cfg.num_attention_heads
    per_layer = LORA["r"] * (cfg.hidden_size + cfg.num_attention_heads * head) + LORA["r"] * (
        cfg.hidden_size + cfg.num_key_value_heads * head
    )
    adapters = cfg.num_hidden_layers * per_layer
    base = full["chunk_plan"]["params"]
    assert lora["adapter_params"] == plan["trainable_params"] == adapters
    assert lora["base_params"] == base
    assert plan["params"] == base + adapters
    assert {k: lora[k] for k in LORA} == {**LORA, "alpha": 16.0}
    # bf16: the base 2 bytes per parameter, an adapter 2 + 4 (master) + 8 (Adam)
    assert lora["base_bytes"] == 2 * base
    assert lora["adapter_bytes"] == 14 * adapters
    assert lora["model_data_bytes"] == plan["model_data_bytes"] == 2 * base + 14 * adapters
    assert full["chunk_plan"]["model_data_bytes"] == 14 * base
    assert full["chunk_plan"]["model_data_bytes_per_param"] == 14
    assert lora["model_data_bytes_per_param"] < 2.5
    assert plan["model_data_bytes"] * 5 < full["chunk_plan"]["model_data_bytes"]
    assert plan["lists"]["frozen"]["chunks"] > 0
    assert full["chunk_plan"]["lists"]["frozen"]["chunks"] == 0
    # placed per tier, the base and the adapters adding up to the rank's chunks
    at_start = lora["per_rank_chunk_bytes_at_start"]
    tiers = est["per_rank"]["tiers_at_start"]
    for tier in ("device", "host", "disk"):
        assert at_start["base"][tier] + at_start["adapters"][tier] == tiers[tier]["chunk_bytes"]
    assert sum(at_start["base"].values()) == plan["lists"]["frozen"]["bytes"]
    assert rep["fits"] is True
    assert "lora" not in full
    assert stored_jobs(api) == before


def test_validate_moves_the_base_off_the_host_when_its_budget_is_short(api, train_file):
    """Host budget below the chunks: what it cannot hold goes to the device, then disk,
    the param lists first (as the engine's `enforce_budgets` moves them): the base."""
    probe = validate(
        api,
        {
            "model": "tiny-llama",
            "training_file": train_file,
            "method": {"type": "lora", "lora": LORA},
        },
    )["estimate"]
    lists = probe["per_rank"]["lists_at_start"]
    frozen = lists["frozen"]["host"]
    host = sum(v["host"] for v in lists.values()) - frozen // 2
    est = validate(
        api,
        {
            "model": "tiny-llama",
            "training_file": train_file,
            "method": {"type": "lora", "lora": LORA},
            "engine": {
                "memory": {"host_budget": host, "disk_budget": 1 << 30, "device_budget": 1 << 30}
            },
        },
    )["estimate"]
    base = est["lora"]["per_rank_chunk_bytes_at_start"]["base"]
    assert base["host"] < frozen
    assert base["device"] + base["disk"] > 0
    assert sum(base.values()) == est["chunk_plan"]["lists"]["frozen"]["bytes"]


# -- the model a LoRA job registers, and checkpoint downloads ------------------------------


def _write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def finished_lora_job(api, train_file: str):
    """A LoRA job as the driver leaves it: two checkpoints (each with its adapter), the
    export (merged model + adapter/), succeeded with its model registered."""
    job = lora_job(api, train_file)
    root = api.settings.runs_dir / job.id / "ray" / job.id
    cks = []
    for step, final in ((5, False), (10, True)):
        d = root / f"checkpoint_step{step:09d}_a1"
        _write(d / "pstar_checkpoint.json", b"{}")
        _write(d / "adapter" / "adapter_config.json", json.dumps({"r": 8, "step": step}).encode())
        # a few MiB, not a multiple of 512: several reads and a padded tar block
        _write(d / "adapter" / "adapter_model.safetensors", os.urandom(3 * 2**20 + 7))
        cks.append(
            api.store.checkpoints.add(
                job.id,
                step,
                {},
                str(d),
                keep=3,
                final=final,
                attempt=driver_attempt(api.store, job.id),
            )
        )
    export = api.settings.finetuned_dir(job.id)
    _write(export / "config.json", b'{"model_type": "llama"}')
    _write(export / "model.safetensors", os.urandom(4096))
    _write(export / "tokenizer.json", b"{}")
    _write(export / "adapter" / "adapter_config.json", b"{}")
    name = f"ft:tiny-llama::{job.id}"
    # as the reconciler and a driver move it (a job still validating its files cannot
    # succeed: the status table); a job the reconciler already started stays running
    api.store.jobs.update(job.id, status="queued")
    assert api.store.jobs.update(
        job.id, status="succeeded", fine_tuned_model=name, finished_at=int(time.time())
    )
    return job, cks, name


def content(api, job_id: str, ck_id: str, tenant: str = "acme", **params: str):
    url = f"{api.base}{JOBS}/{job_id}/checkpoints/{ck_id}/content"
    return httpx.get(url, headers=api.headers(tenant), params=params, timeout=60)


def untar(data: bytes) -> dict[str, bytes]:
    with tarfile.open(fileobj=io.BytesIO(data)) as t:
        return {m.name: t.extractfile(m).read() for m in t.getmembers()}


def test_a_lora_jobs_model_is_its_adapter_on_the_model_it_started_from(api, train_file):
    c = api.client()
    job, _cks, name = finished_lora_job(api, train_file)
    listed = {m.id: m for m in c.models.list()}[name]
    got = c.models.retrieve(name)
    for m in (listed, got):
        assert m.model_extra["kind"] == "fine-tuned"
        assert m.model_extra["adapter"] is True
        assert m.model_extra["adapter_base"] == "tiny-llama"
        assert m.model_extra["base"] == "tiny-llama"
    assert c.models.retrieve("tiny-llama").model_extra["adapter"] is False
    # a job on it fine-tunes the merged model, a plain transformers directory
    again = c.fine_tuning.jobs.create(
        model=name,
        training_file=train_file,
        method={"type": "lora"},  # type: ignore[arg-type]
    )
    plan = api.store.jobs.get(again.id).plan
    assert plan["model"]["path"] == str(api.settings.finetuned_dir(job.id))
    assert plan["base_model"] == "tiny-llama"


def test_every_lora_checkpoint_downloads_as_its_adapter_and_the_final_one_merged(api, train_file):
    c = api.client()
    job, cks, _ = finished_lora_job(api, train_file)
    listed = {ck.id: ck for ck in c.fine_tuning.jobs.checkpoints.list(job.id)}
    assert listed[cks[0].id].model_extra["variants"] == ["adapter"]
    assert listed[cks[1].id].model_extra["variants"] == ["adapter", "merged"]
    for ck in cks:
        r = content(api, job.id, ck.id)  # adapter: a LoRA job's default
        assert r.status_code == 200, r.text
        assert r.headers["content-type"] == "application/x-tar"
        assert int(r.headers["content-length"]) == len(r.content)
        assert f"{job.id}-step{ck.step}-adapter.tar" in r.headers["content-disposition"]
        d = Path(ck.path) / "adapter"
        assert untar(r.content) == {p.name: p.read_bytes() for p in d.iterdir()}
    r = content(api, job.id, cks[1].id, variant="merged")
    assert r.status_code == 200, r.text
    # the merged model's files, without the adapter directory beside them
    assert sorted(untar(r.content)) == ["config.json", "model.safetensors", "tokenizer.json"]


def test_a_checkpoint_variant_that_is_not_there_is_a_404_saying_which_there_are(api, train_file):
    job, cks, _ = finished_lora_job(api, train_file)
    err = assert_envelope(content(api, job.id, cks[0].id, variant="merged"), 404, "variant")
    assert err["code"] == "variant_not_available"
    assert "only the final checkpoint" in err["message"]
    assert "'adapter'" in err["message"]  # what it has
    err = assert_envelope(content(api, job.id, cks[1].id, variant="full"), 404, "variant")
    assert "'adapter' or 'merged'" in err["message"]
    assert_envelope(content(api, job.id, cks[1].id, variant="zip"), 400, "variant")
    assert_envelope(content(api, job.id, "ftckpt-nope"), 404, "checkpoint_id")
    # a checkpoint of another job of the same tenant is not this job's
    other, other_cks, _ = finished_lora_job(api, train_file)
    assert_envelope(content(api, job.id, other_cks[0].id), 404, "checkpoint_id")
    # Ray removed the checkpoint's files: the adapter is gone, said so
    import shutil

    shutil.rmtree(Path(other_cks[0].path))
    err = assert_envelope(content(api, other.id, other_cks[0].id), 404, "variant")
    assert "no longer" in err["message"]


def test_another_tenant_gets_404_for_a_checkpoints_content(api, train_file):
    job, cks, _ = finished_lora_job(api, train_file)
    r = content(api, job.id, cks[1].id, tenant="rival")
    assert_envelope(r, 404, "fine_tuning_job_id")
    assert (
        httpx.get(f"{api.base}{JOBS}/{job.id}/checkpoints/{cks[1].id}/content").status_code == 401
    )


def test_a_full_fine_tuning_jobs_final_checkpoint_downloads_as_the_full_model(api, train_file):
    c = api.client()
    job = c.fine_tuning.jobs.create(model="tiny-llama", training_file=train_file)
    root = api.settings.runs_dir / job.id / "ray" / job.id
    att = driver_attempt(api.store, job.id)
    mid = api.store.checkpoints.add(job.id, 5, {}, str(root / "a"), keep=3, attempt=att)
    last = api.store.checkpoints.add(
        job.id, 10, {}, str(root / "b"), keep=3, final=True, attempt=att
    )
    err = assert_envelope(content(api, job.id, last.id), 404, "variant")
    assert "not exported" in err["message"]  # not yet: the final checkpoint precedes it
    export = api.settings.finetuned_dir(job.id)
    _write(export / "config.json", b"{}")
    _write(export / "model.safetensors", b"x" * 1000)
    r = content(api, job.id, last.id)
    assert r.status_code == 200, r.text
    assert untar(r.content) == {"config.json": b"{}", "model.safetensors": b"x" * 1000}
    assert untar(content(api, job.id, last.id, variant="full").content) == untar(r.content)
    err = assert_envelope(content(api, job.id, mid.id), 404, "variant")
    assert "only the final checkpoint" in err["message"]
    err = assert_envelope(content(api, job.id, last.id, variant="adapter"), 404, "variant")
    assert "download as 'full'" in err["message"]
    listed = {ck.id: ck for ck in c.fine_tuning.jobs.checkpoints.list(job.id)}
    assert listed[last.id].model_extra["variants"] == ["full"]
    assert listed[mid.id].model_extra["variants"] == []
