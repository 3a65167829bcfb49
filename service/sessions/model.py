"""A training session's model as the control plane keeps it (`TrainingModel`): its
engine's host (`service.sessions.hosts`), the thread that runs its requests one at a time
in the order of their `seq_id` (`Ordered`), its saves (`tinker://<model id>/weights/...`
and `.../sampler_weights/...`) and what the dashboard shows of it. The registry of
sessions and models is `service.sessions.runtime`'s."""

from __future__ import annotations

import json
import re
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pstar_core.optim import StepHyper
from service.errors import InvalidRequest
from service.registry import ModelRef
from service.sessions import checkpoints
from service.sessions.hosts import Host
from service.sessions.losses import BadInput, Datum

STATE_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class Ordered:
    """Runs callables one at a time on a thread of its own, in the order of their sequence
    numbers from `first` on, whatever order they arrive in; a number submitted twice gets
    the first submission's future."""

    def __init__(self, name: str, first: int = 0) -> None:
        self.next = first
        self.futures: dict[int, Future] = {}
        self._pending: dict[int, Callable[[], Any]] = {}
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, seq: int, fn: Callable[[], Any]) -> Future:
        with self._cond:
            if seq in self.futures:
                return self.futures[seq]
            if seq < self.next:
                raise InvalidRequest(f"seq_id {seq} comes before this model's next ({self.next})")
            fut: Future = Future()
            self.futures[seq] = fut
            self._pending[seq] = fn
            self._cond.notify_all()
            return fut

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while self.next not in self._pending and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                seq = self.next
                fn = self._pending.pop(seq)
                fut = self.futures[seq]
            try:
                fut.set_result(fn())
            except BaseException as e:  # handed to whoever asks for the result
                fut.set_exception(e)
            with self._cond:
                self.next = seq + 1


@dataclass(frozen=True)
class SaveOptions:
    """What a save asks beside its name: when the checkpoint expires (None: kept until
    deleted), the caller's metadata, whether an existing name is replaced."""

    ttl_seconds: int | None = None
    user_metadata: dict[str, str] | None = None
    overwrite: bool = False

    def __post_init__(self) -> None:
        checkpoints.check_ttl(self.ttl_seconds)  # a 400 before anything is written


@dataclass
class TrainingModel:
    """A training model as the control plane keeps it: its engine's host (this process or
    a Ray actor, `service.sessions.hosts`), the thread that runs its requests in order,
    and what the dashboard shows of it."""

    id: str
    tenant: str
    base: ModelRef
    rank: int  # 0: full fine-tuning
    targets: tuple[str, ...]
    host: Host
    runner: Ordered
    where: str = "the control plane's process"
    created: float = field(default_factory=time.time)
    steps: int = 0  # optim_steps taken
    tokens: int = 0  # tokens through forward and forward_backward
    last_loss: float | None = None  # the last forward(_backward)'s loss:sum
    last_op: str = "create_model"
    last_op_at: float = field(default_factory=time.time)
    built: bool = False
    model_data_bytes: int | None = None  # the capacity planner's, checked at creation
    workers: int = 1  # engines with chunk ZeRO between them

    def overview(self) -> dict[str, Any]:
        """What the dashboard shows of it."""
        return {
            "id": self.id,
            "base_model": self.base.id,
            "lora_rank": self.rank or None,
            "kind": f"LoRA r={self.rank}" if self.rank else "full",
            "steps": self.steps,
            "tokens": self.tokens,
            "last_loss": self.last_loss,
            "last_op": self.last_op,
            "last_op_at": self.last_op_at,
            "created": self.created,
            "where": self.where,
            "model_data_bytes": self.model_data_bytes,
            "workers": self.workers,
        }

    def build(self) -> dict[str, Any]:
        self.host.build()
        self.built = True
        return {"model_id": self.id, "type": "create_model"}

    def forward_backward(self, data: list[Datum], loss_fn: str, config: dict, backward: bool):
        out = self.host.forward_backward(data, loss_fn, config, backward)
        self.tokens += sum(len(d.tokens) for d in data)
        self.last_loss = out.metrics.get("loss:sum")
        return out

    def optim_step(self, hyper: StepHyper) -> dict[str, Any]:
        self.host.step(hyper)
        self.steps += 1
        return {"metrics": {}}

    def save(self, root: Path, name: str, opts: SaveOptions) -> dict[str, Any]:
        """The whole training state (weights, Adam's moments, the step), for `load_weights`
        to continue from bitwise: `tinker://<model id>/weights/<name>`."""
        where = self._place(root, "weights", name, opts.overwrite)
        self.host.save_state(where / "engine")
        self._describe(where, opts)
        return {"path": f"tinker://{self.id}/weights/{name}", "type": "save_weights"}

    def save_for_sampler(self, root: Path, name: str, opts: SaveOptions) -> Path:
        """The weights a sampler needs, `tinker://<model id>/sampler_weights/<name>`: a
        LoRA's adapter (peft), or the whole model (transformers, with the tokenizer). A
        name is written once (a sampler may hold its adapter in memory by that name)."""
        where = self._place(root, "sampler_weights", name, overwrite=False)
        # the files in a directory of their own: a name deleted and saved again is a new
        # adapter to the model servers, which keep adapters in memory by their path
        files = uuid.uuid4().hex[:12]
        self.host.export(where / files)
        self._describe(where, opts, files=files)
        return where

    def _place(self, root: Path, kind: str, name: str, overwrite: bool) -> Path:
        check_name(name)
        where = root / self.id / kind / name
        if (where / checkpoints.META).exists() and not overwrite:
            raise BadInput(
                f"a checkpoint named {name!r} exists (tinker://{self.id}/{kind}/{name}); "
                "choose another name" + (" or pass overwrite=True" if kind == "weights" else "")
            )
        return where

    def _describe(self, where: Path, opts: SaveOptions, files: str | None = None) -> None:
        meta = checkpoints.meta_for(
            self.base.id, self.rank, list(self.targets), opts.ttl_seconds, opts.user_metadata
        )
        meta["workers"] = self.workers  # a ZeRO state loads on as many engines
        if files is not None:
            meta["files"] = files
        (where / checkpoints.META).write_text(json.dumps(meta))

    def load(self, where: Path, optimizer: bool = True) -> dict[str, Any]:
        self.host.load(where / "engine", optimizer)
        self.built = True
        return {"model_id": self.id, "type": "load_weights"}

    def info(self) -> dict[str, Any]:
        arch = self.host.arch() if self.built else "unknown"
        return {
            "type": "get_info",
            "model_id": self.id,
            "model_data": {"arch": arch, "model_name": self.base.id, "tokenizer_id": self.base.id},
            "is_lora": self.rank > 0,
            "lora_rank": self.rank or None,
            "model_name": self.base.id,
        }


def check_name(name: str) -> None:
    if not STATE_NAME_RE.match(name):
        raise InvalidRequest(
            f"name {name!r}: use letters, digits, '.', '_' or '-' (at most 128), starting "
            "with a letter or digit"
        )
