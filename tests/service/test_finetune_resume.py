"""A new attempt resumes from the newer of Ray Train's registered checkpoint and the one the
store recorded (Ray persists its registry a moment after `report` returns)."""

from __future__ import annotations

import pytest
import ray.train

import pstar_core
from service.finetune import _resume
from tests.core.helpers import MODELS, batches, engine_config, run_engine


class _Rep:
    def __init__(self) -> None:
        self.phases: list[str] = []

    def phase(self, detail: str) -> None:
        self.phases.append(detail)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Checkpoints of one tiny run at step 2 and step 4."""
    root = tmp_path_factory.mktemp("ckpts")
    engine = pstar_core.initialize(MODELS["gpt"], engine_config())
    data = batches(4)
    run_engine(engine, data[:2])
    engine.save_checkpoint(root / "step2")
    run_engine(engine, data[2:])
    engine.save_checkpoint(root / "step4")
    return root


def _fresh():
    return pstar_core.initialize(MODELS["gpt"], engine_config())


@pytest.mark.parametrize(
    ("ray_has", "store_has", "expect"),
    [
        (None, None, 0),  # a first attempt: nothing to resume
        ("step4", None, 4),  # a worker group restarted inside one attempt
        (None, "step2", 2),  # Ray's registry was not persisted before the driver died
        ("step2", "step4", 4),  # Ray's registry is one checkpoint behind the store
        ("step4", "step2", 4),  # the store's record is older: Ray's wins
        (None, "missing", 0),  # the recorded directory is gone: start over, no crash
    ],
)
def test_resume_takes_the_newer_of_rays_and_the_stores_checkpoint(
    saved, monkeypatch, ray_has, store_has, expect
):
    ray_ckpt = ray.train.Checkpoint.from_directory(str(saved / ray_has)) if ray_has else None
    monkeypatch.setattr(ray.train, "get_checkpoint", lambda: ray_ckpt)
    run = {"resume_from": str(saved / store_has) if store_has else None}
    engine, rep = _fresh(), _Rep()
    assert _resume(engine, run, rep) is (expect > 0)
    assert engine.global_step == expect
    assert rep.phases == (["recovering"] if expect else [])
