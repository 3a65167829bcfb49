"""Reinforcement fine-tuning, measured: `pstar bench rft`.

The task has a checkable answer and is built from data on this machine: WordNet 3.0's
synsets (Debian's `wordnet-base`). A synset with two or more one-word lemmas gives a
prompt, "Give one word that means the same as 'X'. Answer with the word only.", whose
item holds the synset's other one-word lemmas. The grader is a `multi`: its `exact`
(`string_check`, `ilike`) passes an answer that is one of them, exactly, in any case (the
template `|{{sample.output_text}}|` must occur in the item's `|a|b|c|`), and its `close`
(`text_similarity`, `fuzzy_match`) scores how near the answer is to the first of them; the
reward is their mean. The pass rate is `exact`'s mean. Prompts are split into a
training and a held-out set by a seeded shuffle, no word in both.

The job runs as a user runs it: `pstar serve` with its local Ray, the files uploaded and a
`method: reinforcement` job created over the REST API, on SmolLM2-135M-Instruct (the
model set-up prepares), LoRA by default, one Ray Train worker. Reported, from the job's
metric series:

- the held-out pass rate and reward before training and at the end (step 0's validation,
  the last step's full validation: `eval_samples` answers per held-out prompt, sampled
  at the training temperature);
- the training pass rate, reward and answer length over the first and the last five steps;
- the job's wall time, and the share of a step spent sampling, grading and training
  (`sample_time_s`, `grade_time_s`, `train_time_s`, medians over the steps).

    pstar bench rft --json
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from benchmarks.report import finish, load_avg, machine, median

__all__ = ["run", "synonym_prompts"]

MODEL = "SmolLM2-135M-Instruct"
TOKEN = "sk-bench-rft"
PROMPT = "Give one word that means the same as '{word}'. Answer with the word only."
# a multi grader: `exact` passes one of the synonyms (the pass rate), `close` is fuzzy_match
# against the first one, so an answer that is shorter and nearer scores more even before any
# passes (a 135M model's first answers are sentences: `exact` alone would teach nothing)
GRADER = {
    "type": "multi",
    "name": "synonym",
    "graders": {
        "exact": {
            "type": "string_check",
            "name": "exact",
            "operation": "ilike",
            "input": "{{item.synonyms}}",
            "reference": "|{{sample.output_text}}|",
        },
        "close": {
            "type": "text_similarity",
            "name": "close",
            "evaluation_metric": "fuzzy_match",
            "input": "{{sample.output_text}}",
            "reference": "{{item.synonym}}",
        },
    },
    "calculate_output": "0.5 * exact + 0.5 * close",
}
ONE_WORD = re.compile(r"^[a-z]{3,}$")


def synonym_prompts(wordnet_dir: Path) -> list[tuple[str, list[str]]]:
    """(word, its synonyms) from each synset with two or more one-word lemmas (lower case,
    letters only): the first is asked, the others answer it; each word asked once."""
    out: list[tuple[str, list[str]]] = []
    seen: set[str] = set()
    for name in ("data.noun", "data.verb", "data.adj"):
        path = wordnet_dir / name
        if not path.is_file():
            continue
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            if line.startswith(" ") or " | " not in line:
                continue  # the license header, or a line with no gloss
            fields = line.split(" | ", 1)[0].split()
            count = int(fields[3], 16)
            lemmas = [
                re.sub(r"\((?:a|p|ip)\)$", "", w).lower() for w in fields[4 : 4 + 2 * count : 2]
            ]
            words = list(dict.fromkeys(w for w in lemmas if ONE_WORD.match(w)))
            if len(words) >= 2 and words[0] not in seen:
                seen.add(words[0])
                out.append((words[0], words[1:]))
    return out


def _lines(pairs: list[tuple[str, list[str]]]) -> bytes:
    rows = []
    for word, synonyms in pairs:
        msgs = [{"role": "user", "content": PROMPT.format(word=word)}]
        item = {"synonyms": "|" + "|".join(synonyms) + "|", "synonym": synonyms[0]}
        rows.append(json.dumps({"messages": msgs, **item}))
    return ("\n".join(rows) + "\n").encode()


def _wordnet_dir() -> Path:
    """WordNet's database files: $WNSEARCHDIR, or where Debian's wordnet-base puts them."""
    import os

    found = Path(os.environ.get("WNSEARCHDIR") or "/usr/share/wordnet")
    if not (found / "data.noun").is_file():
        raise RuntimeError(
            f"WordNet is missing ({found / 'data.noun'}): install Debian's wordnet-base "
            "(scripts/setup.sh does) or set WNSEARCHDIR"
        )
    return found


def run(
    model_dir: Path,
    steps: int = 30,
    batch: int = 4,
    group: int = 4,
    max_tokens: int = 6,
    lr_multiplier: float = 3.0,
    lora: bool = True,
    sampler: str = "auto",
    train_prompts: int = 512,
    valid_prompts: int = 32,
    eval_samples: int = 2,
    dtype: str = "fp32",
    seed: int = 0,
    timeout_s: float = 3600.0,
    json_out: bool = False,
) -> dict[str, Any]:
    from benchmarks.serve_process import ServedModel

    console = Console(stderr=json_out)
    load_before = load_avg()
    pairs = synonym_prompts(_wordnet_dir())
    random.Random(seed).shuffle(pairs)
    if len(pairs) < train_prompts + valid_prompts:
        raise ValueError(f"WordNet gives {len(pairs)} prompts, fewer than asked for")
    train, valid = pairs[:train_prompts], pairs[train_prompts : train_prompts + valid_prompts]
    section: dict[str, Any] = {
        "grader": GRADER,
        "hyperparameters": {
            "batch_size": batch,
            "n_epochs": 50,
            "max_steps": steps,
            "learning_rate_multiplier": lr_multiplier,
            "group_size": group,
            "max_completion_tokens": max_tokens,
            "eval_samples": eval_samples,
            "eval_interval": steps,
            "sampler": sampler,
        },
    }
    if lora:
        section["lora"] = {"r": 16, "alpha": 32}
    with ServedModel(model_dir, MODEL, TOKEN, "pstar-rft-") as served:
        up_s = served.start_s
        body = {
            "model": MODEL,
            "training_file": served.upload("train.jsonl", _lines(train)),
            "validation_file": served.upload("valid.jsonl", _lines(valid)),
            "seed": seed,
            "method": {"type": "reinforcement", "reinforcement": section},
            "resources": {"num_workers": 1},
            "engine": {"dtype": dtype},
            "checkpoint_every": steps,
        }
        job, wall = served.run_job(body, timeout_s)
        decided = job["method"]["reinforcement"]["hyperparameters"]["sampler"]
        said = served.http.get(f"/fine_tuning/jobs/{job['id']}/events?limit=100").json()
        if any("could not sample" in e["message"] for e in said["data"]):
            decided += ", then the engine"  # auto's server gave way (its event says why)
        series = served.http.get(f"/fine_tuning/jobs/{job['id']}/metrics").json()["series"]

    def values(name: str) -> list[float]:
        return list(series.get(name, {}).get("values", []))

    rewards = values("train_reward_mean")
    passed = values("train_reward_mean_exact")
    lengths = values("train_answer_tokens_mean")
    parts = {p: median(values(f"{p}_time_s")) for p in ("sample", "grade", "train")}
    step_s = median(values("step_time_s"))
    result: dict[str, Any] = {
        "bench": "rft",
        "model": MODEL,
        "lora": lora,
        "sampler": decided,
        "steps": steps,
        "prompts_per_step": batch,
        "group_size": group,
        "max_completion_tokens": max_tokens,
        "train_prompts": train_prompts,
        "valid_prompts": valid_prompts,
        "eval_samples": eval_samples,
        "valid_pass_rate_before": values("valid_reward_mean_exact")[0],
        "valid_pass_rate_after": values("full_valid_reward_mean_exact")[-1],
        "valid_reward_before": values("valid_reward_mean")[0],
        "valid_reward_after": values("full_valid_reward_mean")[-1],
        "train_pass_rate_first5": sum(passed[:5]) / max(1, len(passed[:5])),
        "train_pass_rate_last5": sum(passed[-5:]) / max(1, len(passed[-5:])),
        "train_reward_first5": sum(rewards[:5]) / max(1, len(rewards[:5])),
        "train_reward_last5": sum(rewards[-5:]) / max(1, len(rewards[-5:])),
        "answer_tokens_first5": sum(lengths[:5]) / max(1, len(lengths[:5])),
        "answer_tokens_last5": sum(lengths[-5:]) / max(1, len(lengths[-5:])),
        "job_wall_s": round(wall, 1),
        "serve_start_s": round(up_s, 1),
        "step_s_median": step_s,
        "share_sampling": parts["sample"] / step_s,
        "share_grading": parts["grade"] / step_s,
        "share_training": parts["train"] / step_s,
        # the sampler's log-probabilities less the policy's, per answer token
        "sampler_kl_max": max((abs(v) for v in values("train_sampler_kl")), default=0.0),
        **machine(dtype),
        "load_before": load_before,
    }
    table = Table(
        title=f"RFT: WordNet synonyms, {MODEL}, {'LoRA' if lora else 'full'}, {steps} steps, "
        f"sampled on the {decided}"
    )
    table.add_column("what")
    table.add_column("value", justify="right")
    for key in (
        "valid_pass_rate_before", "valid_pass_rate_after", "valid_reward_before",
        "valid_reward_after", "train_pass_rate_first5", "train_pass_rate_last5",
        "train_reward_first5", "train_reward_last5", "answer_tokens_first5",
        "answer_tokens_last5", "job_wall_s", "step_s_median", "share_sampling",
        "share_grading", "share_training", "sampler_kl_max",
    ):  # fmt: skip
        v = result[key]
        table.add_row(key, f"{v:.3f}" if isinstance(v, float) else str(v))
    console.print(table)
    result["load_after"] = load_avg()
    return finish(console, result, load_before, result["load_after"], json_out)
