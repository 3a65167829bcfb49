"""Schemathesis, a property-based fuzzer driven by our OpenAPI document, against the running
API on SQLite and on PostgreSQL: every operation, fed schema-valid and schema-invalid
requests with acme's token, must never answer 5xx and must answer as the document says
(declared status codes and content types, bodies matching the declared schemas, 4xx for
schema-invalid input).

Random ids only ever reach the 404 branch, so a third of the cases are schema-valid ones
aimed at objects that exist: their path ids, model and file fields (and the uploaded file)
are swapped for real ones, which takes the fuzzer past the lookups into the code behind.

A second test runs Schemathesis' own command line (`schemathesis run`) in its coverage
phase: deterministic boundary values and type mutations for every parameter (limits plus
one, empty strings, wrong types, missing required fields) and undeclared methods, which
random generation rarely hits (it found `step_to=2**31` overflowing PostgreSQL's
`integer`). Its fuzzing phase is the test above; its stateful phase is left out because
it follows links from a created job to `/logs?follow=true`, whose stream only ends when
the job does, and a dry launcher's never does.

Schemathesis' own pytest integration (`schemathesis.pytest.from_fixture`) does not run
under pytest 9.2 (it writes `Function._nodeid`, which pytest 9.2 no longer has), so each
operation is a Hypothesis test built from `operation.as_strategy()`, the documented way to
use Schemathesis from plain Hypothesis; one pytest case per operation.
"""

from __future__ import annotations

import io
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import hypothesis  # schemathesis depends on it
import pytest
import schemathesis
from hypothesis import strategies as st

from tests.api.conftest import EMBEDDER, TOKENS
from tests.service.test_store import driver_attempt
from tests.tiny import chat_lines

MAX_EXAMPLES = 25  # per operation and backend: the module takes about 30 s on 2 cores
REQUEST_TIMEOUT_S = 15  # a hung response (an endless log stream) fails instead of hanging
# Requests these operations take are valid only against the state of the service or the
# content of a file, which no JSON Schema can state: a job needs a model and files that
# exist, an upload lines that are examples, and a log `attempt` one the job has had. Their
# schema-valid requests are often (rightly) refused with a 400, so the "schema-valid
# requests are accepted" check is off for them; every other check, not_a_server_error and
# response_schema_conformance among them, still runs on them.
SEMANTIC_400 = {
    "POST /v1/files",
    "POST /v1/fine_tuning/jobs",
    "POST /v1/fine_tuning/jobs/validate",
    "GET /v1/fine_tuning/jobs/{fine_tuning_job_id}/logs",
    # valid only in some of the job's states (pause: not ended; resume: paused), as OpenAI
    "POST /v1/fine_tuning/jobs/{fine_tuning_job_id}/pause",
    "POST /v1/fine_tuning/jobs/{fine_tuning_job_id}/resume",
    # a model that exists, max_tokens within a setting and the model's context
    "POST /v1/chat/completions",
    "POST /v1/completions",
    # texts within the embedding model's window, dimensions within its width, no token ids
    "POST /v1/embeddings",
    # Tinker's: a name or a sampler to save for; tokens to sample from and a sampler,
    # weights or base model to sample with
    "POST /api/v1/save_weights_for_sampler",
    "POST /api/v1/asample",
    # a formula over the graders' names, templates naming the item's keys
    "POST /v1/fine_tuning/alpha/graders/run",
    "POST /v1/fine_tuning/alpha/graders/validate",
}


def _operations() -> list[str]:
    """Every operation's label ("GET /v1/files"), from the app's own OpenAPI document, so
    a new route is fuzzed without touching this file."""
    from api.app import create_app
    from service.settings import Settings

    settings = Settings(data_dir=Path("unused"), db_url="sqlite://", tokens={})
    schema = create_app(settings, store=None, launcher=None).openapi()  # the document only
    methods = ("get", "post", "put", "patch", "delete")
    return [f"{m.upper()} {p}" for p, ops in schema["paths"].items() for m in ops if m in methods]


OPERATIONS = _operations()


@dataclass
class Objects:
    """Objects that exist, for the aimed cases to name."""

    file: str  # acme's processed fine-tuning file
    rivals_file: str  # rival's: acme must get a 404 or 400, never the file
    queued_job: str  # acme's, queued (the dry launcher never runs it)
    cancelled_job: str  # acme's, ended
    checkpoint: str  # the ended job's final checkpoint, whose model downloads


