"""Where a training model's engine runs: `EngineHost` holds it and runs its operations;
the control plane holds one in its own process (`LocalHost`, the default) or in a Ray
actor of its own (`RayHost`: a worker process with the CPUs and memory it asks, on
whichever node has them), and calls the same operations either way.

What crosses to an actor is plain data (`ModelSpec`, datums, `StepHyper`, paths on the
shared volume) and comes back the same way (`losses.Output`); an error the caller can
fix comes back as itself, anything else as the actor's failure with its message.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from pstar_core.optim import StepHyper
from service.errors import InvalidRequest, QuotaExceeded, Unavailable
from service.sessions.losses import BadInput, Datum, Output, Unsupported, run, validate

log = logging.getLogger("pstar.sessions")

LORA_ALPHA = 32.0
JOIN_TIMEOUT_S = 300  # the engines of a group meet within this, once all have started
START_TIMEOUT_S = 120.0  # an engine's actor is placed and started within this, or refused
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
    workers: int = 1  # engines with chunk ZeRO between them (Ray hosts only)
    seed: int | None = None  # the adapters' random start (Tinker's `seed`; None: any)


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

    def address(self) -> tuple[str, int]:
        """This process's node address and a free port on it (rank 0's, for the others to
        meet at)."""
        import socket

        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def join(self, addr: str, port: int, rank: int, world: int) -> None:
        """Join the group of this model's engines (gloo): its chunks are sharded over it
        (chunk ZeRO), as a job's workers are."""
        import datetime

        import torch.distributed as dist

        dist.init_process_group(
            "gloo",
            init_method=f"tcp://{addr}:{port}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=JOIN_TIMEOUT_S),
        )

    def build(self) -> None:
        import pstar_core

        spec = self.spec
        cfg = dict(spec.engine_config)
        if spec.rank:
            cfg["lora"] = {"r": spec.rank, "alpha": LORA_ALPHA, "target_modules": spec.targets}
        if spec.base_path is None:  # base_models() are HF directories; zoo models are not
            raise InvalidRequest(f"{spec.base_id} has no weights to start a session from")
        if spec.seed is not None:  # the adapters' init draws from torch's generator
            import torch

            torch.manual_seed(spec.seed)
        self.engine = pstar_core.initialize(spec.base_path, cfg)

    def load(self, where: Path, optimizer: bool) -> None:
        self.build()
        self.engine.load_checkpoint(where, optimizer)

    def forward_backward(
        self,
        data: list[Datum],
        loss_fn: str,
        config: dict[str, Any],
        backward: bool,
        scale: float = 1.0,
    ) -> Output:
        return run(self.engine, data, loss_fn, config, backward=backward, scale=scale)

    def validate(self, data: list[Datum], loss_fn: str, config: dict[str, Any]) -> None:
        validate(self.engine, data, loss_fn, config)

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
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()

    def _applied(self, what: str) -> None:
        """Saving between a forward_backward and its optim_step is the caller's to fix."""
        if self.engine.pending_grads:
            raise BadInput(
                f"{what}: gradients of a forward_backward are not applied yet; call "
                "optim_step first"
            )


LocalHost = EngineHost  # in the control plane's own process

CALLERS_ERRORS = (BadInput, Unsupported, InvalidRequest, QuotaExceeded)


def results(refs: list[Any], op: str, name: str) -> list[Any]:
    """The results of `op` on a model's engines: a caller's error raised there comes back
    as itself, an engine gone as `Unavailable`, anything else as a failure with its
    message."""
    import ray
    from ray.exceptions import RayActorError, RayTaskError

    try:
        return list(ray.get(refs))
    except RayTaskError as e:
        cause = getattr(e, "cause", None)
        if isinstance(cause, CALLERS_ERRORS):
            raise cause from None
        raise RuntimeError(f"{op} failed in {name}: {cause or e}") from None
    except (RayActorError, ConnectionError) as e:  # ConnectionError: Ray's client lost it
        raise Unavailable(
            f"an engine of {name} is gone ({type(e).__name__}: its worker died or was "
            "preempted, or its Ray cluster was lost); create the training client again "
            "from a saved state"
        ) from None


