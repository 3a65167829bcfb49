"""Samplers of training sessions (Tinker's `SamplingClient`): a base model, or weights a
training model saved for sampling, answered by the same model servers as
`/v1/chat/completions` (`api.generate`'s backend: the base model's Serve application).

A LoRA's sampler weights are a peft adapter directory under the tenant's root; a sample
names it, and the base's generator loads it as the request joins its batch, beside the
adapters of fine-tuned models, with no restart: each `save_weights_for_sampler` is a new
adapter, the least recently used out past `max_adapters`. Full weights (rank 0) are a
model directory of their own, served by an application of their own.

Paths: `tinker://<model id>/sampler_weights/<name>`, resolved under the caller's own root
only. A sampler's id is `<session id>:sample:<n>`.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from service.errors import InvalidRequest, NotFound
from service.registry import ModelRef, base_models
from service.serving.deployments import Target, base_app, data_relative
from service.sessions import checkpoints
from service.sessions.hosts import ADAPTER, MODEL
from service.sessions.losses import BadInput, Unsupported
from service.settings import Settings


@dataclass(frozen=True)
class Sampler:
    id: str
    tenant: str
    session_id: str
    base_model: str
    model_path: str | None
    target: Target

    def info(self) -> dict[str, Any]:
        return {"sampler_id": self.id, "base_model": self.base_model, "model_path": self.model_path}


@dataclass(frozen=True)
class SampleCall:
    """One `asample` request, checked: what the generator is asked."""

    prompt: list[int]
    num_samples: int
    max_tokens: int | None
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: tuple[str, ...] = ()
    stop_tokens: tuple[int, ...] = ()
    ignore_eos: bool = False
    prompt_logprobs: bool = False
    prompt_logprobs_last_n: int | None = None

    def payload(self) -> dict[str, Any]:
        """The model server's request (service.serving.model_server)."""
        body: dict[str, Any] = {
            "prompt_ids": self.prompt,
            "n": self.num_samples,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "seed": self.seed,
            "stop": list(self.stop),
            "stop_token_ids": list(self.stop_tokens),
            "ignore_eos": self.ignore_eos,
            "token_logprobs": True,
            "prompt_logprobs": self.prompt_logprobs,
        }
        if self.max_tokens is not None:
            body["max_tokens"] = self.max_tokens
        if self.prompt_logprobs_last_n is not None:  # the rest may come from the prefix cache
            body["prompt_logprobs_last_n"] = self.prompt_logprobs_last_n
        return body


def stops(stop: Any) -> dict[str, Any]:
    """Tinker's `SamplingParams.stop` as the generator's: None stops at the end-of-turn
    tokens; `[]` never stops before `max_tokens`; strings or token ids stop there too."""
    if stop is None:
        return {}
    if isinstance(stop, str):
        return {"stop": (stop,)}
    items = list(stop)
    if not items:
        return {"ignore_eos": True}
    if all(isinstance(s, str) for s in items):
        if any(not s for s in items):
            raise BadInput("sampling_params.stop: a stop string must not be empty")
        return {"stop": tuple(items)}
    if all(isinstance(s, int) and not isinstance(s, bool) for s in items):
        return {"stop_tokens": tuple(items)}
    raise BadInput("sampling_params.stop: give strings or token ids, not both")


