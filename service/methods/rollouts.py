"""A reinforcement job's answers sampled by the model server (`sampler: server`): the same
generator that answers `/v1/chat/completions` and the `tinker` SDK's samplers (batched
prefill, a prompt's keys and values shared by its group), holding the base model, with
the job's adapters synced to it every step.

Each time the weights change (a step, and before the first), every rank takes part in
exporting the adapters (`engine.export_hf(..., variant="adapter")`: rank 0 writes them,
as peft does, under `<job dir>/sampler/attempt-<n>/step-<k>`); each rank then asks
`POST /v1/internal/jobs/{job}/rollouts` (the API's `api.routes.rollouts`) with the job's
own key for its prompts' answers by those weights. The model server loads the adapter as
the request joins its batch, beside every other adapter it serves, with no restart; the
previous step's directory is removed (the servers drop an adapter whose directory is
gone). A directory is never written twice, so a server cannot answer with stale weights
of the same name.

Sampling there needs no collective (the engine's sampling runs a ZeRO gather each token):
ranks sample side by side. Each prompt is seeded by (the run's seed, the step, the rank,
the prompt), but which requests a server batches together is its own affair, so a
resumed run's answers match the uninterrupted run's to within those batches' rounding,
not bit for bit (sampling on the engine is bitwise). A sampled token's log-probability is
the sampler's, under its temperature, as Tinker's samplers report it.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROLLOUTS = "/v1/internal/jobs/{job}/rollouts"


@dataclass
class Answer:
    """One sampled answer, by the engine or the model server."""

    tokens: list[int]  # the sampled tokens, the ending one included when there is one
    logprobs: list[float]  # the sampler's log-probability of each, at sampling time
    ended: bool  # it ended with an end-of-turn token (not cut at the length limit)


def sampler_dir(job_dir: Path, attempt: int) -> Path:
    """Where an attempt of a job exports its adapters for the model server."""
    return job_dir / "sampler" / f"attempt-{attempt}"


def weights_dir(sampler_dir: Path, step: int) -> Path:
    """Where the adapters of `step` are exported for the model server."""
    return sampler_dir / f"step-{step}"


@dataclass
class ServerSampler:
    """The job's answers from the model server (see the module docstring)."""

    url: str  # the API's
    key: str  # the job's own key (service.control.grader_access)
    job_id: str
    attempt: int
    sampler_dir: Path  # <job dir>/sampler/attempt-<n>
    patience_s: float = 600.0  # how long a server that does not answer is asked again
    synced: int | None = None  # the step whose adapters the server was last given
    post: Any = field(default=None, repr=False)  # api_client.api_rollouts's call

    def __post_init__(self) -> None:
        if self.post is None:
            from service.methods.api_client import api_rollouts

            path = ROLLOUTS.format(job=self.job_id)
            self.post = api_rollouts(self.url, self.key, path, patience_s=self.patience_s)

    def sync(self, engine: Any, rank: int) -> int:
        """Export the engine's adapters for the server unless this step's already are
        (every rank calls it: the export gathers with ZeRO); the step they are of."""
        step = int(engine.global_step)
        if self.synced != step:
            engine.export_hf(weights_dir(self.sampler_dir, step), variant="adapter")
            if rank == 0:
                self._forget(step)
            self.synced = step
        return step

    def _forget(self, keep: int) -> None:
        """The earlier steps' adapters, and earlier attempts' (rank 0)."""
        for old in self.sampler_dir.glob("step-*"):
            if old.name != f"step-{keep}":
                shutil.rmtree(old, ignore_errors=True)
        for old in self.sampler_dir.parent.glob("attempt-*"):
            if old != self.sampler_dir:
                shutil.rmtree(old, ignore_errors=True)

    def sample(
        self,
        engine: Any,
        prompts: list[list[int]],
        n: int,
        max_tokens: int,
        temperature: float,
        stop: set[int],
        rank: int,
        seed: int,
    ) -> list[Answer]:
        """`n` answers to each prompt (the prompt's n, then the next prompt's), by the
        engine's weights as they are now, from the model server; prompt i is seeded by
        `seed` + i."""
        step = self.sync(engine, rank)
        got = self.post(
            {
                "attempt": self.attempt,
                "step": step,
                "prompts": prompts,
                "n": n,
                "max_tokens": max_tokens,
                "temperature": temperature,
                "seed": seed % (1 << 31),
                "stop_token_ids": sorted(stop),
            }
        )
        answers = [
            Answer(list(s["tokens"]), list(s["logprobs"]), s["finish_reason"] == "stop")
            for s in got["samples"]
        ]
        if len(answers) != len(prompts) * n:
            raise RuntimeError(
                f"the model server sent {len(answers)} answers for {len(prompts)} prompts of {n}"
            )
        return answers
