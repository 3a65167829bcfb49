"""Where a training model's engine runs: `EngineHost` holds it and runs its operations;
the control plane holds one in its own process (`LocalHost`, the default) or in a Ray
actor of its own (`RayHost`: a worker process with the CPUs and memory it asks, on
whichever node has them), and calls the same operations either way.

What crosses to an actor is plain data (`ModelSpec`, datums, `StepHyper`, paths on the
shared volume) and comes back the same way (`losses.Output`); an error the caller can
fix comes back as itself, anything else as the actor's failure with its message.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from pstar_core.optim import StepHyper
from service.errors import InvalidRequest, QuotaExceeded
from service.sessions.losses import BadInput, Datum, Output, Unsupported, run

log = logging.getLogger("pstar.sessions")

LORA_ALPHA = 32.0
ADAPTER = "adapter"  # a LoRA's sampler weights: <dir>/adapter (peft)
MODEL = "model"  # full weights: <dir>/model (transformers)


@dataclass(frozen=True)
class ModelSpec:
    """What a host needs to build a training model's engine."""

    id: str
    base_id: str
    base_path: Path | None
    rank: int  # 0: every weight
    targets: tuple[str, ...]
    engine_config: dict[str, Any]


class Host(Protocol):
    def build(self) -> None: ...
    def load(self, where: Path, optimizer: bool) -> None: ...
    def forward_backward(
        self, data: list[Datum], loss_fn: str, config: dict[str, Any], backward: bool
    ) -> Output: ...
    def step(self, hyper: StepHyper) -> None: ...
    def save_state(self, where: Path) -> None: ...
    def export(self, where: Path) -> None: ...
    def arch(self) -> str: ...
    def close(self) -> None: ...


class EngineHost:
    """A training model's engine and the operations on it, wherever this object lives."""

    def __init__(self, spec: ModelSpec) -> None:
        self.spec = spec
        self.engine: Any = None

    def build(self) -> None:
        import pstar_core

        spec = self.spec
        cfg = dict(spec.engine_config)
        if spec.rank:
            cfg["lora"] = {"r": spec.rank, "alpha": LORA_ALPHA, "target_modules": spec.targets}
        if spec.base_path is None:  # base_models() are HF directories; zoo models are not
            raise InvalidRequest(f"{spec.base_id} has no weights to start a session from")
        self.engine = pstar_core.initialize(spec.base_path, cfg)

    def load(self, where: Path, optimizer: bool) -> None:
        self.build()
        self.engine.load_checkpoint(where, optimizer)

    def forward_backward(
        self, data: list[Datum], loss_fn: str, config: dict[str, Any], backward: bool
    ) -> Output:
        return run(self.engine, data, loss_fn, config, backward=backward)

    def step(self, hyper: StepHyper) -> None:
        self.engine.step(hyper)

    def save_state(self, where: Path) -> None:
        """The engine's checkpoint (weights, Adam's moments, the step)."""
        self._applied("save_state")
        self.engine.save_checkpoint(where)

    def export(self, where: Path) -> None:
        """What a sampler loads: a LoRA's adapter (peft) in `where/adapter`, or the whole
        model (transformers, with the tokenizer) in `where/model`."""
        self._applied("save_weights_for_sampler")
        if self.spec.rank:
            self.engine.export_hf(where / ADAPTER, variant="adapter")
        else:
            self.engine.export_hf(where / MODEL)

    def arch(self) -> str:
        config = getattr(self.engine.module, "config", None) if self.engine else None
        return str(getattr(config, "model_type", "unknown"))

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None

    def _applied(self, what: str) -> None:
        """Saving between a forward_backward and its optim_step is the caller's to fix."""
        if self.engine.pending_grads:
            raise BadInput(
                f"{what}: gradients of a forward_backward are not applied yet; call "
                "optim_step first"
            )


LocalHost = EngineHost  # in the control plane's own process

CALLERS_ERRORS = (BadInput, Unsupported, InvalidRequest, QuotaExceeded)


def ray_hosts(address: str | None, options: dict[str, Any]):
    """A host factory for `Sessions`: each training model's engine in a Ray actor of its
    own, this process connected to the cluster at `address` (once, at the first model) as
    a Ray driver."""

    def make(spec: ModelSpec) -> tuple[Host, str]:
        import ray

        if not ray.is_initialized():
            ray.init(address=address, namespace="pstar", log_to_driver=False)
        host = RayHost(spec, options)
        return host, f"Ray actor '{host.name}'"

    return make


def local_hosts(spec: ModelSpec) -> tuple[Host, str]:
    return LocalHost(spec), "the control plane's process"


class RayHost:
    """An `EngineHost` in a Ray actor of its own (`options`: its `num_cpus`, `memory`,
    ...), called synchronously (the model's own thread waits for each result)."""

    def __init__(self, spec: ModelSpec, options: dict[str, Any]) -> None:
        import ray

        self.name = f"session-engine {spec.id}"
        actor = ray.remote(EngineHost).options(name=self.name, namespace="pstar", **options)
        self.actor: Any = actor.remote(spec)

    def _call(self, op: str, *args: Any) -> Any:
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        try:
            return ray.get(getattr(self.actor, op).remote(*args))
        except RayTaskError as e:
            cause = getattr(e, "cause", None)
            if isinstance(cause, CALLERS_ERRORS):
                raise cause from None
            raise RuntimeError(f"{op} failed in {self.name}: {cause or e}") from None
        except RayActorError as e:
            raise RuntimeError(
                f"{self.name} is gone ({type(e).__name__}: the worker died or was "
                "preempted); create the training client again from a saved state"
            ) from None

    def build(self) -> None:
        self._call("build")

    def load(self, where: Path, optimizer: bool) -> None:
        self._call("load", where, optimizer)

    def forward_backward(
        self, data: list[Datum], loss_fn: str, config: dict[str, Any], backward: bool
    ) -> Output:
        out: Output = self._call("forward_backward", data, loss_fn, config, backward)
        return out

    def step(self, hyper: StepHyper) -> None:
        self._call("step", hyper)

    def save_state(self, where: Path) -> None:
        self._call("save_state", where)

    def export(self, where: Path) -> None:
        self._call("export", where)

    def arch(self) -> str:
        return str(self._call("arch"))

    def close(self) -> None:
        import ray

        try:
            ray.get(self.actor.close.remote(), timeout=60)
        except Exception as e:  # gone already, or stuck: killed either way
            log.info("%s did not close cleanly: %s", self.name, e)
        ray.kill(self.actor)
