"""Direct Preference Optimization (Rafailov et al., 2023) as an objective of the one
worker loop: the sigmoid loss on preference pairs against a frozen reference policy.

For a pair (prompt x, preferred answer y_w, other answer y_l), with log pi(y | x) summed
over the answer's tokens only (its labels, `service.data.preference`):

    r_w = beta * (log pi(y_w | x) - log ref(y_w | x))      the chosen reward
    r_l = beta * (log pi(y_l | x) - log ref(y_l | x))      the rejected reward
    loss = -log sigmoid(r_w - r_l)                          averaged over the pairs

The reference policy costs no second model in memory: its log-probabilities are computed
once, in one pass over the training and validation pairs before the first step, and kept
with the prepared data (`<data file>.ref.pt`; a resumed run reads them back). For a LoRA
job the reference is the base model, that is the same engine with its adapters disabled
(so the pass may also run after training began); for full fine-tuning it is the model
before the first step, which only that pass sees.

Metrics (summed over the ranks, then divided by the pairs): `train_loss`,
`chosen_reward`, `rejected_reward`, `reward_margin` (r_w - r_l), `reward_accuracy` (the
share of pairs with r_w > r_l), and for the validation pairs the same with `valid_`, plus
`valid_logp_margin` (log pi(y_w) - log pi(y_l): how much more likely the held-out preferred
answers are than the others).
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from service.methods.objectives import (
    Rows,
    Split,
    all_sum,
    all_sum_tensor,
    backward,
    eval_rounds,
)
from service.spec.run_plan import RunPlan

log = logging.getLogger(__name__)

DEFAULT_BETA = 0.1  # "auto" beta: the paper's and OpenAI's default

SUMS = ("loss_sum", "chosen", "rejected", "correct", "count")  # per rank, summed over ranks


def answer_logps(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log p of each row's labelled tokens, summed per row (fp32 or wider): (rows,)."""
    tgt = labels[:, 1:]
    nll = F.cross_entropy(
        logits[:, :-1].flatten(0, 1).float(), tgt.flatten(), ignore_index=-100, reduction="none"
    )
    return -nll.view(tgt.shape).sum(-1)