@dataclass
class Samplers:
    """The samplers of every session, by id."""

    settings: Settings
    states: Callable[[str], Path]  # a tenant's root of saved weights
    samplers: dict[str, Sampler] = field(default_factory=dict)

    def create(
        self,
        tenant: str,
        session_id: str,
        seq: int,
        base_model: str | None,
        model_path: str | None,
    ) -> Sampler:
        sid = f"{session_id}:sample:{seq}"
        known = self.samplers.get(sid)
        if known is not None and known.tenant == tenant:
            return known  # the SDK sent it again
        if model_path:
            base_id, target = self.resolve(tenant, model_path)
            if base_model and base_model != base_id:
                raise InvalidRequest(
                    f"base_model {base_model!r}: {model_path} was trained from {base_id}",
                    param="base_model",
                )
        elif base_model:
            target = self.base_target(base_model)
            base_id = target.model
        else:
            raise InvalidRequest("give model_path or base_model", param="model_path")
        sampler = Sampler(sid, tenant, session_id, base_id, model_path or None, target)
        self.samplers[sid] = sampler
        return sampler

    def base(self, model: str) -> ModelRef:
        ref = next((m for m in base_models(self.settings) if m.id == model), None)
        if ref is None or ref.path is None:
            known = ", ".join(m.id for m in base_models(self.settings)) or "none"
            raise InvalidRequest(
                f"base_model {model!r} is not a base model here; base models: {known}",
                param="base_model",
                code="model_not_found",
            )
        return ref

    def base_target(self, model: str) -> Target:
        """The base model's own application (every tenant's adapters share it)."""
        ref = self.base(model)
        assert ref.path is not None
        return Target(ref.id, base_app(ref.path, ref.id), ref.path)

    def resolve(self, tenant: str, path: str) -> tuple[str, Target]:
        """(the base model, the target that answers) for a sampler-weights path of the
        tenant's own."""
        import json

        m = checkpoints.TINKER_PATH_RE.match(path)
        if m is not None and m["kind"] == "weights":
            raise InvalidRequest(
                f"{path} is a training state (save_state); sample from the weights that "
                "save_weights_for_sampler saves (tinker://.../sampler_weights/...)",
                param="model_path",
            )
        where = checkpoints.locate(self.states(tenant), path, "sampler_weights")
        if where is None:
            raise NotFound("sampler weights", path, param="model_path")
        meta = json.loads((where / checkpoints.META).read_text())
        base = self.base(meta["base_model"])
        assert base.path is not None
        files = where / str(meta.get("files", ""))  # this save's own directory
        if meta["rank"]:
            adapter = data_relative(self.settings, files / ADAPTER)
            return base.id, Target(path, base_app(base.path, base.id), base.path, adapter, tenant)
        app = base_app(files / MODEL, f"smp-{where.name}")  # its own: a digest of the path
        return base.id, Target(path, app, files / MODEL, None, tenant)

    def get(self, tenant: str, sid: str) -> Sampler:
        s = self.samplers.get(sid)
        if s is None or s.tenant != tenant:
            raise NotFound("sampler", sid, param="sampling_session_id")
        return s

    def end_session(self, session_id: str) -> None:
        for sid in [k for k, s in self.samplers.items() if s.session_id == session_id]:
            del self.samplers[sid]


@dataclass
class SampleResult:
    sequences: list[tuple[list[int], list[float], str]]  # tokens, logprobs, stop reason
    prompt_logprobs: list[float] | None


async def collect(events: AsyncIterator[dict[str, Any]], call: SampleCall) -> SampleResult:
    """A sample's result from the model server's events."""
    finished: dict[int, tuple[list[int], list[float], str]] = {}
    prompt: list[float] | None = None
    async for ev in events:
        if "error" in ev:
            err = ev["error"]
            if err.get("status", 500) in (400, 404):
                raise BadInput(f"sample: {err.get('message')}")
            raise RuntimeError(f"the model server failed: {err.get('message')}")
        if "prompt_logprobs" in ev:
            prompt = [math.nan if v is None else float(v) for v in ev["prompt_logprobs"]]
            if call.prompt_logprobs_last_n is not None:
                cut = max(0, len(prompt) - call.prompt_logprobs_last_n)
                prompt[:cut] = [math.nan] * cut
        elif "finish" in ev:
            finished[ev["i"]] = (ev["tokens"], ev.get("logprobs") or [], ev["finish"])
        elif "usage" in ev:
            break
    return SampleResult([finished[i] for i in sorted(finished)], prompt)


def check_unsupported(body: Any) -> None:
    """What `asample` may ask that the generator does not do, refused by name."""
    for name, value in (
        ("topk_prompt_logprobs", body.topk_prompt_logprobs),
        ("topk_sample_logprobs", body.topk_sample_logprobs),
        ("prompt_alt_tokens_k", body.prompt_alt_tokens_k),
    ):
        if value:
            raise Unsupported(f"{name}: top-k log-probabilities are not supported yet; set it to 0")
    if body.target_prompt_logprobs is not None:
        raise Unsupported("target_prompt_logprobs is not supported yet")
    if body.record_stability_info:
        raise Unsupported(
            "record_stability_info (StableReinforce) is not supported; sample without it and "
            "train with importance_sampling, ppo, cispo or dro"
        )
