"""The job spec: each setting stored once, the engine's config composed from them as the
plans before it held it, and migration 0007 bringing stored plans to its shape."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError
from sqlalchemy import text

from service.spec.job import JobSpec, spec_of
from service.store import Store
from tests.service.test_store import add_job, spec_plan

LORA = {"r": 4, "alpha": 8.0, "dropout": 0.0, "target_modules": ["q_proj"]}

# plans as stored before 0007, each with the engine config its workers got
OLD_PLANS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "lora on a GPU": (
        {
            "base_model": "tiny-llama",
            "method": {"type": "lora", "lora": LORA},
            "model": {"id": "tiny-llama", "kind": "base", "path": "/m/tiny-llama"},
            "training_file": {"id": "file-1", "format": "chat", "examples": 8},
            "validation_file": None,
            "hyperparameters": {
                "n_epochs": 3,
                "batch_size": 8,
                "learning_rate_multiplier": 2.0,
                "learning_rate": 2e-4,
                "max_steps": None,
                "seq_len": "auto",
                "eval_every": None,
                "packing": "auto",
            },
            "engine": {
                "dtype": "bf16",
                "optimizer": {"lr": 2e-4, "betas": [0.9, 0.95]},
                "device": "cuda",
                "lora": LORA,
            },
            "resources": {"num_workers": 2, "use_gpu": True, "cpus_per_worker": 4.0},
            "checkpoint_every": 5,
            "suffix": "x",
            "early_stopping": {"patience": 2, "min_delta": 0.0, "warmup_evals": 0},
        },
        {
            "dtype": "bf16",
            "optimizer": {"lr": 2e-4, "betas": [0.9, 0.95]},
            "device": "cuda",
            "lora": LORA,
        },
    ),
    "before methods, packing and base_model": (
        {
            "model": {"id": "gpt-tiny", "kind": "zoo", "path": None},
            "training_file": {"id": "file-2", "format": "text", "examples": 3},
            "validation_file": None,
            "hyperparameters": {
                "n_epochs": 1,
                "batch_size": 2,
                "learning_rate_multiplier": 1.0,
                "learning_rate": 1e-3,
                "max_steps": 4,
                "seq_len": 64,
                "eval_every": None,
            },
            "engine": {"optimizer": {"lr": 1e-3}, "device": "cpu"},
            "resources": {"num_workers": 1, "use_gpu": False, "cpus_per_worker": 1.0},
            "checkpoint_every": None,
            "suffix": None,
            "early_stopping": None,
        },
        {"optimizer": {"lr": 1e-3}, "device": "cpu"},
    ),
    "dpo": (
        {
            "base_model": "tiny-llama",
            "method": {"type": "dpo"},
            "model": {"id": "tiny-llama", "kind": "base", "path": "/m/tiny-llama"},
            "training_file": {"id": "file-3", "format": "preference", "examples": 4},
            "validation_file": {"id": "file-4", "format": "preference", "examples": 2},
            "hyperparameters": {
                "n_epochs": 1,
                "batch_size": 2,
                "learning_rate_multiplier": 1.0,
                "learning_rate": 1e-4,
                "max_steps": None,
                "seq_len": "auto",
                "eval_every": 2,
                "packing": "auto",
                "beta": 0.25,
            },
            "engine": {"optimizer": {"lr": 1e-4}, "device": "cpu"},
            "resources": {"num_workers": 1, "use_gpu": False, "cpus_per_worker": 1.0},
            "checkpoint_every": None,
            "suffix": None,
            "early_stopping": None,
        },
        {"optimizer": {"lr": 1e-4}, "device": "cpu"},
    ),
}


def _at_0006_with(store: Store, plans: dict[str, dict[str, Any]]) -> dict[str, str]:
    """Jobs holding `plans` in a store that says it is at revision 0006 (0007 changes no
    table, only the rows; the later revisions are undone by their own downgrades)."""
    ids = {}
    for name, plan in plans.items():
        job = add_job(store)
        with store.db.write() as s:
            s.execute(
                text("UPDATE jobs SET plan = :p WHERE id = :i"),
                {"p": json.dumps(plan), "i": job.id},
            )
        ids[name] = job.id
    _downgrade(store, "0007")
    with store.db.write() as s:
        s.execute(text("UPDATE alembic_version SET version_num = '0006'"))
    return ids


def _downgrade(store: Store, revision: str) -> None:
    from alembic import command
    from alembic.config import Config

    from service.store import MIGRATIONS

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    with store.db.writing() as conn:
        cfg.attributes["connection"] = conn
        command.downgrade(cfg, revision)


def _plan_of(store: Store, job_id: str) -> dict[str, Any]:
    """A job's stored plan read with SQL (the ORM's row has columns an old schema lacks)."""
    with store.db.read() as s:
        raw = s.execute(text("SELECT plan FROM jobs WHERE id = :i"), {"i": job_id}).scalar()
    return raw if isinstance(raw, dict) else json.loads(raw)


def test_migration_0007_brings_every_stored_plan_to_the_spec_with_the_same_engine_config(
    fresh_store,
):
    ids = _at_0006_with(fresh_store, {k: plan for k, (plan, _) in OLD_PLANS.items()})
    fresh_store.migrate()
    for name, (old, engine) in OLD_PLANS.items():
        spec = spec_of(fresh_store.jobs.get(ids[name]))
        assert spec.engine_config() == engine, name
        assert spec.hyperparameters.learning_rate == old["hyperparameters"]["learning_rate"]
        # stored once: no copy of the learning rate, the device or the adapters in `engine`
        assert "lr" not in spec.engine.get("optimizer", {})
        assert "device" not in spec.engine
        assert "lora" not in spec.engine
    old_style = spec_of(fresh_store.jobs.get(ids["before methods, packing and base_model"]))
    assert old_style.training_method.name == "supervised"
    assert old_style.base_model == fresh_store.jobs.get(ids["dpo"]).model  # the job's model
    assert old_style.hyperparameters.packing is False
    dpo = spec_of(fresh_store.jobs.get(ids["dpo"]))
    assert dpo.hyperparameters.model_extra == {"beta": 0.25}
    assert spec_of(fresh_store.jobs.get(ids["lora on a GPU"])).method.lora.settings() == LORA


def test_migration_0007_down_gives_back_the_plans_the_old_code_read(fresh_store):
    (plan, engine) = OLD_PLANS["lora on a GPU"]
    ids = _at_0006_with(fresh_store, {"lora": plan})
    fresh_store.migrate()
    _downgrade(fresh_store, "0006")
    back = _plan_of(fresh_store, ids["lora"])
    assert back["engine"] == engine
    assert back["method"] == plan["method"]
    assert back["hyperparameters"] == plan["hyperparameters"]


def test_a_spec_is_frozen_and_refuses_what_it_does_not_know():
    spec = JobSpec.model_validate(spec_plan())
    with pytest.raises(ValidationError):
        spec.suffix = "changed"  # type: ignore[misc]
    with pytest.raises(ValidationError, match="surprise"):
        JobSpec.model_validate({**spec_plan(), "surprise": 1})
    with pytest.raises(ValidationError, match="version"):
        JobSpec.model_validate({**spec_plan(), "version": 2})
    assert JobSpec.model_validate(spec.stored()) == spec
