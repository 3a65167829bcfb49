"""Every "auto" of a job, and the defaults every launch shares, decided by the rules here.

`JobService.resolve` calls the ones the request and the files' counts decide at creation
(batch size, epochs, learning rate); data preparation calls the two that depend on the
tokenized data (`seq_len`, `packing`), with the figures it measured; every launch path
calls the step defaults (`checkpoint_every`, `eval_every`). A rule is written once, here,
so what "auto" means can be read in one place. A method's own hyperparameters (DPO's
`beta`) are the method's to decide (`Method.decided`): a new method brings its rules.
"""

from __future__ import annotations

import math

# the learning rate a multiplier of 1 gives, by the model's kind: a pretrained model is
# fine-tuned gently; a zoo model is trained from scratch on the data
BASE_LR = {"base": 1e-4, "fine-tuned": 1e-4, "zoo": 1e-3}
# "auto" packs when more than this share of the row slots would be padding unpacked
AUTO_PADDING_SHARE = 1 / 3


def batch_size(examples: int, workers: int) -> int:
    """Up to 8 examples a step, rounded up to a multiple of the workers (an equal share each)."""
    b = max(1, min(8, examples))
    return -(-b // workers) * workers


def epochs(examples: int) -> int:
    """OpenAI-like: 3 passes, more for very small files (about 100 examples seen)."""
    return max(3, min(10, math.ceil(100 / max(1, examples))))


def learning_rate(kind: str, multiplier: float, engine_lr: object = None) -> tuple[float, float]:
    """(the base rate, the rate): the engine section's `optimizer.lr` when it gives a
    positive number, else the kind's `BASE_LR`; times the multiplier. The caller checks the
    product is a positive finite number (it names the request's fields when not)."""
    base = BASE_LR[kind]
    if isinstance(engine_lr, (int, float)) and not isinstance(engine_lr, bool) and engine_lr > 0:
        base = float(engine_lr)
    return base, base * multiplier


def seq_len(longest: int, max_positions: int, cap: int = 512) -> int:
    """The shortest multiple of 16 that holds the longest example, within the model's
    positions and `cap` (longer examples are then truncated, and the report says so)."""
    want = max(16, -(-longest // 16) * 16)
    return max(16, min(want, cap, max_positions))


def packing(setting: bool | str, padding_share: float) -> bool:
    """Whether to pack: `True`/`False` as asked; "auto" when more than a third of the
    slots would be padding with one example per row (`padding_share`, measured)."""
    if setting == "auto":
        return padding_share > AUTO_PADDING_SHARE
    return bool(setting)


def checkpoint_every(given: int | None, total_steps: int, restartable: bool) -> int:
    """Steps between checkpoints: as given, else every quarter of the run where something
    restarts a lost worker (a job, or Ray Train workers) and only at the end where nothing
    does (`pstar train` in one process: a rerun resumes from that)."""
    if given:
        return given
    return max(1, -(-total_steps // 4)) if restartable else 0


def eval_every(given: int | None, total_steps: int) -> int:
    """Steps between held-out evaluations: as given (0: only before and after), else ten
    in a run."""
    return given if given is not None else max(1, total_steps // 10)
