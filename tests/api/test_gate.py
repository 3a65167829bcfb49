"""The gate before a body is read (api/gate.py): an anonymous request gets its 401 and an
oversized one its 413 without the server reading the body, so a 200 MB POST leaves the
server's memory where it was; within the limits, requests and uploads work as before.

The server runs in this process (tests/api/conftest.py), so its memory is this process's
resident set; the client sends from a 1 MiB buffer and stops once the answer has come."""

from __future__ import annotations

import io
import json
import socket
import threading
from urllib.parse import urlsplit

import pytest

from service.settings import Limits
from tests.api.conftest import TOKENS, start_api
from tests.tiny import chat_lines

LIMIT = 1 << 20
BIG = 200 << 20
JOBS = "/v1/fine_tuning/jobs"


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("gate")
    server, stop = start_api(
        data_dir,
        f"sqlite:///{data_dir / 'store.db'}",
        "sqlite",
        max_upload=4 * LIMIT,
        limits=Limits(max_request_bytes=LIMIT),
    )
    yield server
    stop()


def rss() -> int:
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


def post(url: str, path: str, total: int, *, key: str | None, chunked: bool = False):
    """POST `total` bytes to `path` over a raw connection, reading the answer while sending;
    (status, error envelope, bytes sent before the answer came)."""
    where = urlsplit(url)
    sock = socket.create_connection((where.hostname, where.port), timeout=60)
    head = [f"POST {path} HTTP/1.1", f"Host: {where.netloc}", "Content-Type: application/json"]
    if key:
        head.append(f"Authorization: Bearer {key}")
    head.append("Transfer-Encoding: chunked" if chunked else f"Content-Length: {total}")
    sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode())
    answer = bytearray()
    done = threading.Event()

    def read() -> None:
        try:
            while (data := sock.recv(1 << 16)) and not complete(answer):
                answer.extend(data)
        except OSError:
            pass
        done.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    block = b" " * (1 << 20)
    sent = 0
    try:
        while sent < total and not answer:
            sock.sendall(f"{len(block):x}\r\n".encode() + block + b"\r\n" if chunked else block)
            sent += len(block)
    except OSError:  # the server answered and closed: what it did not read, it refused
        pass
    assert done.wait(60), "the server neither answered nor closed the connection"
    sock.close()
    status_line, _, rest = bytes(answer).partition(b"\r\n")
    body = rest.partition(b"\r\n\r\n")[2]
    return int(status_line.split()[1]), json.loads(body)["error"], sent


def complete(answer: bytearray) -> bool:
    head, sep, body = bytes(answer).partition(b"\r\n\r\n")
    lengths = [x for x in head.lower().split(b"\r\n") if x.startswith(b"content-length:")]
    return bool(sep and lengths) and len(body) >= int(lengths[0].split(b":")[1])


@pytest.mark.parametrize(
    ("key", "chunked", "status", "code"),
    [
        (None, False, 401, "invalid_api_key"),
        ("tok-wrong-0123456789", True, 401, "invalid_api_key"),
        (TOKENS["acme"], False, 413, "request_too_large"),
        (TOKENS["acme"], True, 413, "request_too_large"),
    ],
    ids=["anonymous", "wrong-key-chunked", "keyed", "keyed-chunked"],
)
def test_a_200_mb_body_is_refused_before_it_is_read(api, key, chunked, status, code):
    before = rss()
    got, error, sent = post(api.url, JOBS, BIG, key=key, chunked=chunked)
    grew = rss() - before
    assert (got, error["code"]) == (status, code), error
    assert grew < 48 << 20, f"the server's memory grew by {grew / 2**20:.0f} MiB"
    # the answer came long before the body was sent: the server stopped reading it
    assert sent < 64 << 20, f"{sent / 2**20:.0f} MiB sent before the answer"
    if status == 413:
        assert f"{LIMIT:,} bytes" in error["message"]
        assert "PSTAR_MAX_REQUEST_BYTES" in error["message"]


def test_a_body_within_the_limit_reaches_its_route(api):
    # a padded but valid JSON request: the route's own validation answers it
    padding = " " * (LIMIT - 200)
    body = '{"model": "tiny-llama", "training_file": "file-nope"' + padding + "}"
    status, error, _ = post_json(api, body)
    assert (status, error["code"]) == (400, "file_not_found"), error


def test_an_upload_larger_than_the_request_limit_is_still_taken(api):
    lines = []
    while sum(len(x) + 1 for x in lines) < 2 * LIMIT:  # twice the JSON limit, under its own
        lines += chat_lines(64)
    data = ("\n".join(lines) + "\n").encode()
    f = api.client().files.create(file=("big.jsonl", io.BytesIO(data)), purpose="fine-tune")
    assert f.bytes == len(data)


def test_the_key_is_checked_once_and_the_route_gets_its_tenant(api):
    import httpx

    mine = httpx.get(f"{api.base}/files", headers=api.headers("acme")).json()["data"]
    theirs = httpx.get(f"{api.base}/files", headers=api.headers("rival")).json()["data"]
    assert mine  # the upload above is acme's
    assert not theirs
    r = httpx.get(f"{api.base}/files")
    assert r.status_code == 401
    assert r.headers["www-authenticate"] == "Bearer"


def post_json(api, body: str):
    import httpx

    r = httpx.post(
        api.url + JOBS,
        content=body.encode(),
        headers={**api.headers(), "Content-Type": "application/json"},
    )
    return r.status_code, r.json()["error"], len(body)
