"""The reinforcement objective (`service.methods.reinforcement`): a GRPO-style step.

Each step a rank takes its prompts of the batch and, for each, samples `group_size`
answers from the model as it is now (`sample`); the grader scores every answer
(`service.methods.graders.grade`, on this worker); an answer's advantage is its reward
less its group's mean, over the group's standard deviation (0 when the group agrees: it
teaches nothing). The update is the training primitives' own loss
(`service.sessions.losses.run`, what the `tinker` SDK's `forward_backward` runs), with
`importance_sampling` or `ppo` over the answer tokens, the sampler's log-probabilities
being the policy's at sampling time, then the optimizer step. A rank's loss is the mean
over its answers of their token sums; ZeRO averages the ranks.

Answers are sampled where the job's `sampler` says:
- `engine` (a full fine-tune's): on the engine itself, every rank the same number of
  forwards (ZeRO's gathers are collective: decoding goes on until every rank's answers
  have ended), the prompts left-padded and prefilled at once, then one token a forward
  with the key-value cache. Seeds come from the run's seed, the step and the rank, so a
  resumed run samples what the uninterrupted one did, bit for bit.
- `server` (a LoRA job's by default): by the model server that answers chat completions,
  the job's adapters synced to it each step (`service.methods.rollouts`). Decided by
  `auto`, a server that cannot answer (no replica could start: its GPU is training) is
  left for the engine for the rest of the attempt, every rank together, and the job says
  so in an event; asked for by name, it fails the job.
Either way the step reports `train_sampler_kl`: the mean over answer tokens of the
sampler's log-probability less the trained policy's (0 when the sampler has the policy's
weights and samples at temperature 1), and `train_clip_fraction`: the share of answer
tokens whose ratio of the two falls outside `ppo`'s clip range (0.8, 1.2).

An evaluation samples `eval_samples` answers for each validation prompt (seeded apart from
training) and reports their mean reward (`valid_reward_mean`, and each named grader's of a
multi grader); early stopping watches it.
"""

from __future__ import annotations

import json
import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch

from service.methods.objectives import Rows, Split, all_sum, eval_rounds
from service.methods.rollouts import Answer
from service.sessions.losses import CLIP_HIGH, CLIP_LOW

SHOWN = 4  # graded answers an evaluation shows on the job page (an event of the job's own)
EVAL_SEED = 7_919  # evaluations sample apart from training
# how long a model server that does not answer is asked again (`sampler: server`): when
# the engine can take over (`auto`), not for long
SERVER_PATIENCE_S, FALLBACK_PATIENCE_S = 600.0, 60.0


@torch.no_grad()
def sample(
    engine: Any,
    prompts: list[list[int]],
    n: int,
    max_tokens: int,
    temperature: float,
    stop: set[int],
    pad: int,
    gen: torch.Generator,
) -> list[Answer]:
    """`n` answers to each prompt (in order: the prompt's n, then the next prompt's), at
    most `max_tokens` each, sampled at `temperature` (see the module docstring)."""
    rows = [p for p in prompts for _ in range(n)]
    b = len(rows)
    width = max(len(p) for p in rows)
    # left-padded: every row's next token is in the last column; the mask keeps the pads
    # out of attention and the positions count real tokens only
    ids = torch.full((b, width), pad, dtype=torch.long)
    mask = torch.zeros((b, width), dtype=torch.long)
    for i, p in enumerate(rows):
        ids[i, width - len(p) :] = torch.as_tensor(p)
        mask[i, width - len(p) :] = 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    out = [Answer([], [], False) for _ in rows]
    live = torch.ones(b, dtype=torch.bool)
    was_training = engine.module.training
    engine.eval()
    try:
        last, cache = _next(engine, ids, mask, pos, None)
        for t in range(max_tokens):
            logp = torch.log_softmax(last, dim=-1)
            probs = torch.softmax(last / temperature, dim=-1)
            tok = torch.multinomial(probs, 1, generator=gen)[:, 0]
            for i in torch.nonzero(live)[:, 0].tolist():
                k = int(tok[i])
                out[i].tokens.append(k)
                out[i].logprobs.append(float(logp[i, k]))
                if k in stop:
                    out[i].ended = True
                    live[i] = False
            if t + 1 == max_tokens or not all_sum([float(live.any())], engine.device)[0]:
                break  # every rank's answers have ended (ZeRO's gathers are collective)
            mask = torch.cat([mask, torch.ones((b, 1), dtype=torch.long)], dim=1)
            pos = pos[:, -1:] + 1
            last, cache = _next(engine, tok[:, None], mask, pos, cache)
    finally:
        engine.train(was_training)
    return out


