"""What one optimizer step of a training method does, and what its evaluation measures.

A training method is an objective the one worker loop (`service.worker.loop.run_loop`) calls,
not a copy of the loop: the loop keeps batching, metrics, checkpoints, pause, early
stopping and resume the same for every method; an objective says what a step does with
this rank's rows (`train_step`) and what a held-out evaluation measures (`evaluate`).

- `Supervised` (supervised and LoRA jobs, `pstar train`): next-token cross-entropy on the
  labelled tokens, the model's own loss.
- `service.methods.dpo_objective.DPO` (preference pairs): the sigmoid DPO loss against a
  reference policy.

Rows come from the prepared data (`service.data.rows.load_rows`) as a `Split`; a batch
is `Rows`: token ids, labels and, for packed rows, the position ids that restart at each
example (the model is then called with them and without a cache, see `service.data.packing`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist


class Rows(NamedTuple):
    """A batch of rows (or, for DPO, of pairs: a dimension of 2 after the first)."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor | None = None
    # DPO: the reference policy's log-probabilities of both answers, (pairs, 2)
    reference: torch.Tensor | None = None
    # the rows' indices in their split (on the CPU): what an objective keeps per row beside
    # the tokens (a reinforcement prompt's item) is found by them
    index: torch.Tensor | None = None

    def slices(self, n: int) -> list[Rows]:
        """`n` consecutive slices along the batch (micro-batches)."""
        parts = [t.chunk(n) if t is not None else [None] * n for t in self]
        return [Rows(*p) for p in zip(*parts, strict=True)]

    def model_inputs(self) -> dict[str, Any]:
        """Keyword arguments of the model's forward for these rows."""
        kw: dict[str, Any] = {"input_ids": self.input_ids, "labels": self.labels}
        if self.position_ids is not None:
            # positions restart at every packed example; transformers then masks attention
            # to each example's own block, which it only does without a cache
            kw["position_ids"] = self.position_ids
            kw["use_cache"] = False
        return kw