@pytest.fixture(scope="module")
def api_schema(api):
    config = schemathesis.Config.from_dict(
        {
            "headers": {"Authorization": f"Bearer {TOKENS['acme']}"},
            "request-timeout": REQUEST_TIMEOUT_S,
        }
    )
    return schemathesis.openapi.from_url(f"{api.url}/openapi.json", config=config)


@pytest.fixture
def objects(api) -> Objects:
    """Fresh per operation: the fuzzer cancels jobs and deletes files."""
    mine, theirs = api.client("acme"), api.client("rival")
    data = io.BytesIO(("\n".join(chat_lines(8)) + "\n").encode())
    f = mine.files.create(file=("train.jsonl", data), purpose="fine-tune")
    g = theirs.files.create(
        file=("theirs.jsonl", io.BytesIO(b'{"text": "x"}\n')), purpose="fine-tune"
    )
    queued = mine.fine_tuning.jobs.create(model="gpt-tiny", training_file=f.id)
    cancelled = mine.fine_tuning.jobs.create(model="gpt-tiny", training_file=f.id)
    # the dry launcher runs nothing: the final checkpoint and the export a driver leaves
    # are written here (before the cancel, as a driver would), so a checkpoint's content
    # route has something to send
    final = api.store.checkpoints.add(
        cancelled.id,
        4,
        {},
        str(api.settings.job_dir(cancelled.id) / "ckpt"),
        keep=3,
        final=True,
        attempt=driver_attempt(api.store, cancelled.id),
    )
    mine.fine_tuning.jobs.cancel(cancelled.id)
    export = api.settings.finetuned_dir(cancelled.id)
    export.mkdir(parents=True)
    (export / "config.json").write_text("{}")
    return Objects(f.id, g.id, queued.id, cancelled.id, final.id)


KEEP = object()  # a pick that leaves the generated value as it is
DROP = object()  # a pick that removes the field


def _aim(label: str, o: Objects) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
    """(path parameter -> ids to try, body field -> values to try) for an operation."""
    path = {
        "file_id": [o.file, o.rivals_file],
        "fine_tuning_job_id": [o.queued_job, o.cancelled_job],
        "checkpoint_id": [o.checkpoint],
        "model": ["gpt-tiny", "tiny-llama"],
    }
    if label.endswith(("/logs", "/events/stream")):
        # `follow=true` and the event stream stream until the job ends, and a queued job of
        # the dry launcher never ends: only the ended job is aimed at here, whose stream
        # stops at once (and so is fuzzed with follow=true too). A random id is a 404
        # before any streaming.
        path["fine_tuning_job_id"] = [o.cancelled_job]
    body: dict[str, list[Any]] = {}
    if label in ("POST /v1/fine_tuning/jobs", "POST /v1/fine_tuning/jobs/validate"):
        body = {
            "model": ["gpt-tiny", "tiny-llama"],
            "training_file": [o.file, o.file, o.rivals_file],
            "validation_file": [DROP, o.file, o.rivals_file],
            # a random engine section or worker count is refused (unknown engine fields,
            # a batch_size not a multiple of num_workers) far more often than not: some
            # aimed requests leave them out, and so get as far as creating a job
            "engine": [KEEP, {}],
            "resources": [KEEP, {}],
        }
    if label in ("POST /v1/chat/completions", "POST /v1/completions"):
        # the tiny Llama answers (in the test process): short answers keep the module fast
        body = {"model": ["tiny-llama"], "max_tokens": [4, DROP], "stream": [KEEP, False]}
    if label == "POST /v1/embeddings":
        body = {"model": [EMBEDDER, KEEP]}  # the configured model (api's), or any name
    return path, body


def _cases(operation, label: str, o: Objects):
    """A third each: schema-invalid cases, schema-valid ones, and schema-valid ones aimed at
    objects that exist. (A schema-invalid case is refused before any lookup, so aiming it
    would add nothing.)"""
    from schemathesis import GenerationMode

    valid = operation.as_strategy(GenerationMode.POSITIVE)
    path_choices, body_choices = _aim(label, o)

    def picks(choices: dict[str, list[Any]]):
        return st.fixed_dictionaries({k: st.sampled_from(v) for k, v in choices.items()})

    def aimed(args):
        case, path, body = args
        # assigning new containers (not editing them) lets Schemathesis see the change and
        # check the case again against the schema
        mine = {k: v for k, v in path.items() if k in (case.path_parameters or {})}
        if mine:
            case.path_parameters = {**case.path_parameters, **mine}
        if body and isinstance(case.body, dict):
            merged = {**case.body, **{k: v for k, v in body.items() if v is not KEEP}}
            case.body = {k: v for k, v in merged.items() if v is not DROP}
        return case

    if label == "POST /v1/files":
        # a multipart body edited after generation cannot be checked again against the
        # schema (Schemathesis then takes it for schema-invalid): give it whole instead
        jsonl = ("\n".join(chat_lines(4)) + "\n").encode()
        on_target = operation.as_strategy(
            GenerationMode.POSITIVE, body={"file": jsonl, "purpose": "fine-tune"}
        )
    else:
        on_target = st.tuples(valid, picks(path_choices), picks(body_choices)).map(aimed)
    return st.one_of(operation.as_strategy(GenerationMode.NEGATIVE), valid, on_target)


