"""A new attempt resumes from the newer of Ray Train's registered checkpoint and the one the
store recorded (Ray persists its registry a moment after `report` returns)."""

from __future__ import annotations

import pytest
import ray.train

import pstar_core
from pstar_core.hf import load_causal_lm
from service.worker.finetune import resume
from tests.core.helpers import MODELS, batches, engine_config, run_engine
from tests.service.runs import run_plan


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
    run = run_plan(resume_from=str(saved / store_has) if store_has else None)
    engine, rep = _fresh(), _Rep()
    assert resume(engine, run, rep) is (expect > 0)
    assert engine.global_step == expect
    assert rep.phases == (["recovering"] if expect else [])


def test_a_lora_checkpoint_holds_its_adapter_and_resumes_to_the_same_model(tmp_path, monkeypatch):
    """What the worker loop writes for a LoRA job's checkpoint: the engine's chunks plus
    the PEFT adapter in `adapter/`; a new engine resumes from it, and the adapter on the
    base in peft gives the resumed engine's logits."""
    import shutil

    import torch
    from peft import PeftModel

    from service.worker.finetune import build_job_engine, checkpoint_dir_name, report_checkpoint
    from tests.tiny import make_tiny_llama

    base = make_tiny_llama(tmp_path / "base")
    lora = {"r": 4, "alpha": 8.0, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}
    run = run_plan(
        model={"id": "tiny", "kind": "base", "path": str(base)},
        method="lora",
        lora=True,
        engine={"dtype": "fp32", "optimizer": {"lr": 0.05}, "lora": lora},
    )
    torch.manual_seed(0)
    engine = build_job_engine(run)
    x = torch.randint(3, 300, (2, 16))
    for _ in range(2):
        engine.backward(engine(input_ids=x, labels=x).loss)
        engine.step()

    def report(metrics, checkpoint, checkpoint_dir_name):  # Ray persists the directory
        shutil.copytree(checkpoint.path, tmp_path / checkpoint_dir_name)

    class Rep(_Rep):
        attempt = 1

        def checkpoint(self, *args) -> None:
            pass

    Rep.run = run
    monkeypatch.setattr(ray.train, "report", report)
    report_checkpoint(engine, {}, Rep(), 2, final=False)
    saved = tmp_path / checkpoint_dir_name(2, 1)
    assert {p.name for p in (saved / "adapter").iterdir()} >= {
        "adapter_config.json",
        "adapter_model.safetensors",
    }
    fresh = build_job_engine(run)
    monkeypatch.setattr(ray.train, "get_checkpoint", lambda: ray.train.Checkpoint(str(saved)))
    assert resume(fresh, run, _Rep())
    assert fresh.global_step == 2
    with torch.no_grad():
        fresh.eval()
        ours = fresh(input_ids=x).logits
        model = load_causal_lm(base, dtype=torch.float32)
        theirs = PeftModel.from_pretrained(model, saved / "adapter").eval()(input_ids=x).logits
    torch.testing.assert_close(ours.cpu(), theirs, atol=1e-5, rtol=1e-5)
    trained = engine.stats()["trainable_params"]
    assert 0 < trained < engine.stats()["params"] // 10  # the adapters only
