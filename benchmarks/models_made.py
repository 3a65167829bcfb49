"""Fine-tuned models made without training, for the serving tests and `pstar bench serve`:
a succeeded job row whose export is a real PEFT adapter on a base model (random, non-zero
LoRA weights, so it changes the answers) and the same adapter merged, plus a checkpoint
whose adapter is a second one; or a full fine-tune (the base with perturbed weights). The
rows go straight into the service's store, as a driver's reports would have left them."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from pstar_core.hf import load_causal_lm
from service.registry import fine_tuned_name
from service.spec.job import (
    AdapterSpec,
    FileSpec,
    HyperparametersSpec,
    JobSpec,
    MethodSpec,
    ModelSpec,
)
from service.store import Checkpoint, Job, Store
from service.store.jobs import request_hash
from service.store.models import new_id


@dataclass
class Made:
    job_id: str
    model: str  # the fine-tuned model's id
    export: Path  # its directory (merged for a LoRA job)
    checkpoint: str | None = None  # a checkpoint's model id


def _adapter(base_dir: Path, out: Path, seed: int, scale: float = 0.5) -> None:
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    base = load_causal_lm(base_dir, dtype=torch.float32)
    cfg = LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False
    )
    peft = get_peft_model(base, cfg)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_" in name:
                p.mul_(scale / max(p.abs().max().item(), 1e-6))
    peft.save_pretrained(out)
    return peft


def _plan(base: str, base_dir: Path, method: MethodSpec) -> dict:
    """The spec a job fine-tuning `base` with `method` stored."""
    return JobSpec(
        base_model=base,
        method=method,
        model=ModelSpec(id=base, kind="base", path=str(base_dir)),
        training_file=FileSpec(id="file-none", format="chat", examples=1),
        hyperparameters=HyperparametersSpec(
            n_epochs=1, batch_size=1, learning_rate_multiplier=1.0, learning_rate=1e-4
        ),
    ).stored()


def _job(tenant: str, base: str, plan: dict, suffix: str) -> Job:
    now = int(time.time())
    body = {"model": base, "training_file": "file-none"}
    job = Job(
        id=new_id("ftjob"),
        tenant=tenant,
        model=base,
        training_file="file-none",
        seed=1,
        request=body,
        request_hash=request_hash(body),
        plan=plan,
        status="succeeded",
        progress_step=0,
        progress_total=0,
        result_files=[],
        attempt=1,
        max_attempts=1,
        cancel_requested=False,
        created_at=now,
        finished_at=now,
    )
    job.fine_tuned_model = fine_tuned_name(base, suffix, job.id)
    return job


def lora_model(
    store: Store,
    data_dir: Path,
    base: str = "tiny-llama",
    tenant: str = "acme",
    seed: int = 1,
    checkpoint: bool = True,
) -> Made:
    from transformers import AutoTokenizer

    base_dir = data_dir / "models" / base
    adapters = AdapterSpec(r=4, alpha=8.0, dropout=0.0, target_modules=["q_proj", "v_proj"])
    plan = _plan(base, base_dir, MethodSpec(type="lora", lora=adapters))
    job = _job(tenant, base, plan, "lora")
    export = data_dir / "models" / ".ft" / job.id
    peft = _adapter(base_dir, export / "adapter", seed=seed)
    peft.merge_and_unload().save_pretrained(export)
    AutoTokenizer.from_pretrained(base_dir).save_pretrained(export)
    store.jobs.create(job, "Created")
    if not checkpoint:
        return Made(job.id, job.fine_tuned_model, export)
    ck_dir = data_dir / "runs" / job.id / "checkpoint_000000"
    _adapter(base_dir, ck_dir / "adapter", seed=seed + 1000)
    with store.db.write() as s:  # as a driver's report would have recorded it
        s.add(
            Checkpoint(
                id=new_id("ftckpt"),
                job_id=job.id,
                step=5,
                metrics={},
                path=str(ck_dir),
                final=False,
                created_at=int(time.time()),
            )
        )
    return Made(job.id, job.fine_tuned_model, export, f"{job.fine_tuned_model}:ckpt-step-5")


def full_model(
    store: Store, data_dir: Path, base: str = "tiny-llama", tenant: str = "acme"
) -> Made:
    from transformers import AutoTokenizer

    base_dir = data_dir / "models" / base
    job = _job(tenant, base, _plan(base, base_dir, MethodSpec()), "full")
    export = data_dir / "models" / ".ft" / job.id
    torch.manual_seed(3)
    m = load_causal_lm(base_dir, dtype=torch.float32)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    m.save_pretrained(export)
    AutoTokenizer.from_pretrained(base_dir).save_pretrained(export)
    store.jobs.create(job, "Created")
    return Made(job.id, job.fine_tuned_model, export)


def greedy(model_dir: Path, messages: list[dict], max_new: int, adapter: Path | None = None) -> str:
    """transformers' own greedy `generate` on an exported directory (with a PEFT adapter
    on it), decoded as the API decodes: the reference the served answers must equal."""
    from transformers import AutoTokenizer

    from service.data.datasets import ensure_chat_template

    tok = AutoTokenizer.from_pretrained(model_dir)
    ensure_chat_template(tok)
    m = load_causal_lm(model_dir, dtype=torch.float32).eval()
    if adapter is not None:
        from peft import PeftModel

        m = PeftModel.from_pretrained(m, adapter).eval()
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = m.generate(ids, max_new_tokens=max_new, do_sample=False)
    return tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