@pytest.mark.parametrize("label", OPERATIONS)
def test_fuzzed_requests_get_no_5xx_and_the_answer_the_schema_declares(
    api, api_schema, objects, label
):
    operation = api_schema.find_operation_by_label(label)
    assert operation is not None, f"{label} is in the app but not in its served document"
    excluded = [schemathesis.checks.positive_data_acceptance] if label in SEMANTIC_400 else []
    calls = []

    @hypothesis.settings(
        max_examples=MAX_EXAMPLES,
        deadline=None,  # a request to a live server, timed by REQUEST_TIMEOUT_S instead
        derandomize=True,  # the same cases on every run: a failure here reproduces
        database=None,
        suppress_health_check=[hypothesis.HealthCheck.too_slow],
    )
    @hypothesis.given(case=_cases(operation, label, objects))
    def fuzz(case):
        response = case.call_and_validate(base_url=api.url, excluded_checks=excluded)
        calls.append(response.status_code)

    fuzz()
    assert calls, f"no request was sent for {label}"
    assert all(s < 500 for s in calls)


def test_the_document_declares_the_400_envelope_not_fastapis_422(api):
    doc = httpx.get(f"{api.url}/openapi.json").json()
    envelope = {"$ref": "#/components/schemas/ErrorEnvelope"}
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            codes = op["responses"]
            assert "422" not in codes, (method, path)
            if op.get("parameters") or op.get("requestBody"):
                schema = codes["400"]["content"]["application/json"]["schema"]
                assert schema == envelope, (method, path)
    assert "HTTPValidationError" not in doc["components"]["schemas"]


def test_schemathesis_coverage_phase_finds_nothing(api, objects, tmp_path):
    """`schemathesis run --phases coverage` against the server exits 0: no failed check.

    Path ids are pinned to objects that exist, so the boundary values of the other
    parameters reach the store: a file in use by the queued job (a DELETE is a 409, the
    file stays), the ended job (its `/logs?follow=true` stream stops at once) and its
    final checkpoint (whose model downloads)."""
    checks_off = "".join(
        f'\n[[operations]]\ninclude-method = "{m}"\ninclude-path = "{p}"\n'
        "checks.positive_data_acceptance.enabled = false\n"
        for m, p in (label.split(" ", 1) for label in sorted(SEMANTIC_400))
    )
    # its config names path and query values, not body fields: every case of a completion
    # or an embedding would name a model that does not exist (a 404); those are fuzzed
    # above instead, with bodies aimed at the served models. Tinker's routes name their
    # session, model and request in the body too (the SDK's protocol): fuzzed above, and
    # driven by the SDK
    skipped = (
        "".join(
            f'\n[[operations]]\ninclude-path = "{p}"\nenabled = false\n'
            for p in ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
        )
        + '\n[[operations]]\ninclude-path-regex = "^/api/v1/"\nenabled = false\n'
    )
    config = tmp_path / "schemathesis.toml"
    config.write_text(
        f'headers = {{ Authorization = "Bearer {TOKENS["acme"]}" }}\n'
        f"request-timeout = {REQUEST_TIMEOUT_S}\n"
        "[parameters]\n"
        f'"path.file_id" = "{objects.file}"\n'
        f'"path.fine_tuning_job_id" = "{objects.cancelled_job}"\n'
        f'"path.checkpoint_id" = "{objects.checkpoint}"\n'
        'model = "gpt-tiny"\n' + checks_off + skipped
    )
    cli = Path(sys.executable).with_name("schemathesis")
    run = subprocess.run(
        [
            *(str(cli), "--no-color", "--config-file", str(config)),
            *("run", f"{api.url}/openapi.json", "--phases", "coverage"),
            *("--seed", "1", "--continue-on-failure"),
        ],
        cwd=tmp_path,  # its cache directory goes here, not into the repository
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-20_000:] + run.stderr[-5_000:]
    assert "Coverage" in run.stdout
    assert "Missing test data" not in run.stdout, run.stdout[-6000:]  # the pinned ids were used
