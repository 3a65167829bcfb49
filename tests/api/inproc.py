"""The API's generation backend with the models in this process, for API tests that need
no Ray: each target's model directory in one `Generator` (its adapters load as their
requests join the batch), and the replicas' own `answer` turning a request into events.
What it leaves out is Ray Serve itself (deploying, routing, scaling), which
tests/service/test_serving_ray.py runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from service.serving.deployments import Target
from service.serving.generation import Generator
from service.serving.model_server import answer


class InProcessBackend:
    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.gens: dict[Path, Generator] = {}

    async def open(self, target: Target, payload: dict[str, Any]):
        gen = self.gens.get(target.model_dir)
        if gen is None:
            gen = self.gens[target.model_dir] = Generator(target.model_dir, max_batch=8)
        path = self.data_dir / target.adapter if target.adapter else None
        return answer(gen, payload, target.adapter, path)

    async def aclose(self) -> None:
        for g in self.gens.values():
            g.close()