def _next(engine: Any, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, cache: Any):
    """The fp32 logits of each row's next token (on the CPU), and the cache after `ids`."""
    out = engine(
        input_ids=ids,
        attention_mask=mask,
        position_ids=pos,
        cache=cache,
        use_cache=True,
        logits_to_keep=1,
    )
    return out.logits[:, -1].float().cpu(), out.cache


def seed_of(seed: int, step: int, rank: int, salt: int = 0) -> int:
    """A seed of (the run's seed, the step, the rank, what it is for), hashed to the 63
    bits torch takes, whatever the seed's size."""
    import hashlib

    key = f"{seed}:{step}:{rank}:{salt}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest()) >> 1


def generator(seed: int, step: int, rank: int, salt: int = 0) -> torch.Generator:
    """A generator seeded by `seed_of` the same."""
    g = torch.Generator()
    g.manual_seed(seed_of(seed, step, rank, salt))
    return g


def advantages(rewards: list[float], group: int) -> list[float]:
    """Each reward less its group's mean, over the group's standard deviation (0 for a
    group whose rewards are all the same)."""
    out: list[float] = []
    for g in range(0, len(rewards), group):
        r = torch.tensor(rewards[g : g + group], dtype=torch.float64)
        std = float(r.std(unbiased=False))
        out += [0.0] * len(r) if std < 1e-8 else ((r - r.mean()) / std).tolist()
    return out


def metric_names(names: list[str]) -> dict[str, str]:
    """Each multi grader's name as a metric's part: letters, digits and underscores, a
    number after the ones that would be the same as an earlier one's."""
    out: dict[str, str] = {}
    for name in names:
        base = re.sub(r"[^A-Za-z0-9_]+", "_", name).strip("_") or "grader"
        part, k = base, 1
        while part in out.values():
            k += 1
            part = f"{base}_{k}"
        out[name] = part
    return out


