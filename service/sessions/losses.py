"""The training primitives' losses: Tinker's `forward` and `forward_backward` on the engine.

A datum is one sequence: its `tokens` (the model's input, N of them) and per-position
inputs of the loss (`loss_fn_inputs`, each N long), with Tinker's alignment: position i
of the input predicts `target_tokens[i]` (the caller has shifted the sequence). A call
takes a list of them, runs them as one right-padded batch (causal attention never looks
right, so padding changes nothing; no attention mask needed) and returns, per datum, the
log-probability of each target token under the current weights (`logprobs`), and the
summed loss (`loss:sum`). The losses are sums over tokens, never means, as Tinker's:

- `cross_entropy`: `-(weights * logprobs).sum()` (inputs `target_tokens`, `weights`);
- `importance_sampling`: `-(exp(logprobs - sampling_logprobs) * advantages).sum()`
  (inputs `target_tokens`, `logprobs` (the sampler's), `advantages`);
- `ppo`: the clipped surrogate, token by token:
  `-min(ratio * advantages, clamp(ratio, low, high) * advantages).sum()`, the thresholds
  from `loss_fn_config` (`clip_low_threshold` 0.8 and `clip_high_threshold` 1.2 unless
  given);
- `cispo`: the clipped ratio as a coefficient, without its gradient:
  `-(sg(clamp(ratio, low, high)) * logprobs * advantages).sum()` (Tinker's defaults: no
  lower bound, 0.0, and 4.0 above);
- `dro`: `-(logprobs * advantages - beta / 2 * (logprobs - sampling_logprobs) ** 2).sum()`,
  `beta` from `loss_fn_config` (asked for: Tinker's documents give no default);
- `gspo` (GSPO-token): `ppo`'s clipped surrogate with every token's ratio the sequence's:
  `exp(mean over the marked tokens of (logprobs - sampling_logprobs))`, the mean without
  its gradient, each token's own log-probability with its own; its inputs are those of
  `importance_sampling` and `sequence_ratio_mask` (nonzero on the tokens the mean takes);
  thresholds 1 - 3e-4 and 1 + 4e-4 unless given, the GSPO paper's (Tinker's documents
  give none, and the cookbook's `rl_loop` sends none).

The policy losses' inputs are those of `importance_sampling`; their formulas are Tinker's
documented ones.

Anything else (another loss, a custom one, images) is refused by name before the engine
runs (`Unsupported`), and malformed inputs with what was wrong (`BadInput`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

CLIP_LOW, CLIP_HIGH = 0.8, 1.2
NEEDS = {
    "cross_entropy": ("target_tokens", "weights"),
    "importance_sampling": ("target_tokens", "logprobs", "advantages"),
    "ppo": ("target_tokens", "logprobs", "advantages"),
    "cispo": ("target_tokens", "logprobs", "advantages"),
    "dro": ("target_tokens", "logprobs", "advantages"),
    "gspo": ("target_tokens", "logprobs", "advantages", "sequence_ratio_mask"),
}
CLIPS = ("clip_low_threshold", "clip_high_threshold")
CONFIG_KEYS = {"ppo": CLIPS, "cispo": CLIPS, "gspo": CLIPS, "dro": ("beta",)}
CISPO_LOW, CISPO_HIGH = 0.0, 4.0
GSPO_LOW, GSPO_HIGH = 1 - 3e-4, 1 + 4e-4  # the GSPO paper's clip range of sequence ratios


class Unsupported(ValueError):
    """A request for something the engine does not do; the message names it and what is."""


class BadInput(ValueError):
    """A malformed datum or loss input; the message says which and how."""


@dataclass
class Datum:
    tokens: Sequence[int]
    inputs: Mapping[str, Sequence[float]] = field(default_factory=dict)


@dataclass
class Output:
    logprobs: list[list[float]]  # per datum, per position: log p(target_tokens[i])
    metrics: dict[str, float]


def check(data: Sequence[Datum], loss_fn: str, config: Mapping[str, Any] | None) -> None:
    """Refuse what cannot run, before anything runs."""
    if loss_fn not in NEEDS:
        raise Unsupported(
            f"loss_fn {loss_fn!r} is not supported; supported: {', '.join(NEEDS)} "
            "(custom losses run client-side through forward and cross_entropy weights)"
        )
    unknown = set(config or {}) - set(CONFIG_KEYS.get(loss_fn, ()))
    if unknown:
        takes = ", ".join(CONFIG_KEYS.get(loss_fn, ())) or "none"
        raise BadInput(f"loss_fn_config keys {sorted(unknown)} are not used by {loss_fn}: {takes}")
    _settings(loss_fn, config or {})
    if not data:
        raise BadInput("no data: pass at least one datum")
    for k, d in enumerate(data):
        n = len(d.tokens)
        if n == 0:
            raise BadInput(f"data[{k}]: model_input has no tokens")
        missing = [name for name in NEEDS[loss_fn] if name not in d.inputs]
        if missing:
            raise BadInput(f"data[{k}]: {loss_fn} needs loss_fn_inputs {missing}")
        for name, values in d.inputs.items():
            if len(values) != n:
                raise BadInput(
                    f"data[{k}]: loss_fn_inputs[{name!r}] has {len(values)} entries for "
                    f"{n} input tokens (position i of the input predicts target i)"
                )
        if loss_fn == "gspo" and not any(d.inputs["sequence_ratio_mask"]):
            raise BadInput(
                f"data[{k}]: sequence_ratio_mask marks no token (gspo's ratio is the mean "
                "over the tokens it marks: the sampled ones)"
            )


def validate(
    engine: Any, data: Sequence[Datum], loss_fn: str, config: Mapping[str, Any] | None = None
) -> None:
    """What `run` refuses before the engine runs: the loss and its inputs (`check`), and
    token ids past the model's vocabulary (each named by its datum)."""
    check(data, loss_fn, config)
    vocab = getattr(getattr(engine.module, "config", None), "vocab_size", None)
    if vocab is None:
        return
    for k, d in enumerate(data):
        ids = list(d.tokens) + [int(t) for t in d.inputs.get("target_tokens", ())]
        if ids and (max(ids) >= vocab or min(ids) < 0):
            raise BadInput(
                f"data[{k}]: a token id outside the model's vocabulary (0 to {vocab - 1})"
            )