def started(actors: list[Any], name: str, options: dict[str, Any]) -> list[tuple[str, int]]:
    """Wait (at most `START_TIMEOUT_S`) until every actor has started, each one's node
    address and a free port on it; if the cluster has no room for one, they are all
    killed and the error says what they asked for."""
    import ray

    refs = [a.address.remote() for a in actors]
    _, pending = ray.wait(refs, num_returns=len(refs), timeout=START_TIMEOUT_S)
    if pending:
        for a in actors:
            ray.kill(a)
        free = ray.available_resources()
        raise Unavailable(
            f"{name}: {len(pending)} of {len(actors)} engine(s) could not start within "
            f"{START_TIMEOUT_S:.0f} s: the cluster has no room for them (each asks "
            f"{options}; free now: CPU {free.get('CPU', 0):g}, memory "
            f"{free.get('memory', 0) / 2**30:.1f} GiB); end other sessions or try later"
        )
    return list(ray.get(refs))


# where this process's Ray connection for session engines goes (None: one made elsewhere)
_connected: dict[str, str | None] = {"address": None}


def check_ray_auth() -> None:
    """Ray reads RAY_AUTH_MODE once, when it is first imported: a process that imported
    it before the token settings were in its environment would connect without them."""
    if os.environ.get("RAY_AUTH_MODE", "").strip().lower() != "token":
        return
    try:
        from ray._private.authentication import authentication_utils
    except ImportError:  # another Ray: it says what is wrong itself when connecting
        return
    if not authentication_utils.is_token_auth_enabled():
        raise RuntimeError(
            "Ray was loaded in this process before RAY_AUTH_MODE=token was set, so it "
            "would connect without the token: set RAY_AUTH_MODE and RAY_AUTH_TOKEN (or "
            "RAY_AUTH_TOKEN_PATH) in the environment the control plane starts with"
        )


class RayHosts:
    """A host factory for `Sessions`: each training model's engine in a Ray actor of its
    own (`spec.workers` > 1: a group of them, chunk ZeRO between them), this process
    connected to the cluster at `address` (once, at the first model): Ray's client
    (`ray://host:10001`) as the service does, or a GCS address as a Ray driver.
    `connect()` makes the connection alone (seconds: Sessions calls it outside its lock)."""

    def __init__(self, address: str | None, options: dict[str, Any]) -> None:
        self.address, self.options = address, options

    def connect(self) -> None:
        import ray

        was = _connected["address"]
        if was is not None and (was != self.address or not ray.is_initialized()):
            # the cluster moved (the embedded head was started again, on new ports), or
            # Ray's client gave up on it: the old connection and its actors are gone
            log.info("session engines: Ray at %s, before %s", self.address, was)
            with contextlib.suppress(Exception):
                ray.shutdown()
            _connected["address"] = None
        if not ray.is_initialized():
            check_ray_auth()
            ray.init(address=self.address, namespace="pstar", log_to_driver=False)
            _connected["address"] = self.address

    def __call__(self, spec: ModelSpec) -> tuple[Host, str]:
        self.connect()
        if spec.workers > 1:
            group = RayGroupHost(spec, self.options)
            return group, f"{spec.workers} Ray actors '{group.name} 0..{spec.workers - 1}'"
        host = RayHost(spec, self.options)
        return host, f"Ray actor '{host.name}'"


def local_hosts(spec: ModelSpec) -> tuple[Host, str]:
    return LocalHost(spec), "the control plane's process"


class Lost:
    """What a host on a Ray cluster that is gone does: every request fails at once,
    saying so (not after Ray's client has waited for the cluster to come back, 30 s)."""

    name: str
    lost: str | None = None  # why its engines are gone

    def lose(self, why: str) -> None:
        self.lost = why

    def _check(self) -> None:
        if self.lost is not None:
            raise Unavailable(
                f"an engine of {self.name} is gone ({self.lost}); create the training client "
                "again from a saved state"
            )