def dpo_terms(
    policy: torch.Tensor, reference: torch.Tensor, beta: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss per pair, chosen reward, rejected reward) from (pairs, 2) log-probabilities,
    the preferred answer first."""
    chosen = beta * (policy[:, 0] - reference[:, 0])
    rejected = beta * (policy[:, 1] - reference[:, 1])
    return -F.logsigmoid(chosen - rejected), chosen, rejected


def pair_inputs(rows: Rows) -> dict[str, Any]:
    """The model inputs of a batch of pairs: the preferred rows, then the other rows."""
    ids = rows.input_ids
    return {"input_ids": torch.cat([ids[:, 0], ids[:, 1]]), "use_cache": False}


def pair_labels(rows: Rows) -> torch.Tensor:
    return torch.cat([rows.labels[:, 0], rows.labels[:, 1]])


def policy_logps(engine: Any, rows: Rows) -> torch.Tensor:
    """(pairs, 2) log-probabilities of both answers of each pair, in one forward."""
    out = engine(**pair_inputs(rows))
    logps = answer_logps(out.logits, pair_labels(rows).to(out.logits.device))
    del out
    n = rows.input_ids.shape[0]
    return torch.stack([logps[:n], logps[n:]], dim=1)


def adapters_disabled(engine: Any):
    """The base model for the duration (a LoRA engine's adapters off); as is otherwise."""
    from pstar_core.lora import is_peft

    module = engine.module
    return module.disable_adapter() if is_peft(module) else contextlib.nullcontext()


class DPO:
    name = "dpo"

    def __init__(self, beta: float, lora: bool, ref_file: Path) -> None:
        self.beta, self.lora, self.ref_file = beta, lora, ref_file

    @classmethod
    def of(cls, run: RunPlan) -> DPO:
        """For a run: its beta (a job's spec has it decided), whether it trains adapters,
        and where the reference log-probabilities go (beside its rows)."""
        beta = (run.hyperparameters.model_extra or {}).get("beta", DEFAULT_BETA)
        return cls(float(beta), run.lora, run.ref_file)

    # -- the reference pass -----------------------------------------------------------------

    def prepare(
        self, engine: Any, splits: dict[str, Split], rank: int, world: int, batch: int, sink: Any
    ) -> None:
        """Attach the reference log-probabilities to every split: read back, or computed in
        one pass (every rank its share, summed) and written by rank 0."""
        if self.ref_file.is_file():
            saved = torch.load(self.ref_file, weights_only=True)
            for name, split in splits.items():
                split.reference = saved[name]
            return
        if engine.global_step > 0 and not self.lora:
            raise RuntimeError(
                f"the reference log-probabilities of this DPO run ({self.ref_file}) are gone, "
                f"and the model has trained {engine.global_step} steps since the reference was "
                "the model: they cannot be computed again; start the job anew"
            )
        sink.phase("reference pass")
        sink.event(
            "DPO: computing the reference policy's log-probabilities in one pass over "
            + ", ".join(f"{len(s)} {n} pairs" for n, s in splits.items())
            + (" (the base: adapters disabled)" if self.lora else " (the model before training)")
        )
        computed = {
            name: self._reference(engine, s, rank, world, batch) for name, s in splits.items()
        }
        for name, split in splits.items():
            split.reference = computed[name]
        if rank == 0:
            tmp = self.ref_file.with_suffix(".tmp")
            torch.save(computed, tmp)
            os.replace(tmp, self.ref_file)

    @torch.no_grad()
    def _reference(self, engine: Any, split: Split, rank: int, world: int, batch: int):
        out = torch.zeros(len(split), 2, dtype=torch.float64)
        engine.eval()
        with adapters_disabled(engine):
            for idx, real in eval_rounds(len(split), rank, world, batch):
                logps = policy_logps(engine, split.rows(idx, engine.device)).double().cpu()
                out[idx[real]] = logps[real]
        engine.train()
        # each pair was computed by exactly one rank; the others hold zeros there
        return all_sum_tensor(out, engine.device)

    # -- a step -------------------------------------------------------------------------

    def train_step(self, engine: Any, rows: Rows, micro_batches: int) -> dict[str, float]:
        """Forward both answers of each pair and backward the mean DPO loss over this
        rank's pairs, in `micro_batches` slices weighted by their pairs, then the step."""
        parts = rows.slices(micro_batches)
        total = rows.input_ids.shape[0]
        sums = dict.fromkeys(SUMS, 0.0)
        for i, part in enumerate(parts):
            n = part.input_ids.shape[0]
            logps = policy_logps(engine, part)
            assert part.reference is not None  # attached by `prepare`
            ref = part.reference.to(logps)
            loss, chosen, rejected = dpo_terms(logps, ref, self.beta)
            backward(engine, loss.sum() / total, i == len(parts) - 1)
            self._add(sums, loss, chosen, rejected, n)
        return sums

    @staticmethod
    def _add(sums, loss, chosen, rejected, n) -> None:
        sums["loss_sum"] += float(loss.detach().sum())
        sums["chosen"] += float(chosen.detach().sum())
        sums["rejected"] += float(rejected.detach().sum())
        sums["correct"] += float((chosen > rejected).sum())
        sums["count"] += n

    @staticmethod
    def values(sums: dict[str, float], prefix: str = "") -> dict[str, float]:
        n = max(sums["count"], 1)
        loss = "valid_loss" if prefix else "train_loss"
        out = {
            loss: sums["loss_sum"] / n,
            f"{prefix}chosen_reward": sums["chosen"] / n,
            f"{prefix}rejected_reward": sums["rejected"] / n,
            f"{prefix}reward_margin": (sums["chosen"] - sums["rejected"]) / n,
            f"{prefix}reward_accuracy": sums["correct"] / n,
        }
        if "logp_margin" in sums:
            out[f"{prefix}logp_margin"] = sums["logp_margin"] / n
        return out

    @torch.no_grad()
    def evaluate(self, engine: Any, split: Split, rank: int, world: int, batch: int):
        sums = dict.fromkeys((*SUMS, "logp_margin"), 0.0)
        engine.eval()
        for idx, real in eval_rounds(len(split), rank, world, batch):
            rows = split.rows(idx, engine.device)
            logps = policy_logps(engine, rows)
            keep = real.to(logps.device)
            assert rows.reference is not None  # attached by `prepare`
            loss, chosen, rejected = dpo_terms(logps, rows.reference.to(logps), self.beta)
            self._add(sums, loss[keep], chosen[keep], rejected[keep], int(keep.sum()))
            sums["logp_margin"] += float((logps[:, 0] - logps[:, 1])[keep].sum())
        engine.train()
        summed = all_sum(list(sums.values()), engine.device)
        return self.values(dict(zip(sums, summed, strict=True)), prefix="valid_")