def run(
    engine: Any,
    data: Sequence[Datum],
    loss_fn: str,
    config: Mapping[str, Any] | None = None,
    backward: bool = True,
    scale: float = 1.0,
) -> Output:
    """`forward_backward` (`backward=True`: gradients add up until the next optimizer
    step) or `forward` over `data` (see the module docstring). The gradient is that of
    `scale` times the loss: a ZeRO rank's share of a batch, whose gradients the ranks
    average, passes their count (0: a rank with no datum of its own, taking part in the
    collectives only)."""
    validate(engine, data, loss_fn, config)
    lengths = [len(d.tokens) for d in data]
    width = max(lengths)
    device = engine.device

    def padded(name: str | None, dtype: torch.dtype) -> torch.Tensor:
        out = torch.zeros(len(data), width, dtype=dtype)
        for k, d in enumerate(data):
            values = d.tokens if name is None else d.inputs[name]
            out[k, : lengths[k]] = torch.as_tensor(values, dtype=dtype)
        return out.to(device)

    ids, targets = padded(None, torch.long), padded("target_tokens", torch.long)
    real = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).to(device)
    with torch.set_grad_enabled(backward):
        logits = engine(input_ids=ids, use_cache=False).logits
        logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, targets[..., None])[..., 0]
        del logits
        per_token = _loss(loss_fn, logp, padded, config or {}) * real
        loss = per_token.sum()
        if backward:
            engine.backward(loss * scale)
    kept = logp.detach().cpu()
    return Output(
        [kept[k, :n].tolist() for k, n in enumerate(lengths)], {"loss:sum": float(loss.detach())}
    )


def _loss(name: str, logp: torch.Tensor, padded: Any, config: Mapping[str, Any]) -> torch.Tensor:
    """The per-token loss of `name` (summed by the caller over the real tokens)."""
    f32 = torch.float32
    if name == "cross_entropy":
        return -padded("weights", f32) * logp
    sampled, advantages = padded("logprobs", f32), padded("advantages", f32)
    got = _settings(name, config)
    if name == "gspo":  # the sequence's ratio, each token with its own gradient
        marked = padded("sequence_ratio_mask", f32) != 0
        mean = ((logp.detach() - sampled) * marked).sum(-1) / marked.sum(-1)
        ratio = torch.exp(mean[:, None] + logp - logp.detach())
    else:
        ratio = torch.exp(logp - sampled)
    if name == "importance_sampling":
        return -ratio * advantages
    if name == "dro":
        return -(logp * advantages - 0.5 * got["beta"] * (logp - sampled) ** 2)
    clipped = torch.clamp(ratio, got["clip_low_threshold"], got["clip_high_threshold"])
    if name == "cispo":
        return -clipped.detach() * logp * advantages
    return -torch.minimum(ratio * advantages, clipped * advantages)


def _settings(name: str, config: Mapping[str, Any]) -> dict[str, float]:
    """The loss's settings from `loss_fn_config`, defaults filled in; a BadInput for one
    that is missing or out of its range."""
    values = {}
    for key in CONFIG_KEYS.get(name, ()):
        if key in config:
            v = config[key]
            if isinstance(v, bool) or not isinstance(v, int | float) or math.isnan(v):
                raise BadInput(f"loss_fn_config[{key!r}] must be a number, got {v!r}")
            values[key] = float(v)
    if name == "dro":
        if "beta" not in values:
            raise BadInput("dro needs loss_fn_config {'beta': ...}: the quadratic penalty's weight")
        if not 0 <= values["beta"] < math.inf:
            raise BadInput(f"dro's beta must be finite and >= 0, got {values['beta']}")
    elif name in ("ppo", "cispo", "gspo"):
        low, high = {
            "ppo": (CLIP_LOW, CLIP_HIGH),
            "cispo": (CISPO_LOW, CISPO_HIGH),
            "gspo": (GSPO_LOW, GSPO_HIGH),
        }[name]
        low = values.setdefault("clip_low_threshold", low)
        high = values.setdefault("clip_high_threshold", high)
        ok = 0 <= low <= high if name == "cispo" else 0 < low <= 1 <= high
        if not ok:
            rule = "0 <= low <= high" if name == "cispo" else "0 < low <= 1 <= high"
            raise BadInput(f"{name} clip thresholds must satisfy {rule}, got {low}, {high}")
    return values
