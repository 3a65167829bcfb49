"""Ray Train: 2 CPU workers with chunk ZeRO; a worker that dies is replaced and resumes."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def ray_local():
    import ray
    import ray.cloudpickle

    # the crashing worker loop below travels to the workers by value, not by import
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

    os.environ["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] = "0.2"
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def crash_rank_1_after_step(at: int, marker: Path):
    """A worker loop that is `train_func`, except that rank 1 dies hard right after step
    `at` of the first attempt (the marker file says it has happened)."""

    def loop(config):
        import ray.train

        import service.worker.ray_train as rt

        rank = ray.train.get_context().get_world_rank()
        build = rt.build_engine

        def crashing_build(*args, **kwargs):
            engine = build(*args, **kwargs)
            step = engine.step

            def step_then_crash(*args, **kwargs):  # (backward_and_step passes its hyper)
                done = step(*args, **kwargs)
                if rank == 1 and engine.global_step == at and not marker.exists():
                    marker.write_text(str(os.getpid()))
                    os._exit(1)
                return done

            engine.step = step_then_crash
            return engine

        rt.build_engine = crashing_build
        try:
            rt.train_func(config)
        finally:
            rt.build_engine = build

    return loop


def test_lost_worker_resumes_from_the_last_checkpoint_and_finishes(ray_local, tmp_path):
    from service.spec.train import TrainSpec
    from service.worker.ray_train import run_ray

    text = tmp_path / "corpus.txt"
    lines = [f"the {a} of the {b} is {c}" for a in "abcdefgh" for b in "ijklmnop" for c in "xyz"]
    text.write_text("\n".join(lines * 4))
    spec_path = tmp_path / "job.yaml"
    spec_path.write_text(
        f"""
name: ray-job
model: gpt-tiny
data: {{path: {text}, seq_len: 32, vocab_size: 300}}
train: {{steps: 12, batch_size: 8, log_every: 2, checkpoint_every: 2}}
engine: {{dtype: fp32, chunk_size: 32768, optimizer: {{lr: 0.01}}}}
output_dir: {tmp_path / "runs"}
"""
    )
    spec = TrainSpec.load(spec_path)
    marker = tmp_path / "crashed"
    loop = crash_rank_1_after_step(7, marker)
    result = run_ray(spec, workers=2, max_failures=2, train_loop=loop)
    assert marker.exists()  # rank 1 really died at step 7 of the first attempt
    assert result["error"] is None
    assert result["metrics"]["step"] == 12
    lines = [
        json.loads(x) for x in (tmp_path / "runs/ray-job/metrics.jsonl").read_text().splitlines()
    ]
    first = [m for m in lines if m["attempt_resumed"] == 0]
    resumed = [m for m in lines if m["attempt_resumed"] == 1]
    assert [m["step"] for m in first][:3] == [2, 4, 6]
    assert resumed, "no metrics after the restart"
    # the restart continues from the last registered checkpoint (step 6, or 4 if the last
    # report was lost with the worker), not from scratch, and the loss curve goes on
    assert resumed[0]["step"] in (6, 8)
    assert resumed[-1]["step"] == 12
    assert resumed[-1]["train_loss"] < first[0]["train_loss"]
    for m in lines:
        assert m["world_size"] == 2
        assert m["model_data_bytes_device"] > 0
        assert m["comm_bytes_sent"] > 0
        assert m["tokens_per_second"] > 0