@dataclass
class Split:
    """The train or validation rows of a prepared data file."""

    ids: torch.Tensor
    labels: torch.Tensor
    lengths: torch.Tensor | None = None  # real (not padding) tokens per row
    position_ids: torch.Tensor | None = None
    reference: torch.Tensor | None = None  # DPO: set by its reference pass

    @classmethod
    def of(cls, data: dict[str, torch.Tensor], name: str) -> Split | None:
        if f"{name}_ids" not in data:
            return None
        return cls(
            data[f"{name}_ids"],
            data[f"{name}_labels"],
            data.get(f"{name}_lengths"),
            data.get(f"{name}_position_ids"),
        )

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.ids.shape[-1])

    def rows(self, idx: torch.Tensor, device: torch.device) -> Rows:
        def pick(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None:
                return None
            got = t[idx]  # token ids and labels are stored int32: the model takes int64
            return got.to(device, dtype=None if got.is_floating_point() else torch.long)

        picked = (pick(t) for t in (self.ids, self.labels, self.position_ids, self.reference))
        return Rows(*picked, index=idx)

    def head(self, n: int) -> Split:
        """The first `n` rows."""

        def cut(t: torch.Tensor | None) -> torch.Tensor | None:
            return t[:n] if t is not None else None

        parts = (self.ids, self.labels, self.lengths, self.position_ids, self.reference)
        return Split(*(cut(t) for t in parts))


def token_stats(logits: torch.Tensor, labels: torch.Tensor) -> tuple[float, int]:
    """(correct next-token predictions, tokens counted) where labels are not ignored."""
    pred = logits[:, :-1].argmax(-1)
    tgt = labels[:, 1:].to(pred.device)
    mask = tgt != -100
    return float((pred == tgt)[mask].sum()), int(mask.sum())


def all_sum(values: list[float], device: torch.device) -> list[float]:
    """Sum across ranks (on the engine's device: NCCL takes no CPU tensors)."""
    return all_sum_tensor(torch.tensor(values, dtype=torch.float64), device).tolist()


def all_sum_tensor(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` summed across ranks, moved to `device` for the collective and back."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return t
    on = t.to(device)
    dist.all_reduce(on)
    return on.to(t.device)


def eval_rounds(n: int, rank: int, world: int, batch: int):
    """(row indices, which of them are real) of this rank's evaluation batches over `n`
    rows: every rank runs the same number of forwards (ZeRO's gathers are collective), a
    rank short of rows repeats some, which must then count nothing."""
    per_rank = math.ceil(n / world)
    for r in range(math.ceil(per_rank / batch)):
        idx = (torch.arange(batch) + r * batch) * world + rank
        yield idx % n, idx < n


@torch.no_grad()
def evaluate(engine: Any, split: Split, rank: int, world: int, batch: int):
    """(mean loss per token, token accuracy) over the rows, split evenly over the ranks."""
    loss_sum = correct = count = 0.0
    engine.eval()
    for idx, real in eval_rounds(len(split), rank, world, batch):
        rows = split.rows(idx, engine.device)
        y = rows.labels.clone()
        y[~real.to(y.device)] = -100  # wrapped rows keep the shapes equal but count nothing
        out = engine(**rows._replace(labels=y).model_inputs())
        c, k = token_stats(out.logits, y)
        if k:
            loss_sum += float(out.loss) * k
        correct += c
        count += k
    engine.train()
    loss_sum, correct, count = all_sum([loss_sum, correct, count], engine.device)
    return (loss_sum / count, correct / count) if count else (float("nan"), float("nan"))


def backward(engine: Any, loss: Any, last: bool) -> None:
    """Backward of one micro-batch; the step's last also steps, with host Adam beside
    its backward where that is exact (`Engine.backward_and_step`)."""
    if last:
        engine.backward_and_step(loss)
    else:
        engine.backward(loss)


class Supervised:
    """Next-token cross-entropy on the labelled tokens (the model's own loss): supervised
    and LoRA fine-tuning, and `pstar train`."""

    name = "supervised"

    def prepare(
        self, engine: Any, splits: dict[str, Split], rank: int, world: int, batch: int, sink: Any
    ) -> None:
        """Nothing to compute before the first step (DPO's reference pass is the other
        kind of objective)."""

    def train_step(self, engine: Any, rows: Rows, micro_batches: int) -> dict[str, float]:
        """Forward and backward over `micro_batches` slices of this rank's rows, then the
        optimizer step. What it returns are sums over this rank's rows (the loop adds them
        over the ranks): `loss_sum` over tokens, `correct` predictions, `count` tokens.
        With more than one slice each slice's mean loss is weighted by its share of the
        tokens, so the gradient is that of the whole batch at once."""
        parts = rows.slices(micro_batches)
        if len(parts) == 1:
            shares, total = [1], 1
        else:
            shares = [int((p.labels[:, 1:] != -100).sum()) for p in parts]
            total = max(1, sum(shares))
        loss_sum = correct = count = 0.0
        for i, (part, share) in enumerate(zip(parts, shares, strict=True)):
            out = engine(**part.model_inputs())
            c, k = token_stats(out.logits.detach(), part.labels)
            loss = out.loss
            if len(parts) > 1:
                # a slice with no labelled token has a NaN mean loss; it still takes part
                # in backward (ZeRO's reductions are collective), with a zero gradient
                weighted = loss * (share / total) if share else out.logits.sum() * 0.0
            del out  # the logits (batch x seq x vocab) are not kept through backward, step
            backward(engine, loss if len(parts) == 1 else weighted, i == len(parts) - 1)
            if k:
                loss_sum += float(loss.detach()) * k
            correct += c
            count += k
        return {"loss_sum": loss_sum, "correct": correct, "count": count}

    @staticmethod
    def values(sums: dict[str, float]) -> dict[str, float]:
        """The step's metrics from the sums over all ranks."""
        count = max(sums["count"], 1)
        return {
            "train_loss": sums["loss_sum"] / count,
            "train_mean_token_accuracy": sums["correct"] / count,
        }

    def evaluate(self, engine: Any, split: Split, rank: int, world: int, batch: int):
        """{valid_loss, valid_mean_token_accuracy} over the rows (see `evaluate`)."""
        loss, acc = evaluate(engine, split, rank, world, batch)
        return {"valid_loss": loss, "valid_mean_token_accuracy": acc}
