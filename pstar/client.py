"""A small HTTP client of our API for the CLI (httpx): the routes the `openai` SDK has,
and ours. Errors come back as `ApiError` carrying the server's envelope message."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

DEFAULT_URL = "http://127.0.0.1:8000"


class ApiError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status, self.message = status, message


def find_token(data_dir: str | Path | None = None) -> str | None:
    """PSTAR_API_TOKEN, else the token `pstar serve` made in its data dir."""
    if tok := os.environ.get("PSTAR_API_TOKEN"):
        return tok
    d = Path(data_dir or os.environ.get("PSTAR_DATA_DIR") or "pstar-data")
    f = d / "api_token"
    return f.read_text().strip() if f.is_file() else None


class Client:
    def __init__(
        self, url: str = DEFAULT_URL, token: str | None = None, timeout: float = 60
    ) -> None:
        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout)

    def _check(self, r: httpx.Response) -> Any:
        if r.status_code >= 400:
            try:
                msg = r.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                msg = r.text[:500]
            raise ApiError(r.status_code, msg)
        return (
            r.json() if r.headers.get("content-type", "").startswith("application/json") else r.text
        )

    def get(self, path: str, **params: Any) -> Any:
        return self._check(
            self.http.get(path, params={k: v for k, v in params.items() if v is not None})
        )

    def post(self, path: str, json: Any = None, headers: dict[str, str] | None = None) -> Any:
        return self._check(self.http.post(path, json=json, headers=headers))

    def healthy(self) -> bool:
        try:
            return self.http.get("/healthz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def upload(self, path: Path, purpose: str = "fine-tune") -> dict[str, Any]:
        with path.open("rb") as f:
            r = self.http.post(
                "/v1/files", files={"file": (path.name, f)}, data={"purpose": purpose}, timeout=None
            )
        return self._check(r)

    def events(self, job_id: str, limit: int = 100) -> list[dict[str, Any]]:
        """All events of a job, oldest first."""
        out, after = [], None
        while True:
            page = self.get(f"/v1/fine_tuning/jobs/{job_id}/events", limit=limit, after=after)
            out.extend(page["data"])
            if not page["has_more"] or not page["data"]:
                return out[::-1]
            after = page["data"][-1]["id"]

    def chat_stream(
        self, model: str, messages: list[dict[str, str]], **params: Any
    ) -> Iterator[str]:
        """The pieces of a chat completion's answer as they arrive (server-sent events)."""
        import json

        body = {"model": model, "messages": messages, "stream": True, **params}
        with self.http.stream("POST", "/v1/chat/completions", json=body, timeout=None) as r:
            if r.status_code >= 400:
                r.read()
                self._check(r)
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise ApiError(500, chunk["error"].get("message", "generation failed"))
                for choice in chunk.get("choices") or []:
                    if text := (choice.get("delta") or {}).get("content"):
                        yield text

    def stream_logs(self, job_id: str) -> Iterator[str]:
        with self.http.stream(
            "GET", f"/v1/fine_tuning/jobs/{job_id}/logs", params={"follow": "true"}, timeout=None
        ) as r:
            if r.status_code >= 400:
                r.read()
                self._check(r)
            yield from r.iter_text()
