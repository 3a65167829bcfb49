"""The `TorchTrainer` that a job's driver and `pstar train --workers` run: Ray Train's,
less a per-start actor our runs never use.

[Note: what a Ray Train start costs] Each `fit()` of Ray Train 2.60 starts, besides the
controller, the workers and the `SynchronizationActor` its `report()` barrier needs, three
actors of its own, each a Python process that imports Ray (~2-3 s of CPU each; on a
2-core node they start while the workers import torch and slow them down):

- `DatasetManager` (`DatasetsCallback`): hands out Ray Data shards. Created even when the
  trainer has no `datasets`, and it pickles Ray Data's context into every worker, so each
  worker also imports `ray.data` before the train function runs. Our workers read their
  rows from the prepared file (`run.data_file`) and never ask for a shard.
- `PlacementGroupCleaner` (`PlacementGroupCleanerCallback`): a detached actor that removes
  the workers' placement group as soon as the controller dies. Kept: when a driver is
  killed, it frees the workers' resources for the next attempt at once, where Ray's own
  clean-up of the dead job's placement groups comes later (a killed-driver test took
  twice as long without it, though on a loaded machine).
- `PreemptionWatcher`: polls Ray for node drains. Left as Ray sets it (a cluster of
  preemptible nodes may want it); the embedded local head, whose one node is never
  drained, turns it off (`service.control.local_ray.HEAD_ENV`).

Measured on 2 cores (`pstar serve` with its local head, a tiny Llama on 2 workers, all
three actors gone, with the reconciler's wake-ups): Ray Train's "Worker group startup" went
from ~10.4 s to ~4 s, and a job's first step came ~10 s sooner after its submission; the
placement-group cleaner is back since. The callback is dropped by type from Ray's own
default list (`_create_default_callbacks`, private to Ray, which is pinned in
`pyproject.toml`); a Ray without it gets its defaults unchanged.
"""

from __future__ import annotations

import logging
from typing import Any

from service.spec.resources import Resources
from service.spec.run_plan import CHECKPOINTS_TO_KEEP

log = logging.getLogger(__name__)


def _unused_callback_types() -> tuple[type, ...]:
    """The default callbacks whose actors our runs never use (see the note above)."""
    try:
        from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
    except ImportError:  # another Ray: its defaults stay as they are
        return ()
    return (DatasetsCallback,)


def lean_torch_trainer(*args: Any, **kwargs: Any) -> Any:
    """`ray.train.torch.TorchTrainer(*args, **kwargs)` without the unused actors. Only for
    trainers without `datasets`."""
    from ray.train.torch import TorchTrainer

    if kwargs.get("datasets"):
        return TorchTrainer(*args, **kwargs)
    unused = _unused_callback_types()

    class _LeanTorchTrainer(TorchTrainer):
        def _create_default_callbacks(self) -> list[Any]:
            callbacks = super()._create_default_callbacks()  # type: ignore[misc]
            return [cb for cb in callbacks if not isinstance(cb, unused)]

    if not unused or not hasattr(TorchTrainer, "_create_default_callbacks"):
        return TorchTrainer(*args, **kwargs)
    return _LeanTorchTrainer(*args, **kwargs)


def per_worker(resources: Resources) -> dict[str, float]:
    """What Ray reserves for each worker: its CPUs and, when the job gives it, its host
    memory (the engine's host tier plans within that: `memory.host_reserved`)."""
    out: dict[str, float] = {"CPU": resources.cpus_per_worker}
    if resources.memory_per_worker is not None:
        out["memory"] = resources.memory_per_worker
    return out


def fit_on_workers(
    train_loop: Any,
    config: dict[str, Any],
    *,
    name: str,
    storage_path: str,
    resources: Resources,
    max_failures: int,
    keep: int = CHECKPOINTS_TO_KEEP,
) -> Any:
    """The one launch of the worker loop on Ray Train workers, for a job's driver and for
    `pstar train --workers`: `train_loop(config)` on `resources.num_workers` workers (gloo
    on CPU, NCCL with a GPU each), a lost worker group restarted up to `max_failures`
    times from the newest of the `keep` checkpoints Ray keeps; Ray's result."""
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig

    trainer = lean_torch_trainer(
        train_loop,
        train_loop_config=config,
        torch_config=TorchConfig(backend="nccl" if resources.use_gpu else "gloo"),
        scaling_config=ScalingConfig(
            num_workers=resources.num_workers,
            use_gpu=resources.use_gpu,
            resources_per_worker=per_worker(resources),
            placement_strategy=resources.placement_strategy,
        ),
        run_config=RunConfig(
            name=name,
            storage_path=storage_path,
            failure_config=FailureConfig(max_failures=max_failures),
            checkpoint_config=CheckpointConfig(num_to_keep=keep),
        ),
    )
    return trainer.fit()
