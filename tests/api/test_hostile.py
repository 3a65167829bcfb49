"""Hostile input, on SQLite and PostgreSQL: every failure a user can cause gets a 4xx with
OpenAI's error envelope `{"error": {"message", "type", "param", "code"}}` and stores
nothing; a 500 is always our bug.

Malformed and mistyped job bodies, numbers too large for any field or store, NaN and
Infinity, text a store cannot hold, ids that do not exist or are another tenant's,
engine settings the service owns; uploads that are too large, not multipart, cut off,
with bad lines or with path-like names; bad query parameters, unknown routes and wrong
methods. Each is checked for its status, the envelope (with `param` naming the field),
and that no job or file was stored.
"""

from __future__ import annotations

import io
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from service.store import File, new_id
from tests.tiny import chat_lines

JOBS = "/fine_tuning/jobs"
GOOD = ("\n".join(chat_lines(4)) + "\n").encode()


def assert_envelope(
    r: httpx.Response, status: int, param: Any = ..., code: Any = ...
) -> dict[str, Any]:
    """The response is a 4xx carrying OpenAI's error envelope, and nothing else."""
    assert 400 <= status < 500
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    payload = r.json()
    assert set(payload) == {"error"}, payload
    err = payload["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str), err
    assert err["message"].strip(), err
    assert isinstance(err["type"], str), err
    assert err["type"], err
    assert err["param"] is None or isinstance(err["param"], str), err
    assert err["code"] is None or isinstance(err["code"], str), err
    if param is not ...:
        assert err["param"] == param, err
    if code is not ...:
        assert err["code"] == code, err
    return err


@dataclass
class Ids:
    """Objects the hostile requests refer to."""

    file: str  # acme's processed fine-tuning file
    rivals_file: str  # rival's file: for acme it does not exist
    other_purpose: str  # acme's, but not a fine-tuning file
    job: str  # acme's queued job


@pytest.fixture(scope="module")
def ids(api) -> Ids:
    mine, theirs = api.client("acme"), api.client("rival")
    f = mine.files.create(file=("train.jsonl", io.BytesIO(GOOD)), purpose="fine-tune")
    g = theirs.files.create(file=("theirs.jsonl", io.BytesIO(GOOD)), purpose="fine-tune")
    # the API only takes fine-tuning files; a file stored for another purpose (an older
    # version, another tool on the same store) is put in the store directly
    other = api.store.files.add(
        File(
            id=new_id("file"),
            tenant="acme",
            filename="notes.txt",
            purpose="assistants",
            bytes=len(GOOD),
            sha256="0" * 64,
            created_at=int(time.time()),
            status="processed",
            status_details=None,
            format="chat",
            examples=4,
            storage_name="none",
        )
    )
    job = mine.fine_tuning.jobs.create(model="gpt-tiny", training_file=f.id)
    return Ids(f.id, g.id, other.id, job.id)


def stored_jobs(api, tenant: str = "acme") -> set[str]:
    rows, more = api.store.jobs.page(tenant, None, 100_000)
    assert not more
    return {j.id for j in rows}


def stored_files(api, tenant: str = "acme") -> set[str]:
    rows, more = api.store.files.page(tenant, None, 100_000, None, "desc")
    assert not more
    return {f.id for f in rows}


def files_dir_entries(api) -> set[str]:
    d: Path = api.settings.files_dir
    return {p.name for p in d.iterdir()} if d.is_dir() else set()


def post_json(api, path: str, body: Any, tenant: str = "acme", **headers: str) -> httpx.Response:
    content = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return httpx.post(
        api.base + path,
        content=content,
        headers={**api.headers(tenant), "Content-Type": "application/json", **headers},
    )


# -- job bodies ---------------------------------------------------------------------------

Body = Callable[[Ids], Any]


def body(**fields: Any) -> Body:
    """A valid body (gpt-tiny on acme's file) with `fields` replaced."""
    return lambda ids: {"model": "gpt-tiny", "training_file": ids.file, **fields}


def hp(**fields: Any) -> Body:
    return body(hyperparameters=fields)


# (case, body, param the error names, code)
BAD_BODIES: list[tuple[str, Body, str, str]] = [
    ("model is a number", body(model=5), "model", "invalid_value"),
    ("n_epochs is a word", hp(n_epochs="many"), "hyperparameters.n_epochs", "invalid_value"),
    ("n_epochs is true", hp(n_epochs=True), "hyperparameters.n_epochs", "invalid_value"),
    ("batch_size is 2.5", hp(batch_size=2.5), "hyperparameters.batch_size", "invalid_value"),
    (
        "num_workers is a string",
        body(resources={"num_workers": "2"}),
        "resources.num_workers",
        "invalid_value",
    ),
    ("use_gpu is 1", body(resources={"use_gpu": 1}), "resources.use_gpu", "invalid_value"),
    ("n_epochs is 10**30", hp(n_epochs=10**30), "hyperparameters.n_epochs", "invalid_value"),
    ("seed is 2**70", body(seed=2**70), "seed", "invalid_value"),
    ("seed is negative", body(seed=-1), "seed", "invalid_value"),
    (
        "learning_rate_multiplier is 1e308",
        hp(learning_rate_multiplier=1e308),
        "hyperparameters.learning_rate_multiplier",
        "invalid_value",
    ),
    (
        "learning_rate_multiplier is 0",
        hp(learning_rate_multiplier=0),
        "hyperparameters.learning_rate_multiplier",
        "invalid_value",
    ),
    ("max_steps is -1", hp(max_steps=-1), "hyperparameters.max_steps", "invalid_value"),
    ("max_attempts is 11", body(max_attempts=11), "max_attempts", "invalid_value"),
    ("an unknown top-level field", body(bogus=1), "bogus", "invalid_value"),
    ("an unknown hyperparameter", hp(warmup=3), "hyperparameters.warmup", "invalid_value"),
    ("model is missing", lambda ids: {"training_file": ids.file}, "model", "invalid_value"),
    ("model is empty", body(model=""), "model", "invalid_value"),
    ("an unknown model", body(model="no-such-model"), "model", "model_not_found"),
    ("a fine-tuned model of nobody's", body(model="ft:x:y:ftjob-0"), "model", "model_not_found"),
    ("an unknown file", body(training_file="file-nope"), "training_file", "file_not_found"),
    (
        "another tenant's training file",
        lambda ids: body(training_file=ids.rivals_file)(ids),
        "training_file",
        "file_not_found",
    ),
    (
        "another tenant's validation file",
        lambda ids: body(validation_file=ids.rivals_file)(ids),
        "validation_file",
        "file_not_found",
    ),
    (
        "a file that is not for fine-tuning",
        lambda ids: body(training_file=ids.other_purpose)(ids),
        "training_file",
        "invalid_file",
    ),
    (
        "batch_size not a multiple of num_workers",
        body(hyperparameters={"batch_size": 3}, resources={"num_workers": 2}),
        "hyperparameters.batch_size",
        "invalid_value",
    ),
    (
        "engine.device, which the service sets",
        body(engine={"device": "cuda"}),
        "engine.device",
        "invalid_value",
    ),
    (
        "engine.memory.disk_dir, which the service sets",
        body(engine={"memory": {"disk_dir": "/etc"}}),
        "engine.memory.disk_dir",
        "invalid_value",
    ),
    ("engine.dtype fp8", body(engine={"dtype": "fp8"}), "engine.dtype", "invalid_value"),
    ("an unknown engine field", body(engine={"turbo": True}), "engine.turbo", "invalid_value"),
    ("engine is a list", body(engine=[1]), "engine", "invalid_value"),
    (
        "engine.optimizer is a string",
        body(engine={"optimizer": "x"}),
        "engine.optimizer",
        "invalid_value",
    ),
    (
        "an engine number past 64 bits",
        body(engine={"optimizer": {"lr": 10**30}}),
        "engine.optimizer.lr",
        "invalid_value",
    ),
    (
        "a learning rate that overflows",
        body(engine={"optimizer": {"lr": 1e308}}, hyperparameters={"learning_rate_multiplier": 10}),
        "hyperparameters.learning_rate_multiplier",
        "invalid_value",
    ),
    (
        "reinforcement on chat examples",
        body(model="tiny-llama", method={"type": "reinforcement"}),
        "training_file",
        "invalid_file",
    ),
    (
        "a dpo section in a supervised method",
        body(method={"type": "supervised", "dpo": {}}),
        "method",
        "invalid_value",
    ),
    (
        "dpo on chat examples",
        body(model="tiny-llama", method={"type": "dpo"}),
        "training_file",
        "invalid_file",
    ),
    ("dpo on a zoo model", body(method={"type": "dpo"}), "model", "model_not_available"),
    (
        "a dpo beta of zero",
        body(method={"type": "dpo", "dpo": {"hyperparameters": {"beta": 0}}}),
        "method.dpo.hyperparameters.beta",
        "invalid_value",
    ),
    (
        "early stopping without a validation file",
        body(early_stopping={"patience": 2}),
        "early_stopping",
        "invalid_value",
    ),
    (
        "early stopping with no patience",
        body(early_stopping={"patience": 0}),
        "early_stopping.patience",
        "invalid_value",
    ),
    (
        "packing as a word",
        body(hyperparameters={"packing": "yes"}),
        "hyperparameters.packing",
        "invalid_value",
    ),
    (
        "hyperparameters twice",
        body(
            hyperparameters={"n_epochs": 1},
            method={"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 2}}},
        ),
        "body",
        "invalid_value",
    ),
    (
        "a wandb integration without its settings",
        body(integrations=[{"type": "wandb"}]),
        "integrations.0.wandb.wandb",
        "invalid_value",
    ),
    (
        "an integration this service has no client for",
        body(integrations=[{"type": "comet"}]),
        "integrations.0",
        "invalid_value",
    ),
    ("a suffix with a slash", body(suffix="../x"), "suffix", "invalid_value"),
    (
        "17 metadata keys",
        body(metadata={str(i): "v" for i in range(17)}),
        "metadata",
        "invalid_value",
    ),
    ("a metadata value not a string", body(metadata={"a": 1}), "metadata.a", "invalid_value"),
    ("NUL in the model", body(model="gpt\x00tiny"), "model", "invalid_value"),
    ("NUL in a fine-tuned model name", body(model="ft:a\x00b"), "model", "invalid_value"),
    ("NUL in the file id", body(training_file="file-\x00"), "training_file", "invalid_value"),
    ("NUL in metadata", body(metadata={"k": "v\x00"}), "metadata.k", "invalid_value"),
    (
        "NUL in the engine",
        body(engine={"exclude_from_chunks": ["\x00"]}),
        "engine.exclude_from_chunks.0",
        "invalid_value",
    ),
]


@pytest.mark.parametrize("path", [JOBS, f"{JOBS}/validate"], ids=["create", "validate"])
@pytest.mark.parametrize(
    ("make", "param", "code"), [c[1:] for c in BAD_BODIES], ids=[c[0] for c in BAD_BODIES]
)
def test_a_bad_job_body_is_a_400_naming_the_field_and_stores_nothing(
    api, ids, path, make, param, code
):
    before = stored_jobs(api)
    r = post_json(api, path, make(ids))
    err = assert_envelope(r, 400, param=param, code=code)
    assert err["type"] == "invalid_request_error"
    assert stored_jobs(api) == before


# JSON the standard library parses but no store or JSON parser elsewhere takes: NaN,
# Infinity and 1e400 (which Python reads as inf), and a lone surrogate ("\ud800", no UTF-8)
RAW_BODIES = [
    (
        "NaN multiplier",
        '"hyperparameters": {"learning_rate_multiplier": NaN}',
        "hyperparameters.learning_rate_multiplier",
    ),
    ("Infinity seed", '"seed": Infinity', "seed"),
    (
        "-Infinity n_epochs",
        '"hyperparameters": {"n_epochs": -Infinity}',
        "hyperparameters.n_epochs",
    ),
    (
        "NaN in the engine",
        '"engine": {"memory": {"host_budget": NaN}}',
        "engine.memory.host_budget",
    ),
    ("1e400 in the engine", '"engine": {"optimizer": {"lr": 1e400}}', "engine.optimizer.lr"),
    ("a lone surrogate in a metadata value", '"metadata": {"k": "\\ud800"}', "metadata.k"),
    ("a lone surrogate in a key", '"metadata": {"\\udfff": "v"}', None),
    (
        "a lone surrogate in the engine",
        '"engine": {"exclude_from_chunks": ["\\ud800"]}',
        "engine.exclude_from_chunks.0",
    ),
]


@pytest.mark.parametrize("path", [JOBS, f"{JOBS}/validate"], ids=["create", "validate"])
@pytest.mark.parametrize(
    ("extra", "param"), [c[1:] for c in RAW_BODIES], ids=[c[0] for c in RAW_BODIES]
)
def test_non_finite_numbers_and_lone_surrogates_are_a_400_and_store_nothing(
    api, ids, path, extra, param
):
    before = stored_jobs(api)
    raw = f'{{"model": "gpt-tiny", "training_file": "{ids.file}", {extra}}}'
    err = assert_envelope(post_json(api, path, raw), 400, code="invalid_value")
    if param is not None:
        assert err["param"] == param
    assert err["param"]  # some field is named
    err["message"].encode("utf-8")  # the message itself is valid UTF-8
    assert stored_jobs(api) == before


@pytest.mark.parametrize(
    "raw",
    [
        '{"model": "gpt-tiny",',
        "{'model': 'gpt-tiny'}",
        '{"model": "gpt-tiny"} trailing',
        "\xff\xfe",
    ],
    ids=["cut off", "single quotes", "trailing text", "not UTF-8"],
)
def test_malformed_json_is_a_400_invalid_json(api, raw):
    before = stored_jobs(api)
    content = raw.encode("latin-1")
    assert_envelope(post_json(api, JOBS, content), 400, param="body", code="invalid_json")
    assert stored_jobs(api) == before


@pytest.mark.parametrize(
    "raw", ["[]", '"a job"', "null", "42", ""], ids=["list", "string", "null", "number", "empty"]
)
def test_a_body_that_is_not_an_object_is_a_400(api, raw):
    before = stored_jobs(api)
    assert_envelope(post_json(api, JOBS, raw), 400, param="body")
    assert stored_jobs(api) == before


def test_json_nested_past_the_parsers_limit_is_a_400(api, ids):
    deep = "[" * 100_000 + "]" * 100_000
    raw = f'{{"model": "gpt-tiny", "training_file": "{ids.file}", "engine": {{"x": {deep}}}}}'
    before = stored_jobs(api)
    assert_envelope(post_json(api, JOBS, raw), 400)
    assert stored_jobs(api) == before


def test_an_engine_nested_too_deep_to_store_is_a_400(api, ids):
    deep: Any = 1
    for _ in range(40):
        deep = {"x": deep}
    r = post_json(api, JOBS, body(engine={"memory": deep})(ids))
    err = assert_envelope(r, 400, code="invalid_value")
    assert err["param"].startswith("engine.memory")


def test_an_empty_idempotency_key_is_a_400_and_does_not_use_up_the_key(api, ids):
    before = stored_jobs(api)
    r = post_json(api, JOBS, body()(ids), **{"Idempotency-Key": ""})
    assert_envelope(r, 400, param="idempotency-key")
    # a refused request does not claim its key: the same key then creates a job
    key = {"Idempotency-Key": f"hostile-{api.backend}"}
    assert_envelope(post_json(api, JOBS, body(seed=2**40)(ids), **key), 400, param="seed")
    r = post_json(api, JOBS, body(seed=1)(ids), **key)
    assert r.status_code == 200, r.text
    assert stored_jobs(api) == before | {r.json()["id"]}


def test_the_sdk_sees_bad_requests_as_bad_request_errors(api, ids):
    c = api.client()
    before = stored_jobs(api)
    with pytest.raises(openai.BadRequestError) as err:
        c.fine_tuning.jobs.create(model="no-such-model", training_file=ids.file)
    assert err.value.body["param"] == "model"
    assert err.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as err:
        c.fine_tuning.jobs.create(
            model="gpt-tiny", training_file=ids.file, hyperparameters={"n_epochs": 0}
        )
    assert err.value.body["param"] == "hyperparameters.n_epochs"
    assert stored_jobs(api) == before


# -- uploads ------------------------------------------------------------------------------


def multipart(
    parts: list[tuple[str, str | None, bytes]], boundary: str = "hostile-b0undary"
) -> tuple[bytes, str]:
    """A multipart/form-data body written byte for byte (no client escaping of names)."""
    out = b""
    for name, filename, data in parts:
        disp = f'form-data; name="{name}"'
        if filename is not None:
            disp += f'; filename="{filename}"'
        out += f"--{boundary}\r\nContent-Disposition: {disp}\r\n\r\n".encode() + data + b"\r\n"
    out += f"--{boundary}--\r\n".encode()
    return out, f"multipart/form-data; boundary={boundary}"


def upload_raw(api, content: bytes, content_type: str | None) -> httpx.Response:
    headers = api.headers()
    if content_type is not None:
        headers["Content-Type"] = content_type
    return httpx.post(f"{api.base}/files", content=content, headers=headers)


@pytest.fixture
def nothing_stored(api):
    """Assert, after the test, that it stored no file, in the store or on disk (where no
    temporary `.part` file may be left behind either)."""
    files, entries = stored_files(api), files_dir_entries(api)
    yield
    assert stored_files(api) == files
    assert files_dir_entries(api) == entries


def test_an_upload_over_the_limit_is_a_413(api, nothing_stored):
    assert api.settings.max_upload_bytes == 64 * 1024
    big = b"".join(json.dumps({"text": "x" * 1000}).encode() + b"\n" for _ in range(70))
    assert len(big) > 64 * 1024
    content, ctype = multipart([("purpose", None, b"fine-tune"), ("file", "big.jsonl", big)])
    assert_envelope(upload_raw(api, content, ctype), 413, param="file", code="file_too_large")


def test_the_sdk_sees_an_upload_over_the_limit_as_a_413(api, nothing_stored):
    big = io.BytesIO(b'{"text": "' + b"y" * (65 * 1024) + b'"}\n')
    with pytest.raises(openai.APIStatusError) as err:
        api.client().files.create(file=("big.jsonl", big), purpose="fine-tune")
    assert err.value.status_code == 413
    assert err.value.body["code"] == "file_too_large"


def test_bad_lines_are_a_400_that_names_each_by_number(api, nothing_stored):
    lines = [
        chat_lines(1)[0].encode(),  # 1: good: the file is chat
        b'{"messages": [{"role": "user", "content": "hi"}',  # 2: cut-off JSON
        b"[1, 2, 3]",  # 3: not an object
        b'{"prompt": "a", "completion": "b"}',  # 4: completion in a chat file
        b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}',  # 5: not UTF-8
        b'{"messages": [{"role": "wizard", "content": "x"}]}',  # 6: unknown role
        b'{"messages": [{"role": "user", "content": "hi"}]}',  # 7: nothing to train on
        b'{"messages": ' + b"[" * 20_000 + b"]" * 20_000 + b"}",  # 8: past the parser's depth
        chat_lines(1, offset=3)[0].encode(),  # 9: good
    ]
    content, ctype = multipart(
        [("file", "bad.jsonl", b"\n".join(lines) + b"\n"), ("purpose", None, b"fine-tune")]
    )
    err = assert_envelope(upload_raw(api, content, ctype), 400, param="file")
    assert err["code"] == "invalid_file_format"
    for n in (2, 3, 4, 5, 6, 7, 8):
        assert f"line {n}:" in err["message"], err["message"]
    assert "line 8: nested too deeply" in err["message"]
    assert "line 1:" not in err["message"]
    assert "line 9:" not in err["message"]
    assert "7 bad line(s)" in err["message"]


@pytest.mark.parametrize(
    "data",
    [b"", b"\n\n   \n", b'{"text": ""}\n'],
    ids=["empty", "blank lines only", "an empty example"],
)
def test_a_file_without_examples_is_a_400(api, nothing_stored, data):
    content, ctype = multipart([("file", "none.jsonl", data), ("purpose", None, b"fine-tune")])
    err = assert_envelope(upload_raw(api, content, ctype), 400, param="file")
    assert err["code"] == "invalid_file_format"


@pytest.mark.parametrize(
    ("parts", "param", "code"),
    [
        ([("file", "a.jsonl", GOOD)], "purpose", "invalid_value"),
        ([("file", "a.jsonl", GOOD), ("purpose", None, b"assistants")], "purpose", "invalid_value"),
        ([("file", "a.jsonl", GOOD), ("purpose", None, b"x" * 5000)], "purpose", "invalid_value"),
        ([("purpose", None, b"fine-tune")], "file", "missing_file"),
        ([("data", "a.jsonl", GOOD), ("purpose", None, b"fine-tune")], "file", "missing_file"),
        (
            [("file", "a.jsonl", GOOD), ("file", "b.jsonl", GOOD), ("purpose", None, b"fine-tune")],
            "file",
            "invalid_value",
        ),
    ],
    ids=[
        "purpose missing",
        "purpose assistants",
        "purpose 5000 bytes",
        "no file field",
        "the file under another name",
        "two files",
    ],
)
def test_a_wrong_form_is_a_400_naming_the_field(api, nothing_stored, parts, param, code):
    content, ctype = multipart(parts)
    assert_envelope(upload_raw(api, content, ctype), 400, param=param, code=code)


@pytest.mark.parametrize(
    ("content", "content_type", "code"),
    [
        (b'{"purpose": "fine-tune"}', "application/json", "invalid_content_type"),
        (GOOD, None, "invalid_content_type"),
        (GOOD, "multipart/form-data", "invalid_content_type"),  # no boundary
        (b"garbage, not parts", "multipart/form-data; boundary=b", "invalid_multipart"),
        (
            b'--b\r\nContent-Disposition: form-data; name="file"; filename="a"\r\n\r\n' + GOOD,
            "multipart/form-data; boundary=b",
            "invalid_multipart",
        ),
    ],
    ids=["json", "no content type", "no boundary", "garbage", "cut off"],
)
def test_a_body_that_is_not_a_whole_multipart_form_is_a_400(
    api, nothing_stored, content, content_type, code
):
    assert_envelope(upload_raw(api, content, content_type), 400, code=code)


@pytest.mark.parametrize(
    ("name", "label"),
    [
        ("../../etc/passwd", "passwd"),
        ("../escape.jsonl", "escape.jsonl"),
        ("/abs/x.jsonl", "x.jsonl"),
        ("a\\b.jsonl", "b.jsonl"),
        ("..\\..\\win.jsonl", "win.jsonl"),
        ("x\x01\x1f\x7fy.jsonl", "xy.jsonl"),
        ("nul\x00.jsonl", "nul.jsonl"),
        ("..", "upload"),
        (".", "upload"),
        ("dir/", "upload"),
        ("", "upload"),
        ("n" * 400 + ".jsonl", "n" * 255),
    ],
    ids=[
        "dotdot",
        "dotdot one level",
        "absolute",
        "backslash",
        "windows dotdot",
        "control characters",
        "NUL",
        "parent",
        "current",
        "a directory",
        "empty",
        "400 characters",
    ],
)
def test_a_path_like_filename_is_only_a_label(api, name, label):
    files_dir: Path = api.settings.files_dir
    before = files_dir_entries(api)
    content, ctype = multipart([("purpose", None, b"fine-tune"), ("file", name, GOOD)])
    r = upload_raw(api, content, ctype)
    assert r.status_code == 200, r.text
    f = r.json()
    assert f["filename"] == label
    assert "/" not in f["filename"]
    assert "\\" not in f["filename"]
    assert not any(ord(ch) < 32 or ord(ch) == 127 for ch in f["filename"])
    # stored under files_dir by the id the server chose, byte for byte, and nowhere else
    assert files_dir_entries(api) == before | {f["id"]}
    assert (files_dir / f["id"]).read_bytes() == GOOD
    for where in {name, name.replace("\\", "/")}:
        if where.strip("/. ") and "\x00" not in where and len(where) < 255:
            outside = (files_dir / where).resolve()
            assert not outside.exists() or outside == files_dir.resolve(), outside


def test_a_path_like_filename_through_the_sdk_is_only_a_label(api):
    f = api.client().files.create(file=("../../x/y.jsonl", io.BytesIO(GOOD)), purpose="fine-tune")
    assert f.filename == "y.jsonl"
    assert (api.settings.files_dir / f.id).read_bytes() == GOOD


# -- query and path parameters ------------------------------------------------------------


def get(api, path: str) -> httpx.Response:
    return httpx.get(api.base + path, headers=api.headers())


@pytest.mark.parametrize(
    ("path", "param"),
    [
        (f"{JOBS}?limit=0", "limit"),
        (f"{JOBS}?limit=101", "limit"),
        (f"{JOBS}?limit=x", "limit"),
        (f"{JOBS}?limit=99999999999999999999999", "limit"),
        (f"{JOBS}?status=bogus", "status"),
        (f"{JOBS}?after=%00", "after"),
        (f"{JOBS}?metadata[k]=%00", "metadata[k]"),
        ("/files?limit=0", "limit"),
        ("/files?limit=10001", "limit"),
        ("/files?order=sideways", "order"),
        ("/files?purpose=fine%00tune", "purpose"),
        ("/files/%00", "file_id"),
        ("/models/ft:%00", "model"),
        (f"{JOBS}/%00", "fine_tuning_job_id"),
    ],
)
def test_a_bad_query_or_path_parameter_is_a_400_naming_it(api, path, param):
    assert_envelope(get(api, path), 400, param=param, code="invalid_value")


@pytest.mark.parametrize(
    ("query", "param"),
    [
        ("events?after=42", "after"),
        ("events?after=ftevent-x", "after"),
        ("events?after=ftevent-", "after"),
        ("events?after=ftevent-1234567890123456789", "after"),
        ("events?after=event-1", "after"),
        ("events?limit=1001", "limit"),
        ("events?type=bogus", "type"),
        ("checkpoints?limit=0", "limit"),
        ("checkpoints?after=%00", "after"),
        ("metrics?step_from=-1", "step_from"),
        ("metrics?step_to=2147483648", "step_to"),
        ("metrics?step_from=x", "step_from"),
        ("logs?attempt=0", "attempt"),
        ("logs?attempt=x", "attempt"),
        ("logs?attempt=5", "attempt"),  # an attempt the job has not had
        ("logs?follow=maybe", "follow"),
    ],
)
def test_a_bad_parameter_on_a_jobs_subresource_is_a_400_naming_it(api, ids, query, param):
    assert_envelope(get(api, f"{JOBS}/{ids.job}/{query}"), 400, param=param, code="invalid_value")


def test_the_largest_step_and_event_cursor_are_fine(api, ids):
    r = get(api, f"{JOBS}/{ids.job}/metrics?step_from=0&step_to=2147483647")
    assert r.status_code == 200, r.text
    # events page to older ones: after the largest cursor come all of them, the job's
    # "Created" event among them
    r = get(api, f"{JOBS}/{ids.job}/events?after=ftevent-999999999999999999&limit=1000")
    assert r.status_code == 200, r.text
    assert any(e["message"].startswith("Created") for e in r.json()["data"])


@pytest.mark.parametrize(
    "path",
    [
        "/v1/nope",
        "/nope",
        "/v1/files/x/y/z",
        "/v1/files/..%2F..%2Fetc%2Fpasswd/content",
        "/v1/fine_tuning",
        "/v2/files",
    ],
)
def test_an_unknown_route_is_a_404_envelope(api, path):
    r = httpx.get(api.url + path, headers=api.headers())
    assert_envelope(r, 404, code="unknown_url")


@pytest.mark.parametrize(
    ("method", "path", "allowed"),
    [
        ("PUT", "/v1/files", "GET, POST"),
        ("DELETE", "/v1/models", "GET"),
        ("PATCH", f"/v1{JOBS}/ftjob-x", "GET"),
        ("GET", f"/v1{JOBS}/ftjob-x/cancel", "POST"),
        ("DELETE", f"/v1{JOBS}/validate", "POST"),
        ("POST", "/healthz", "GET"),
    ],
)
def test_a_wrong_method_is_a_405_envelope_with_allow(api, method, path, allowed):
    r = httpx.request(method, api.url + path, headers=api.headers())
    assert_envelope(r, 405, code="method_not_allowed")
    assert r.headers["allow"] == allowed


def test_a_404_for_another_tenants_objects_is_the_same_as_for_none(api, ids):
    theirs = httpx.get(f"{api.base}/files/{ids.rivals_file}", headers=api.headers())
    nobodys = httpx.get(f"{api.base}/files/file-nope", headers=api.headers())
    a = assert_envelope(theirs, 404, param="file_id", code="file_not_found")
    b = assert_envelope(nobodys, 404, param="file_id", code="file_not_found")
    assert a["message"].replace(ids.rivals_file, "X") == b["message"].replace("file-nope", "X")
