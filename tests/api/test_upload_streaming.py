"""An upload is streamed to disk: the server never holds the file whole in memory, and other
requests are answered while it is being received."""

from __future__ import annotations

import hashlib
import threading
import tracemalloc

import httpx

from tests.api.conftest import TOKENS, start_api
from tests.tiny import chat_lines

BOUNDARY = "pstar-test-boundary"
FILE_BYTES = 12 << 20  # its time is tracemalloc's; the peak (~5 MiB measured) is not the size's


def _body(line_block: bytes, blocks: int):
    """A multipart body generated piece by piece, so the client does not hold it either."""
    yield (
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nfine-tune\r\n'
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"; '
        'filename="big.jsonl"\r\nContent-Type: application/jsonl\r\n\r\n'
    ).encode()
    for _ in range(blocks):
        yield line_block
    yield f"\r\n--{BOUNDARY}--\r\n".encode()


def test_a_large_upload_is_stored_without_holding_it_in_memory(tmp_path):
    api, stop = start_api(
        tmp_path, f"sqlite:///{tmp_path / 'store.db'}", "sqlite", max_upload=64 << 20
    )
    try:
        block = ("\n".join(chat_lines(200)) + "\n").encode()
        blocks = FILE_BYTES // len(block)
        digest = hashlib.sha256(block * blocks).hexdigest()
        headers = {
            "Authorization": f"Bearer {TOKENS['acme']}",
            "Content-Type": f"multipart/form-data; boundary={BOUNDARY}",
        }
        answered: list[int] = []
        uploading = threading.Event()

        def poll_while_uploading() -> None:
            uploading.wait(30)
            with httpx.Client(timeout=30) as h:
                while uploading.is_set():
                    answered.append(h.get(f"{api.url}/healthz").status_code)

        poller = threading.Thread(target=poll_while_uploading)
        poller.start()
        tracemalloc.start()
        try:
            uploading.set()
            rep = httpx.post(
                f"{api.base}/files",
                content=_body(block, blocks),
                headers=headers,
                timeout=300,
            )
            _, peak = tracemalloc.get_traced_memory()
        finally:
            uploading.clear()
            tracemalloc.stop()
            poller.join(30)
        assert rep.status_code == 200, rep.text
        f = rep.json()
        assert f["bytes"] == len(block) * blocks > 10 << 20
        assert f["sha256"] == digest
        assert f["examples"] == 200 * blocks
        # every Python allocation of this process (server, client, poller) together peaked
        # below the file's size
        assert peak < 8 << 20, f"peak traced memory {peak / 2**20:.1f} MiB"
        # the event loop was free to answer others during the upload
        assert len(answered) >= 3
        assert set(answered) == {200}
    finally:
        stop()