@dataclass
class Reinforcement:
    grader_raw: dict[str, Any]
    group: int
    eval_samples: int
    max_tokens: int
    temperature: float
    loss: str
    kl_coef: float
    seed: int
    data_dir: Path
    model_path: str
    grader_api: tuple[str, str] | None = None  # (API URL, key file): score_model graders'
    embedding_model: str | None = None  # what a cosine metric embeds with (through the API)
    # `server`: answers from the model server (service.methods.rollouts): where the job's
    # adapters go each step, and the job and attempt its requests name
    sampler: str = "engine"
    sampler_fallback: bool = False  # `auto` decided `server`: the engine when it fails
    sampler_dir: Path | None = None
    job_id: str = ""
    attempt: int = 1
    name = "reinforcement"
    # OpenAI's names of full-validation metrics, reported beside ours (the worker loop)
    full_names: ClassVar[dict[str, str]] = {"full_valid_reward_mean": "full_valid_mean_reward"}
    grader: Any = None
    tok: Any = None
    stop: set[int] = field(default_factory=set)
    pad: int = 0
    items: dict[str, list[Any]] = field(default_factory=dict)
    lengths: dict[str, torch.Tensor] = field(default_factory=dict)  # each prompt's tokens
    graders: tuple[str, ...] = ()  # a multi grader's names, in a fixed order
    parts: dict[str, str] = field(default_factory=dict)  # their metric names' parts
    sink: Any = None  # where an evaluation's graded answers go (rank 0's)
    runners: Any = None  # how the graders run (score_model's questions: `grader_api`)
    server: Any = None  # the model server's sampler (`sampler: server`), once prepared

    @classmethod
    def of(cls, run: Any) -> Reinforcement:
        hp = run.hyperparameters.model_extra or {}
        return cls(
            grader_raw=hp["grader"],
            group=int(hp["group_size"]),
            eval_samples=int(hp.get("eval_samples", 1)),
            max_tokens=int(hp["max_completion_tokens"]),
            temperature=float(hp.get("temperature", 1.0)),
            loss=str(hp.get("loss", "importance_sampling")),
            kl_coef=float(hp.get("kl_coef", 0.0)),
            seed=run.seed,
            data_dir=Path(run.data_file),
            model_path=str(run.model.get("path") or run.tokenizer_dir),
            grader_api=(
                (run.grader_api_url, run.grader_key_file)
                if run.grader_api_url and run.grader_key_file
                else None
            ),
            embedding_model=run.embedding_model,
            sampler=str(hp.get("sampler", "engine")),
            sampler_fallback=bool(hp.get("sampler_fallback", False)),
            sampler_dir=Path(run.sampler_dir) if run.sampler_dir else None,
            job_id=run.job_id or "",
            attempt=run.attempt,
        )

    # -- before the first step --------------------------------------------------------------

    def prepare(
        self, engine: Any, splits: dict[str, Split], rank: int, world: int, batch: int, sink: Any
    ) -> None:
        """The grader (checked when the job was created; python graders ran the operator's
        check then), the tokenizer and its end-of-turn tokens, and each split's items."""
        from transformers import AutoTokenizer

        from service.data.datasets import ensure_chat_template
        from service.data.rows import pad_id
        from service.data.tokens import eos_ids
        from service.methods.api_client import api_asker, api_embedder
        from service.methods.graders import Multi, Runners, parse_grader

        self.grader = parse_grader(
            self.grader_raw, "method.reinforcement.grader", python=True, embeddings=True
        )
        if self.grader_api is not None:
            url, key_file = self.grader_api
            key = Path(key_file).read_text().strip()
            model = self.embedding_model
            embed = api_embedder(url, key, model) if model else None
            self.runners = Runners(ask=api_asker(url, key), embed=embed)
        if self.sampler == "server":
            from service.methods.rollouts import ServerSampler

            if self.grader_api is None or self.sampler_dir is None or not self.job_id:
                raise RuntimeError(
                    "sampler 'server' needs the API's address, the job's key and its sampler "
                    "directory in the run plan (a job the service launched has them)"
                )
            self.server = ServerSampler(
                self.grader_api[0],
                key,
                self.job_id,
                self.attempt,
                self.sampler_dir,
                patience_s=FALLBACK_PATIENCE_S if self.sampler_fallback else SERVER_PATIENCE_S,
            )
        if isinstance(self.grader, Multi):
            self.graders = tuple(sorted(self.grader.graders))
            self.parts = metric_names(list(self.graders))
        self.tok = AutoTokenizer.from_pretrained(self.model_path)
        ensure_chat_template(self.tok)
        self.stop = eos_ids(engine.module, self.tok)
        end = self.tok.convert_tokens_to_ids("<|im_end|>")  # the ChatML fallback's
        if isinstance(end, int) and end != self.tok.unk_token_id:
            self.stop.add(end)
        self.pad = pad_id(self.tok)
        self.sink = sink if rank == 0 else None
        for name, split in splits.items():
            path = self.data_dir / f"{name}_items.jsonl"
            with path.open(encoding="utf-8") as f:
                self.items[name] = [json.loads(line) for line in f]
            assert split.lengths is not None
            self.lengths[name] = split.lengths

    # -- a step -----------------------------------------------------------------------------

    def _answers(
        self, engine: Any, prompts: list[list[int]], n: int, at: int, rank: int, salt: int = 0
    ) -> list[Answer]:
        """`n` answers to each prompt, where `sampler` says, seeded by the run's seed, `at`
        (the step, or an evaluation's round), the rank and `salt`."""
        if self.server is not None:
            from service.methods.api_client import GraderModelError

            seed = seed_of(self.seed, at, rank, salt)
            why, got = "", []
            try:
                got = self.server.sample(
                    engine, prompts, n, self.max_tokens, self.temperature, self.stop, rank, seed
                )
            except GraderModelError as e:
                why = str(e)
            # every rank leaves the server together: sampling on the engine is collective
            if not all_sum([float(bool(why))], engine.device)[0]:
                return got
            self._leave_server(engine, why or "another rank's model server did not answer")
        gen = generator(self.seed, at, rank, salt)
        return sample(
            engine, prompts, n, self.max_tokens, self.temperature, self.stop, self.pad, gen
        )

    def _leave_server(self, engine: Any, why: str) -> None:
        """Sample on the engine from now on (`auto`'s fallback), saying why; fail the job
        when the server was asked for by name."""
        if not self.sampler_fallback:
            raise RuntimeError(f"sampler 'server': {why}")
        self.server = None
        if self.sink is not None:
            self.sink.event(
                f"The model server could not sample the answers at step {engine.global_step} "
                f"({why}); the engine samples them for the rest of this attempt",
                step=engine.global_step,
            )

    def _grade(self, answers: list[Answer], items: list[Any]) -> list[Any]:
        from service.methods.graders import grade_all

        texts = [self.tok.decode(a.tokens, skip_special_tokens=True) for a in answers]
        return grade_all(self.grader, texts, items, self.runners)

    def train_step(self, engine: Any, rows: Rows, micro_batches: int) -> dict[str, float]:
        from service.sessions import losses

        assert rows.index is not None
        rank = _rank()
        lengths = self.lengths["train"]
        prompts = [
            rows.input_ids[i, : int(lengths[int(k)])].tolist() for i, k in enumerate(rows.index)
        ]
        items = [self.items["train"][int(k)] for k in rows.index for _ in range(self.group)]
        t0 = time.perf_counter()
        answers = self._answers(engine, prompts, self.group, engine.global_step, rank)
        t1 = time.perf_counter()
        graded = self._grade(answers, items)
        t2 = time.perf_counter()
        rewards = [g.reward for g in graded]
        adv = advantages(rewards, self.group)
        seqs = [prompts[k // self.group] + a.tokens for k, a in enumerate(answers)]
        # input positions that predict a prompt token: no log-probability, no advantage
        before = [len(prompts[k // self.group]) - 1 for k in range(len(answers))]
        token_adv = [[ad] * len(a.tokens) for a, ad in zip(answers, adv, strict=True)]
        kl = self._kl_penalty(engine, seqs, before, answers, token_adv) if self.kl_coef else 0.0
        data = [
            losses.Datum(
                full[:-1],
                {
                    "target_tokens": full[1:],
                    "logprobs": [0.0] * b + a.logprobs,
                    "advantages": [0.0] * b + ta,
                },
            )
            for full, b, a, ta in zip(seqs, before, answers, token_adv, strict=True)
        ]
        parts = max(1, min(micro_batches, len(data)))
        size = math.ceil(len(data) / parts)
        loss_sum = gap = clipped = 0.0
        for p in range(0, len(data), size):
            out = losses.run(engine, data[p : p + size], self.loss, None, scale=1 / len(data))
            loss_sum += out.metrics["loss:sum"]
            for k, policy in enumerate(out.logprobs, start=p):
                mine = policy[before[k] :]
                gap += sum(answers[k].logprobs) - sum(mine)  # the sampler's less the policy's
                clipped += sum(
                    not CLIP_LOW <= math.exp(lp - sampled) <= CLIP_HIGH
                    for lp, sampled in zip(mine, answers[k].logprobs, strict=True)
                )
        engine.step()
        sums = {
            "reward_sum": sum(rewards),
            "reward_sq_sum": sum(r * r for r in rewards),
            "samples": float(len(rewards)),
            "answer_tokens": float(sum(len(a.tokens) for a in answers)),
            "cut": float(sum(not a.ended for a in answers)),
            "loss_sum": loss_sum,
            "groups": float(len(prompts)),
            "groups_learning": float(
                sum(any(adv[g : g + self.group]) for g in range(0, len(adv), self.group))
            ),
            "parse_errors": float(sum(g.sample_parse_error for g in graded)),
            # score_model graders: the tokens their models took, their answers without a score
            "grader_tokens": float(sum(sum(g.model_tokens.values()) for g in graded)),
            "model_parse_errors": float(sum(g.model_parse_error for g in graded)),
            "kl_sum": kl,
            "sampler_gap": gap,
            "clipped": clipped,
            # seconds of this rank's step in each part (the loop adds the ranks)
            "sample_s": t1 - t0,
            "grade_s": t2 - t1,
            "train_s": time.perf_counter() - t2,
            "ranks": 1.0,
        }
        for name in self.graders:
            sums[f"grader:{name}"] = sum(g.sub_rewards.get(name, 0.0) for g in graded)
        return sums

    def _kl_penalty(
        self,
        engine: Any,
        seqs: list[list[int]],
        before: list[int],
        answers: list[Answer],
        token_adv: list[list[float]],
    ) -> float:
        """Take `kl_coef` times each answer token's log-ratio to the reference (the base:
        the adapters off) from its advantage (`token_adv`, in place); the summed
        log-ratios (their mean per answer token is the KL estimate)."""
        from service.methods.dpo_objective import adapters_disabled
        from service.sessions import losses

        plain = [
            losses.Datum(full[:-1], {"target_tokens": full[1:], "weights": [0.0] * (len(full) - 1)})
            for full in seqs
        ]
        with adapters_disabled(engine):
            ref = losses.run(engine, plain, "cross_entropy", backward=False).logprobs
        total = 0.0
        for k, a in enumerate(answers):
            for j, lp in enumerate(a.logprobs):
                gap = lp - ref[k][before[k] + j]
                token_adv[k][j] -= self.kl_coef * gap
                total += gap
        return total

    def _shown(self, prompt: list[int], answer: Answer, graded: Any) -> dict[str, Any]:
        """One graded answer as the job page shows it (the tenant's own data: an event of
        the job, never a log line)."""
        return {
            "prompt": self.tok.decode(prompt, skip_special_tokens=True).strip(),
            "answer": self.tok.decode(answer.tokens, skip_special_tokens=True),
            "reward": graded.reward,
            "scores": dict(graded.sub_rewards),
        }

    def values(self, sums: dict[str, float]) -> dict[str, float]:
        n = max(sums["samples"], 1.0)
        mean = sums["reward_sum"] / n
        out = {
            "train_reward_mean": mean,
            "train_reward_std": math.sqrt(max(0.0, sums["reward_sq_sum"] / n - mean * mean)),
            "train_loss": sums["loss_sum"] / n,
            "train_answer_tokens_mean": sums["answer_tokens"] / n,
            "train_answers_cut": sums["cut"] / n,
            "train_groups_learning": sums["groups_learning"] / max(sums["groups"], 1.0),
            "train_sample_parse_errors": sums["parse_errors"] / n,
        }
        ranks = max(sums["ranks"], 1.0)
        for part in ("sample", "grade", "train"):
            out[f"{part}_time_s"] = sums[f"{part}_s"] / ranks
        tokens = max(sums["answer_tokens"], 1.0)
        out["train_sampler_kl"] = sums["sampler_gap"] / tokens
        out["train_clip_fraction"] = sums["clipped"] / tokens
        if self.kl_coef:
            out["train_kl"] = sums["kl_sum"] / max(sums["answer_tokens"], 1.0)
        if self.grader_api is not None:
            out["train_grader_model_tokens"] = sums["grader_tokens"]
            out["train_model_grader_parse_errors"] = sums["model_parse_errors"] / n
        for name in self.graders:
            out[f"train_reward_mean_{self.parts[name]}"] = sums[f"grader:{name}"] / n
        return out

    # -- evaluation -------------------------------------------------------------------------

    def evaluate(self, engine: Any, split: Split, rank: int, world: int, batch: int):
        """{valid_reward_mean, each named grader's} over `eval_samples` answers to every
        prompt of `split` (every rank its share; the same answers each time for the same
        weights)."""
        total = reward = 0.0
        per = dict.fromkeys(self.graders, 0.0)
        shown: list[dict[str, Any]] = []
        assert split.lengths is not None
        for r, (idx, real) in enumerate(eval_rounds(len(split), rank, world, batch)):
            rows = split.rows(idx, engine.device)
            prompts = [
                rows.input_ids[i, : int(split.lengths[int(idx[i])])].tolist()
                for i in range(len(idx))
            ]
            answers = self._answers(engine, prompts, self.eval_samples, r, rank, EVAL_SEED)
            items = [self.items["valid"][int(k)] for k in idx for _ in range(self.eval_samples)]
            graded = self._grade(answers, items)
            counted = [bool(real[i // self.eval_samples]) for i in range(len(graded))]
            for j, (g, c) in enumerate(zip(graded, counted, strict=True)):
                if c and len(shown) < SHOWN and self.sink is not None:
                    shown.append(self._shown(prompts[j // self.eval_samples], answers[j], g))
                if c:
                    total += 1
                    reward += g.reward
                    for name in self.graders:
                        per[name] += g.sub_rewards.get(name, 0.0)
        if shown:
            self.sink.event(
                f"Graded answers at step {engine.global_step}: {len(shown)} of the "
                "validation prompts' answers and their scores",
                graded=shown,
                step=engine.global_step,
            )
        summed = all_sum([total, reward, *per.values()], engine.device)
        n = max(summed[0], 1.0)
        out = {"valid_reward_mean": summed[1] / n}
        for name, v in zip(self.graders, summed[2:], strict=True):
            out[f"valid_reward_mean_{self.parts[name]}"] = v / n
        return out


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