class RayHost(Lost):
    """An `EngineHost` in a Ray actor of its own (`options`: its `num_cpus`, `memory`,
    ...), called synchronously (the model's own thread waits for each result)."""

    def __init__(self, spec: ModelSpec, options: dict[str, Any]) -> None:
        import ray

        self.name = f"session-engine {spec.id}"
        self.options = options
        actor = ray.remote(EngineHost).options(name=self.name, namespace="pstar", **options)
        self.actor: Any = actor.remote(spec)

    def _call(self, op: str, *args: Any) -> Any:
        self._check()
        return results([getattr(self.actor, op).remote(*args)], op, self.name)[0]

    def build(self) -> None:
        started([self.actor], self.name, self.options)
        self._call("build")

    def load(self, where: Path, optimizer: bool) -> None:
        started([self.actor], self.name, self.options)
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

        if self.lost is not None:
            return  # nothing left to close
        try:
            ray.get(self.actor.close.remote(), timeout=60)
        except Exception as e:  # gone already, or stuck: killed either way
            log.info("%s did not close cleanly: %s", self.name, e)
        with contextlib.suppress(Exception):  # its cluster may be gone with it
            ray.kill(self.actor)


class RayGroupHost(Lost):
    """`spec.workers` `EngineHost`s in Ray actors of their own, joined in one gloo group:
    the model's chunks are sharded over them (chunk ZeRO, as a job's workers). Every
    operation runs on all of them at once; a batch is dealt out a datum at a time (the
    ranks average their gradients, so each scales its share's loss by their count and the
    sum is the batch's), a rank left without a datum runs one with no weight (it must take
    part in the collectives); the results come back in the batch's order."""

    def __init__(self, spec: ModelSpec, options: dict[str, Any]) -> None:
        import ray

        self.name = f"session-engine {spec.id}"
        self.options = options
        self.world = spec.workers
        remote = ray.remote(EngineHost)
        self.actors: list[Any] = [
            remote.options(name=f"{self.name} {r}", namespace="pstar", **options).remote(spec)
            for r in range(self.world)
        ]

    def _one(self, r: int, op: str, *args: Any) -> Any:
        self._check()
        return self._gather([getattr(self.actors[r], op).remote(*args)], op)[0]

    def _all(self, op: str, args: Any = lambda r: ()) -> list[Any]:
        self._check()
        refs = [getattr(a, op).remote(*args(r)) for r, a in enumerate(self.actors)]
        return self._gather(refs, op)

    def _gather(self, refs: list[Any], op: str) -> list[Any]:
        return results(refs, op, self.name)

    def _join(self) -> None:
        """The engines meet (rank 0's address) before the first build."""
        addr, port = started(self.actors, self.name, self.options)[0]
        self._all("join", lambda r: (addr, port, r, self.world))

    def build(self) -> None:
        self._join()
        self._all("build")

    def load(self, where: Path, optimizer: bool) -> None:
        self._join()
        self._all("load", lambda r: (where, optimizer))

    def forward_backward(
        self, data: list[Datum], loss_fn: str, config: dict[str, Any], backward: bool
    ) -> Output:
        # the whole batch checked first: a rank refusing its share alone would leave the
        # others waiting in the forward's collectives
        self._one(0, "validate", data, loss_fn, config)
        n = self.world
        shares = [data[r::n] for r in range(n)]

        def args(r: int) -> tuple[Any, ...]:
            if shares[r]:
                return (shares[r], loss_fn, config, backward, float(n))
            return (data[:1], loss_fn, config, backward, 0.0)  # no datum: collectives only

        outs = self._all("forward_backward", args)
        logprobs: list[list[float]] = [[] for _ in data]
        loss = 0.0
        for r, out in enumerate(outs):
            if not shares[r]:
                continue
            loss += out.metrics["loss:sum"]
            for k, lp in enumerate(out.logprobs):
                logprobs[r + k * n] = lp
        return Output(logprobs, {"loss:sum": loss})

    def step(self, hyper: StepHyper) -> None:
        self._all("step", lambda r: (hyper,))

    def save_state(self, where: Path) -> None:
        self._all("save_state", lambda r: (where,))

    def export(self, where: Path) -> None:
        self._all("export", lambda r: (where,))

    def arch(self) -> str:
        return str(self._one(0, "arch"))

    def close(self) -> None:
        import ray

        if self.lost is not None:
            return  # nothing left to close
        try:
            ray.get([a.close.remote() for a in self.actors], timeout=60)
        except Exception as e:  # gone already, or stuck: killed either way
            log.info("%s did not close cleanly: %s", self.name, e)
        for a in self.actors:
            with contextlib.suppress(Exception):
                ray.kill(a)
