"""A training method is one file: a package outside this tree adds one through the
`pstar.methods` entry-point group (one line), and the request schema, the job checks, the
stored plan, data preparation and the worker loop take it. Run in a fresh interpreter,
since the registry is read when `service.methods` is first imported."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from service import methods

ROOT = Path(__file__).resolve().parents[2]

# the one file: supervised, reporting the perplexity too, with a hyperparameter of its own
PLUGIN = """
import math
from typing import Annotated, Any

from pydantic import Field

from service.methods.base import Method
from service.methods.sections import Auto, Hyperparameters
from service.methods.objectives import Supervised
from service.spec.resources import Body


class PerplexityHyperparameters(Hyperparameters):
    perplexity_cap: Auto | Annotated[float, Field(gt=1)] = "auto"


class PerplexitySection(Body):
    hyperparameters: PerplexityHyperparameters | None = None


class PerplexityObjective(Supervised):
    def __init__(self, cap: float) -> None:
        self.cap = cap

    def values(self, sums: dict[str, float]) -> dict[str, float]:
        out = Supervised.values(sums)
        out["train_perplexity"] = min(self.cap, math.exp(out["train_loss"]))
        return out


class PerplexityMethod(Method):
    name = "perplexity"
    summary = "supervised, reporting the perplexity"
    section = PerplexitySection
    hyperparameters = PerplexityHyperparameters

    def decided(self, hp: Any) -> dict[str, Any]:
        cap = hp.perplexity_cap
        return {"perplexity_cap": 1e6 if cap == "auto" else float(cap)}

    def objective(self, run: dict[str, Any]) -> Any:
        return PerplexityObjective(run.hyperparameters.perplexity_cap)


METHOD = PerplexityMethod()
"""

# the one line, in the plugin package's metadata
ENTRY_POINTS = "[pstar.methods]\nperplexity = perplexity_method:METHOD\n"

SCRIPT = r"""
import json, sys, tempfile
from pathlib import Path

import httpx

from service import methods
from service.control.driver import prepare_run
from service.worker.finetune import build_job_engine
from service.spec.request import JobRequest
from service.worker.reporting import Reporter
from service.worker.train_local import DirCheckpoints
from service.worker.loop import run_loop
from tests.api.conftest import start_api
from tests.service.test_store import driver_attempt

out = {"registered": sorted(methods.METHODS)}
schema = JobRequest.model_json_schema()["$defs"]["Method"]["properties"]
out["schema_enum"] = schema["type"]["enum"]
out["schema_has_section"] = "perplexity" in schema

data = Path(tempfile.mkdtemp())
api, stop = start_api(data, f"sqlite:///{data / 'store.db'}", "sqlite")
try:
    client = api.client()
    lines = [
        {"messages": [{"role": "user", "content": f"say {i}"},
                      {"role": "assistant", "content": f"{i} {i} {i}"}]}
        for i in range(8)
    ]
    f = client.files.create(
        file=("chat.jsonl", "\n".join(json.dumps(x) for x in lines).encode()),
        purpose="fine-tune",
    )
    method = {"type": "perplexity",
              "perplexity": {"hyperparameters": {"n_epochs": 1, "batch_size": 4,
                                                 "perplexity_cap": 5000}}}
    job = client.fine_tuning.jobs.create(model="tiny-llama", training_file=f.id, method=method)
    out["echoed_method"] = job.method.type
    try:
        client.fine_tuning.jobs.create(
            model="tiny-llama", training_file=f.id,
            method={"type": "perplexity", "perplexity": {"hyperparameters": {"beta": 1}}})
    except Exception as e:
        out["refused"] = str(e)
    stored = api.store.jobs.get(job.id)
    out["plan_method"] = stored.plan["method"]
    out["plan_cap"] = stored.plan["hyperparameters"]["perplexity_cap"]
    # what the job's driver and its one worker do, in this process
    attempt = driver_attempt(api.store, job.id)
    run = prepare_run(api.settings, api.store, api.store.jobs.get(job.id), attempt)
    engine = build_job_engine(run)
    rep = Reporter({"job_id": job.id, "attempt": attempt, "run": run}, 0, api.store)
    run_loop(run, engine, 0, 1, rep, DirCheckpoints(data / "ck", run.lora))
    got = httpx.get(f"{api.base}/fine_tuning/jobs/{job.id}/metrics", headers=api.headers()).json()
    out["series"] = {k: v["values"] for k, v in got["series"].items()
                     if k in ("train_loss", "train_perplexity")}
finally:
    stop()
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def plugin_result(tmp_path_factory) -> dict:
    site = tmp_path_factory.mktemp("plugin")
    (site / "perplexity_method.py").write_text(textwrap.dedent(PLUGIN))
    info = site / "perplexity_method-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: perplexity-method\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(ENTRY_POINTS)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), str(ROOT)]))
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    why = proc.stdout[-3000:] + proc.stderr[-5000:]
    assert proc.returncode == 0, why
    assert lines, why
    return json.loads(lines[-1].removeprefix("RESULT "))


def test_a_method_from_one_file_and_one_entry_point_is_in_the_registry_and_the_schema(
    plugin_result,
):
    assert plugin_result["registered"] == sorted([*methods.METHODS, "perplexity"])
    assert "perplexity" in plugin_result["schema_enum"]
    assert plugin_result["schema_has_section"]


def test_the_plugin_method_is_checked_stored_and_echoed_as_its_own(plugin_result):
    assert plugin_result["echoed_method"] == "perplexity"
    # its section takes its own hyperparameters and refuses another method's
    assert "beta" in plugin_result["refused"]
    assert plugin_result["plan_method"] == {"type": "perplexity", "lora": None}
    assert plugin_result["plan_cap"] == 5000.0


def test_the_worker_loop_runs_the_plugin_objective_and_its_metric_reaches_the_api(
    plugin_result,
):
    series = plugin_result["series"]
    losses, ppl = series["train_loss"], series["train_perplexity"]
    assert len(losses) == len(ppl) == 2  # 8 examples, batch 4, one epoch
    for loss, p in zip(losses, ppl, strict=True):
        assert p == pytest.approx(min(5000.0, 2.718281828459045**loss), rel=1e-6)


def test_no_module_outside_the_registry_compares_a_method_name():
    # the registry is the one place a method is found by its name
    names = [m.name for m in methods.METHODS.values()]
    offenders = []
    for path in sorted((ROOT / "service").rglob("*.py")):
        if path.parent.name == "methods":
            continue
        text = path.read_text()
        for name in names:
            for form in (f'== "{name}"', f'!= "{name}"', f"== '{name}'", f"!= '{name}'"):
                if form in text:
                    offenders.append(f"{path.relative_to(ROOT)}: {form}")
    assert offenders == []
