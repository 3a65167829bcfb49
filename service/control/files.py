"""Uploads: a multipart body streamed to disk, size-limited, checksummed and validated line
by line as it arrives, so a file is never held whole in memory and a bad one is never
stored.

The stored name is the file id the service chose; the client's filename is kept only as
a label (its last path component, cleaned), never used as a path.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

from python_multipart.multipart import MultipartParser, parse_options_header

from service.data.datasets import MAX_LINE_BYTES, LineValidator
from service.errors import Conflict, InvalidRequest, NotFound, QuotaExceeded, ServiceError, TooLarge
from service.settings import Limits, Settings
from service.store import File, Store, new_id
from service.store.statements import View

PURPOSES = ("fine-tune",)
MAX_FIELD_BYTES = 1024
MAX_HEADER_BYTES = 8 << 10  # one part header's name + value
MAX_PART_HEADERS = 16
MAX_PARTS = 8  # 'file', 'purpose' and a few a client may add
FORM_OVERHEAD_BYTES = 64 << 10  # boundaries, part headers and small fields around the file
UPLOAD_IDLE_TIMEOUT_S = 60.0  # a body that sends nothing for this long is dropped
FEED_BATCH_BYTES = 1 << 20  # received bytes handed to the parsing thread at a time
DRAIN_AFTER_LIMIT = 64 << 20  # read (and drop) this much past the limit so the client sees the 413
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def clean_filename(raw: str) -> str:
    """A label for display: the last path component, no control characters, at most 255;
    "upload" when nothing is left or what is left names a directory ("." or "..")."""
    name = _CONTROL.sub("", raw.replace("\\", "/").rsplit("/", 1)[-1]).strip()
    return (name if name not in ("", ".", "..") else "upload")[:255]


@dataclass
class _Part:
    headers: dict[bytes, bytes] = field(default_factory=dict)
    name: str = ""
    filename: str | None = None
    value: bytearray = field(default_factory=bytearray)


class _Upload:
    """Multipart callbacks: the `file` part goes to disk and through the line validator."""

    def __init__(self, tmp: Path, limit: int) -> None:
        self.tmp, self.limit = tmp, limit
        self.out = None
        self.parts = 0
        self._headers = 0
        self.sha = hashlib.sha256()
        self.size = 0
        self.validator = LineValidator()
        self._pending = bytearray()  # the unfinished last line
        self._overlong = False  # inside a line over MAX_LINE_BYTES: dropped until its end
        self.fields: dict[str, str] = {}
        self.file_parts = 0
        self.filename = "upload"
        self.too_large = False
        self.ended = False  # the closing boundary was seen: the body is complete
        self._part = _Part()
        self._hname = bytearray()
        self._hvalue = bytearray()

    # header parsing
    def on_part_begin(self) -> None:
        self._part = _Part()
        self.parts += 1
        self._headers = 0
        if self.parts > MAX_PARTS:
            raise InvalidRequest(
                f"the form has more than {MAX_PARTS} parts; send 'file' and 'purpose'",
                param="file",
                code="invalid_multipart",
            )

    def on_header_field(self, data: bytes, start: int, end: int) -> None:
        self._hname += data[start:end]
        self._header_size()

    def on_header_value(self, data: bytes, start: int, end: int) -> None:
        self._hvalue += data[start:end]
        self._header_size()

    def _header_size(self) -> None:
        if len(self._hname) + len(self._hvalue) > MAX_HEADER_BYTES:
            raise InvalidRequest(
                f"a part header of the form is longer than {MAX_HEADER_BYTES} bytes",
                param="file",
                code="invalid_multipart",
            )

    def on_header_end(self) -> None:
        self._headers += 1
        if self._headers > MAX_PART_HEADERS:
            raise InvalidRequest(
                f"a part of the form has more than {MAX_PART_HEADERS} headers",
                param="file",
                code="invalid_multipart",
            )
        self._part.headers[bytes(self._hname).lower()] = bytes(self._hvalue)
        self._hname.clear()
        self._hvalue.clear()

    def on_headers_finished(self) -> None:
        disp = self._part.headers.get(b"content-disposition", b"")
        _kind, params = parse_options_header(disp)
        self._part.name = params.get(b"name", b"").decode("utf-8", "replace")
        if b"filename" in params:
            self._part.filename = params[b"filename"].decode("utf-8", "replace")
        if self._part.name == "file":
            self.file_parts += 1
            self.filename = clean_filename(self._part.filename or "upload")
            if self.out is None:
                self.out = self.tmp.open("wb")

    def on_part_data(self, data: bytes, start: int, end: int) -> None:
        chunk = data[start:end]
        if self._part.name != "file":
            if len(self._part.value) + len(chunk) > MAX_FIELD_BYTES:
                raise InvalidRequest(
                    f"form field '{self._part.name}' is longer than {MAX_FIELD_BYTES} bytes",
                    param=self._part.name or None,
                    code="invalid_value",
                )
            self._part.value += chunk
            return
        # every byte of a file part counts, also of a second one (refused, never stored)
        self.size += len(chunk)
        if self.size > self.limit:
            self.too_large = True
        if self.file_parts > 1 or self.too_large:
            return
        self.out.write(chunk)
        self.sha.update(chunk)
        self._lines(chunk)

    def on_part_end(self) -> None:
        if self._part.name == "file":
            if self._pending and not self.too_large and not self._overlong:
                self.validator.feed(bytes(self._pending))
                self._pending.clear()
        elif self._part.name:
            self.fields[self._part.name] = self._part.value.decode("utf-8", "replace")

    def on_end(self) -> None:
        self.ended = True

    def _lines(self, chunk: bytes) -> None:
        start = 0
        while (nl := chunk.find(b"\n", start)) >= 0:
            if not self._overlong:
                self._pending += chunk[start:nl]
                self.validator.feed(bytes(self._pending).rstrip(b"\r"))
            self._overlong = False
            self._pending.clear()
            start = nl + 1
        if not self._overlong:
            self._pending += chunk[start:]
            if len(self._pending) > MAX_LINE_BYTES:  # reported once, the rest of it dropped
                self.validator.feed(bytes(self._pending))
                self._pending.clear()
                self._overlong = True

    def callbacks(self) -> dict:
        return {
            "on_part_begin": self.on_part_begin,
            "on_part_data": self.on_part_data,
            "on_part_end": self.on_part_end,
            "on_header_field": self.on_header_field,
            "on_header_value": self.on_header_value,
            "on_header_end": self.on_header_end,
            "on_headers_finished": self.on_headers_finished,
            "on_end": self.on_end,
        }


async def receive_upload(
    settings: Settings,
    store: Store,
    tenant: str,
    content_type: str | None,
    content_length: str | None,
    body: AsyncIterator[bytes],
) -> File:
    """Stream a `POST /v1/files` body to disk; the stored `File`, or a `ServiceError`."""
    kind, params = parse_options_header(content_type or "")
    boundary = params.get(b"boundary")
    if kind != b"multipart/form-data" or not boundary:
        raise InvalidRequest(
            "send the file as multipart/form-data with fields 'file' and 'purpose'",
            param="file",
            code="invalid_content_type",
        )
    quota = settings.limits.max_file_bytes_per_tenant
    used = await asyncio.to_thread(store.files.total_bytes, tenant)
    if used >= quota:
        raise _over_quota(tenant, used, quota)
    limit = min(settings.max_upload_bytes, quota - used)
    if (
        content_length
        and content_length.isdigit()
        and int(content_length) > limit + FORM_OVERHEAD_BYTES + DRAIN_AFTER_LIMIT
    ):
        raise _too_large(settings, tenant, limit, used)
    settings.files_dir.mkdir(parents=True, exist_ok=True)
    file_id = new_id("file")
    tmp = settings.files_dir / f".{file_id}.part"
    up = _Upload(tmp, limit)
    parser = MultipartParser(boundary, up.callbacks())

    def feed(chunks: list[bytes]) -> None:
        for chunk in chunks:
            parser.write(chunk)

    received = 0
    try:
        # parsing, validating lines and writing the file block: they run in a worker
        # thread, a batch of received chunks at a time, so other requests keep being served
        batch: list[bytes] = []
        batched = 0
        stream = aiter(body)
        while True:
            try:
                async with asyncio.timeout(UPLOAD_IDLE_TIMEOUT_S):
                    chunk = await anext(stream)
            except StopAsyncIteration:
                break
            except TimeoutError:
                raise InvalidRequest(
                    f"the upload sent nothing for {UPLOAD_IDLE_TIMEOUT_S:.0f} s; send it again",
                    param="file",
                    code="upload_timeout",
                ) from None
            received += len(chunk)
            batch.append(chunk)
            batched += len(chunk)
            if batched >= FEED_BATCH_BYTES:
                await asyncio.to_thread(feed, batch)
                batch, batched = [], 0
                # every byte of the body counts (a chunked body has no length to refuse)
                if up.too_large or received > limit + FORM_OVERHEAD_BYTES:
                    up.too_large = True
                    if received > limit + FORM_OVERHEAD_BYTES + DRAIN_AFTER_LIMIT:
                        break
        await asyncio.to_thread(feed, batch)
        parser.finalize()
    except ValueError as e:  # the multipart parser's own errors
        _discard(up, tmp)
        raise InvalidRequest(
            f"malformed multipart body: {e}", param="file", code="invalid_multipart"
        ) from None
    except BaseException:
        _discard(up, tmp)
        raise
    if received > limit + FORM_OVERHEAD_BYTES:
        up.too_large = True
    if up.out is not None:
        up.out.close()
    try:
        return await asyncio.to_thread(_store, settings, store, tenant, file_id, tmp, up, used)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _store(
    settings: Settings, store: Store, tenant: str, file_id: str, tmp: Path, up: _Upload, used: int
) -> File:
    if up.too_large:
        raise _too_large(settings, tenant, up.limit, used)
    if not up.ended:  # a cut-off body: its last part, the file's end maybe, is missing
        raise InvalidRequest(
            "malformed multipart body: it ends before its closing boundary",
            param="file",
            code="invalid_multipart",
        )
    if up.file_parts != 1:
        raise InvalidRequest(
            "send exactly one form field 'file' holding the data"
            + (f" (got {up.file_parts})" if up.file_parts else ""),
            param="file",
            code="missing_file" if not up.file_parts else "invalid_value",
        )
    purpose = up.fields.get("purpose")
    if purpose not in PURPOSES:
        raise InvalidRequest(
            f"purpose {purpose!r} is not supported; use 'fine-tune'"
            if purpose
            else "form field 'purpose' is required; use 'fine-tune'",
            param="purpose",
            code="invalid_value",
        )
    check = up.validator.check
    if not check.ok:
        raise InvalidRequest(
            f"{up.filename}: {check.summary()}", param="file", code="invalid_file_format"
        )
    os.replace(tmp, settings.files_dir / file_id)
    f = File(
        id=file_id,
        tenant=tenant,
        filename=up.filename,
        purpose=purpose,
        bytes=up.size,
        sha256=up.sha.hexdigest(),
        created_at=int(time.time()),
        status="processed",
        status_details=None,
        format=check.format or "text",
        examples=check.examples,
        storage_name=file_id,
    )
    try:
        return store.files.add(f)
    except BaseException:
        (settings.files_dir / file_id).unlink(missing_ok=True)
        raise


def _discard(up: _Upload, tmp: Path) -> None:
    if up.out is not None:
        up.out.close()
    tmp.unlink(missing_ok=True)


def _too_large(settings: Settings, tenant: str, limit: int, used: int) -> ServiceError:
    if limit < settings.max_upload_bytes:  # the tenant's storage left, not the upload limit
        return _over_quota(tenant, used, settings.limits.max_file_bytes_per_tenant)
    return TooLarge(
        f"the file is larger than this server's upload limit of {limit:,} bytes "
        "(PSTAR_MAX_UPLOAD_BYTES); split it or ask the operator to raise the limit",
        param="file",
        code="file_too_large",
    )


def _over_quota(tenant: str, used: int, quota: int) -> QuotaExceeded:
    return QuotaExceeded(
        f"tenant {tenant} stores {used:,} bytes of files and may store {quota:,} "
        f"({Limits.var('max_file_bytes_per_tenant')}); this upload would go over it: delete "
        "files it no longer needs (DELETE /v1/files/{id})",
        param="file",
        code="quota_exceeded",
    )


def sweep_partial_uploads(
    settings: Settings, older_than_s: float = 2 * UPLOAD_IDLE_TIMEOUT_S
) -> int:
    """Remove what uploads and result writes cut off by a crash left (`.*.part`). Only
    files untouched for `older_than_s`: an upload in flight (of another control plane on
    the same data dir) writes at least once per idle timeout."""
    n = 0
    cutoff = time.time() - older_than_s
    for p in settings.files_dir.glob(".*.part"):
        try:
            if p.stat().st_mtime < cutoff:
                p.unlink()
                n += 1
        except FileNotFoundError:
            continue
    return n


def file_path(settings: Settings, f: File | View) -> Path:
    return settings.files_dir / f.storage_name


def own_file(store: Store, tenant: str, file_id: str) -> File | View:
    """The tenant's file; a 404 for another tenant's, as for one that does not exist."""
    f = store.files.get(tenant, file_id)
    if f is None:
        raise NotFound("file", file_id, param="file_id")
    return f


def page_files(
    store: Store, tenant: str, after: str | None, limit: int, purpose: str | None, order: str
) -> tuple[list[File], bool]:
    return store.files.page(tenant, after, limit, purpose, order)


def delete_file(settings: Settings, store: Store, tenant: str, file_id: str) -> File:
    """Delete the tenant's file: a 409 while an unfinished job uses it, a 404 if it is
    not there (any more)."""
    job = store.files.in_use(tenant, file_id)
    if job is not None:
        raise Conflict(
            f"file {file_id} is used by job {job}, which has not finished; cancel the job "
            "or wait for it to end",
            param="file_id",
            code="file_in_use",
        )
    f = store.files.delete(tenant, file_id)
    if f is None:
        raise NotFound("file", file_id, param="file_id")
    (settings.files_dir / f.storage_name).unlink(missing_ok=True)
    from service.control import storage

    storage.erase_file_copies(settings, store, tenant, file_id)  # what jobs made of it
    return f
